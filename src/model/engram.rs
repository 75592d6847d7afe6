//! Engram (docs/DESIGN.md, "Engram") on the CPU: n-gram addresses and the module's output. The GPU
//! twins are `shaders/engram_gather.wgsl` and `shaders/engram_mix.wgsl`.

use crate::model::config::EngramConfig;

/// Address of position `t` for order `n` and head `j`: FNV-1a over the compressed ids
/// `c[t - n + 1] ..= c[t]`, seeded per head, modulo `rows`. A position before 0 holds token id 0,
/// so its compressed id is `before_start = cid_map[0]` (the seed builds the ids of a row's first
/// tokens from `prev = 0` and maps them through `cid_map` like any other token).
pub fn address(cids: &[u32], before_start: u32, t: usize, n: usize, j: usize, rows: usize) -> usize {
    let mut h = 0x811C_9DC5u32.wrapping_add((j as u32).wrapping_mul(0x9E37_79B9));
    for q in (t as i64 - n as i64 + 1)..=(t as i64) {
        let c = if q < 0 { before_start } else { cids[q as usize] };
        h = (h ^ c).wrapping_mul(0x0100_0193);
    }
    (h % rows as u32) as usize
}

fn rms(x: &[f32], eps: f32) -> Vec<f64> {
    let ss: f64 = x.iter().map(|&v| v as f64 * v as f64).sum();
    let inv = 1.0 / (ss / x.len() as f64 + eps as f64).sqrt();
    x.iter().map(|&v| v as f64 * inv).collect()
}

/// The residual `alpha * v` Engram adds to `x` at position `t`, given the row's compressed ids
/// and the compressed id of token 0 (what positions before the row's start hold).
#[allow(clippy::too_many_arguments)]
pub fn residual(
    e: &EngramConfig,
    tables: &[crate::model::weights::Matrix],
    w_kv: &crate::model::weights::Matrix,
    x: &[f32],
    cids: &[u32],
    before_start: u32,
    t: usize,
    eps: f32,
) -> Vec<f32> {
    let d = x.len();
    let mut et = Vec::with_capacity(e.width());
    for (oi, &n) in e.orders.iter().enumerate() {
        for j in 0..e.heads {
            let a = address(cids, before_start, t, n, j, e.table_rows);
            et.extend_from_slice(tables[oi * e.heads + j].row(a));
        }
    }
    let kv: Vec<f64> =
        (0..2 * d).map(|r| w_kv.row(r).iter().zip(&et).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>()).collect();
    let k: Vec<f32> = kv[..d].iter().map(|&v| v as f32).collect();
    let (nx, nk) = (rms(x, eps), rms(&k, eps));
    let dot: f64 = nx.iter().zip(&nk).map(|(a, b)| a * b).sum();
    let alpha = 1.0 / (1.0 + (-dot / (d as f64).sqrt()).exp());
    kv[d..].iter().map(|&v| (alpha * (v as f32) as f64) as f32).collect()
}
