// Scatter the chunk's fresh K/V (post-RoPE) into a cache with SLOTS positions per (row, kv head).
// Nothing is filtered on the host: tokens that must not land write the scratch slot SLOTS - 1.
//   RING = false (global K/V): real token j goes to slot pos0 + j; padding to the scratch slot max_len.
//   RING = true (local ring of N = SLOTS - 1 slots, the window W plus rollback spares): only the last
//     N real tokens of the row survive, token at position p goes to slot p % N; everything else to
//     the scratch slot N. Runs after the layer's attention, which read the ring as it was plus the
//     fresh keys.

override HK: u32;               // n_kv_heads
override D: u32;                // head_dim (even)
override SLOTS: u32;            // max_len + 1 (global) or ring slots + 1
override SRC_STRIDE: u32;       // floats per token row of fresh
override SRC_OFFSET: u32 = 0u;  // where K then V start in the row
override RING: bool = false;
override KV_FORMAT: u32 = 0u;   // 0 f32, 1 f16 pairs, 5 bf16 pairs (common.wgsl)
override ROW0: u32 = 0u;        // first cache row held by the bound cache shard
override SHARD_ROWS: u32 = 0xffffffffu;  // cache rows in the shard (caches over one binding are split by rows)
override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<storage, read> rows: array<RowInfo>;          // [R]
@group(0) @binding(2) var<storage, read> fresh: array<vec2<f32>>;       // [R * C, SRC_STRIDE]: [2, HK, D] (k then v) at SRC_OFFSET
@group(0) @binding(3) var<storage, read_write> cache_k: array<u32>;     // [SHARD_ROWS, HK, SLOTS, D]
@group(0) @binding(4) var<storage, read_write> cache_v: array<u32>;     // [SHARD_ROWS, HK, SLOTS, D]

fn store(i: u32, v: vec2<f32>, is_v: bool) {
    // i: element index of the first of two adjacent values (even)
    if KV_FORMAT != 0u {
        let w = pack2(KV_FORMAT, v);
        if is_v { cache_v[i / 2u] = w; } else { cache_k[i / 2u] = w; }
    } else {
        let w = bitcast<vec2<u32>>(v);
        if is_v { cache_v[i] = w.x; cache_v[i + 1u] = w.y; } else { cache_k[i] = w.x; cache_k[i + 1u] = w.y; }
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = gid.x + gid.y * nwg.x * WG;  // 2D grids for more than 65535 workgroups
    let pairs = D / 2u;
    let n = idx / (HK * pairs);
    let rem = idx % (HK * pairs);
    let kh = rem / pairs;
    let p2 = rem % pairs;
    if n >= step.tokens { return; }
    let r = n / step.width;
    let j = n % step.width;
    let info = rows[r];
    if info.cache_row < ROW0 || info.cache_row - ROW0 >= SHARD_ROWS { return; }  // another shard's row
    let scratch = SLOTS - 1u;
    var slot = scratch;
    if j < info.n_new {
        let pos = info.pos0 + j;
        if RING {
            let new_len = info.pos0 + info.n_new;
            if pos + scratch >= new_len { slot = pos % scratch; }
        } else {
            slot = pos;
        }
    }
    let src = (n * SRC_STRIDE + SRC_OFFSET) / 2u + kh * pairs + p2;
    let dst = (((info.cache_row - ROW0) * HK + kh) * SLOTS + slot) * D + p2 * 2u;
    store(dst, fresh[src], false);
    store(dst, fresh[src + HK * pairs], true);
}
