// Scatter the chunk's fresh K/V (post-RoPE) into a global pool or a local ring.
// Nothing is filtered on the host: tokens that must not land write a scratch slot.
//   RING = false (global K/V, paged): real token j at position pos0 + j goes to its row's block
//     table entry (pos0 + j) / BLOCK; padding, and positions below global_from (a replay over
//     blocks the prompt cache supplied), to the shard's scratch block 0.
//   RING = true (local ring of N = RING_SLOTS - 1 slots, the window W plus rollback spares): only the
//     last N real tokens of the row survive, token at position p goes to slot p % N; everything else
//     to the scratch slot N. Runs after the layer's attention, which read the ring as it was plus
//     the fresh keys.

override HK: u32;               // n_kv_heads
override D: u32;                // head_dim (even)
override RING_SLOTS: u32 = 1u;  // RING: ring slots + 1
override BLOCK: u32 = 16u;      // positions per block of the global pool
override MAX_BLOCKS: u32 = 1u;  // block table entries per row
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
@group(0) @binding(3) var<storage, read_write> cache: array<u32>;       // [shard blocks, 2, HK, BLOCK, D] global or [SHARD_ROWS, 2, HK, RING_SLOTS, D] ring: K then V
@group(0) @binding(4) var<storage, read> block_table: array<u32>;       // [rows, MAX_BLOCKS] (global only)

fn store(i: u32, v: vec2<f32>) {
    // i: element index of the first of two adjacent values (even)
    if KV_FORMAT != 0u {
        cache[i / 2u] = pack2(KV_FORMAT, v);
    } else {
        let w = bitcast<vec2<u32>>(v);
        cache[i] = w.x;
        cache[i + 1u] = w.y;
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
    var dst: u32;
    if RING {
        let scratch = max(RING_SLOTS - 1u, 1u);  // (global pipelines: no division by zero to fold)
        var slot = scratch;
        let pos = info.pos0 + j;
        if j < info.n_new && pos + scratch >= info.pos0 + info.n_new { slot = pos % scratch; }
        dst = (((info.cache_row - ROW0) * 2u * HK + kh) * RING_SLOTS + slot) * D;
    } else if j < info.n_new && info.pos0 + j >= info.global_from {
        let pos = info.pos0 + j;
        dst = block_elem(block_table[info.cache_row * MAX_BLOCKS + pos / BLOCK], HK, BLOCK, D, kh, pos);
    } else {
        dst = block_elem(0u, HK, BLOCK, D, kh, 0u);  // the scratch block (its first position)
    }
    dst += p2 * 2u;
    let src = (n * SRC_STRIDE + SRC_OFFSET) / 2u + kh * pairs + p2;
    // a row's (ring) or a block's (global) values follow its keys
    let v_offset = HK * select(BLOCK, RING_SLOTS, RING) * D;
    store(dst, fresh[src]);
    store(dst + v_offset, fresh[src + HK * pairs]);
}
