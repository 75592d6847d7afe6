// Per-head RMS norm (qk-norm, optional) then RoPE at each token's own position, in place.
// Token n = r * C + j of the chunk is rotated by position rows[r].rope_pos0 + j (its slot, plus any
// positions the row skipped as padding; at most max_len - 1, checked on the host). RoPE is the half-split
// (`rotate_half`) layout: pairs (i, i + D/2) rotate by angle pos * theta^(-2i/D), read from a table
// computed on the host in f64 (GPU sin/cos of large arguments is not accurate on every backend).
// Keys are rotated once, here, before they are stored: they are never rotated again.

override HEADS: u32;               // query heads at the start of each row of t
override D: u32;                   // head_dim (even)
override STRIDE: u32;              // floats per token row of t
override NORM: bool = false;       // qk-norm before RoPE
override HAS_WEIGHT: bool = false; // qk-norm of the queries has a weight [D]
override EPS: f32 = 1e-6;
// Keys in the same dispatch (a layer's queries and fresh keys are rotated together): T_K_HEADS
// heads of t right after its queries (writer layers' global keys), then K_HEADS heads at the start
// of each row of t_k (K_STRIDE floats; local layers' keys). Keys are normed with k_weight.
override T_K_HEADS: u32 = 0u;
override K_HEADS: u32 = 0u;
override K_STRIDE: u32 = 1u;
override HAS_K_WEIGHT: bool = false;
override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<storage, read> rows: array<RowInfo>;      // [R]
@group(0) @binding(2) var<storage, read_write> t: array<f32>;       // [R * C, STRIDE]
@group(0) @binding(3) var<storage, read> weight: array<f32>;        // [D] (unused without HAS_WEIGHT)
@group(0) @binding(4) var<storage, read> rope: array<vec2<f32>>;    // [max_len, D/2] (cos, sin)
@group(0) @binding(5) var<storage, read_write> t_k: array<f32>;     // [R * C, K_STRIDE] (unused without K_HEADS)
@group(0) @binding(6) var<storage, read> k_weight: array<f32>;      // [D] (unused without HAS_K_WEIGHT)

fn load(in_tk: bool, i: u32) -> f32 {
    if in_tk { return t_k[i]; }
    return t[i];
}

fn store(in_tk: bool, i: u32, v: f32) {
    if in_tk { t_k[i] = v; } else { t[i] = v; }
}

// Thread (token n, head h), or (token n, head h, pair i) without qk-norm (a thread walking the
// head's pairs alone is latency-bound on a GPU). Heads: t's queries, t's keys, then t_k's keys.
@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let flat = gid.x + gid.y * nwg.x * WG;  // 2D grids for more than 65535 workgroups
    let half = D / 2u;
    let heads = HEADS + T_K_HEADS + K_HEADS;
    let idx = select(flat, flat / half, !NORM);
    let n = idx / heads;
    let head = idx % heads;
    if n >= step.tokens { return; }
    let r = n / step.width;
    let j = n % step.width;
    let info = rows[r];
    if j >= info.n_new { return; }  // padding: its value is never read as a real key or query
    let pos = info.rope_pos0 + j;
    let is_key = head >= HEADS;
    let in_tk = head >= HEADS + T_K_HEADS;
    let base = select(n * STRIDE + head * D, n * K_STRIDE + (head - HEADS - T_K_HEADS) * D, in_tk);
    var inv = 1.0;
    if NORM {
        var ss = 0.0;
        for (var d = 0u; d < D; d++) { let v = load(in_tk, base + d); ss = fma(v, v, ss); }
        inv = inverseSqrt(ss / f32(D) + EPS);
    }
    let first = select(0u, flat % half, !NORM);
    for (var i = first; i < select(half, first + 1u, !NORM); i++) {
        var a = load(in_tk, base + i) * inv;
        var b = load(in_tk, base + i + half) * inv;
        if NORM && is_key && HAS_K_WEIGHT {
            a *= k_weight[i];
            b *= k_weight[i + half];
        } else if NORM && !is_key && HAS_WEIGHT {
            a *= weight[i];
            b *= weight[i + half];
        }
        let cs = rope[pos * half + i];
        // explicit fma: see dot_fma in common.wgsl
        store(in_tk, base + i, fma(a, cs.x, -(b * cs.y)));
        store(in_tk, base + i + half, fma(b, cs.x, a * cs.y));
    }
}
