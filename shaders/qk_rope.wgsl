// Per-head RMS norm (qk-norm, optional) then RoPE at each token's own position, in place.
// Token n = r * C + j of the chunk is rotated by position rows[r].rope_pos0 + j (its slot, plus any
// positions the row skipped as padding; at most max_len - 1, checked on the host). RoPE is the half-split
// (`rotate_half`) layout: pairs (i, i + D/2) rotate by angle pos * theta^(-2i/D), read from a table
// computed on the host in f64 (GPU sin/cos of large arguments is not accurate on every backend).
// Keys are rotated once, before they are stored: they are never rotated again. (In steps of one
// token a row, split-group attention may do this dispatch's work instead: attention_split.wgsl's
// FUSED_ROPE, the same operations.)
// KV_WRITE (writer layers, the kv_write.wgsl dispatch fused): the rotated global keys and their
// values also go straight to the row's blocks of the global pool, as kv_write.wgsl places them
// (tokens below global_from, a prompt-cache replay, write nothing). A thread then takes two
// neighbouring pairs, so 16-bit K/V is stored in whole words.

override HEADS: u32;               // query heads at the start of each row of t
override D: u32;                   // head_dim (even)
override STRIDE: u32;              // floats per token row of t
override NORM: bool = false;       // qk-norm before RoPE
override NORM_WHOLE: bool = false; // the qk-norm spans all heads of its kind in the token (OLMo 2), weights [heads * D]
override ROTATE: bool = true;      // false: a NoPE layer (SmolLM3), norm and pool write only
override HAS_WEIGHT: bool = false; // qk-norm of the queries has a weight [D]
override EPS: f32 = 1e-6;
// Keys in the same dispatch (a layer's queries and fresh keys are rotated together): T_K_HEADS
// heads of t right after its queries (writer layers' global keys), then K_HEADS heads at the start
// of each row of t_k (K_STRIDE floats; local layers' keys). Keys are normed with k_weight.
override T_K_HEADS: u32 = 0u;
override K_HEADS: u32 = 0u;
override K_STRIDE: u32 = 1u;
override HAS_K_WEIGHT: bool = false;
override KV_WRITE: bool = false;
override BLOCK: u32 = 16u;      // positions per block of the global pool
override MAX_BLOCKS: u32 = 1u;  // block table entries per row
override KV_FORMAT: u32 = 0u;   // 0 f32, 1 f16 pairs, 5 bf16 pairs (common.wgsl)
override WG: u32 = 64u;         // with NORM_WHOLE: at least the token's heads, at most MAX_TOKEN_HEADS

// NORM_WHOLE: the largest workgroup, so the most heads a token may have (the host checks)
const MAX_TOKEN_HEADS: u32 = 256u;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<storage, read> rows: array<RowInfo>;      // [R]
@group(0) @binding(2) var<storage, read_write> t: array<f32>;       // [R * C, STRIDE]
@group(0) @binding(3) var<storage, read> weight: array<f32>;        // [D], [HEADS * D] with NORM_WHOLE (unused without HAS_WEIGHT)
@group(0) @binding(4) var<storage, read> rope: array<vec2<f32>>;    // [max_len, D/2] (cos, sin) (read with ROTATE)
@group(0) @binding(5) var<storage, read_write> t_k: array<f32>;     // [R * C, K_STRIDE] (unused without K_HEADS)
@group(0) @binding(6) var<storage, read> k_weight: array<f32>;      // [D], [K heads * D] with NORM_WHOLE (unused without HAS_K_WEIGHT)
@group(0) @binding(7) var<storage, read_write> cache: array<u32>;   // [shard blocks, 2, T_K_HEADS, BLOCK, D] (KV_WRITE)
@group(0) @binding(8) var<storage, read> block_table: array<u32>;   // [rows, MAX_BLOCKS] (KV_WRITE)

// NORM_WHOLE: each head's sum of squares, for the heads of its kind to add up
var<workgroup> head_ss: array<f32, MAX_TOKEN_HEADS>;  // [token heads]

// Pairs per thread without qk-norm: 2 with KV_WRITE (whole words of 16-bit K/V), else 1.
fn pairs_per_thread() -> u32 {
    return select(1u, 2u, KV_WRITE);
}

// KV_WRITE: elements (e, e + 1) of a cache row at word-aligned element index `at`.
fn cache_store(at: u32, v: vec2<f32>) {
    if KV_FORMAT != 0u {
        cache[at / 2u] = pack2(KV_FORMAT, v);
    } else {
        cache[at] = bitcast<u32>(v.x);
        cache[at + 1u] = bitcast<u32>(v.y);
    }
}

fn load(in_tk: bool, i: u32) -> f32 {
    if in_tk { return t_k[i]; }
    return t[i];
}

fn store(in_tk: bool, i: u32, v: f32) {
    if in_tk { t_k[i] = v; } else { t[i] = v; }
}

// Thread (token n, head h), or (token n, head h, pair i) without qk-norm (a thread walking the
// head's pairs alone is latency-bound on a GPU). Heads: t's queries, t's keys, t_k's keys, then
// with KV_WRITE the values of t's keys (copied to the pool). NORM_WHOLE: one workgroup per token,
// thread h its head h (threads past the token's heads only take part in the barrier).
@compute @workgroup_size(WG)
fn main(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    let flat = gid.x + gid.y * nwg.x * WG;  // 2D grids for more than 65535 workgroups
    let half = D / 2u;
    let pp = pairs_per_thread();
    let per_head = half / pp;  // threads per head without qk-norm
    let v_heads = select(0u, T_K_HEADS, KV_WRITE);
    let heads = HEADS + T_K_HEADS + K_HEADS + v_heads;
    let idx = select(flat, flat / per_head, !NORM);
    var n = idx / heads;
    var head = idx % heads;
    if NORM_WHOLE {
        n = wid.x + wid.y * nwg.x;
        head = lid;
        // Each thread sums its own head's squares, and every sum is in workgroup memory before
        // any thread writes its head in place below: a thread that read the other heads itself
        // would race with their threads' writes (wrong keys wherever a token's heads straddled
        // two workgroups).
        var ss = 0.0;
        if n < step.tokens && head < HEADS + T_K_HEADS + K_HEADS {
            let in_tk = head >= HEADS + T_K_HEADS;
            let base = select(n * STRIDE + head * D, n * K_STRIDE + (head - HEADS - T_K_HEADS) * D, in_tk);
            for (var d = 0u; d < D; d++) { let v = load(in_tk, base + d); ss = fma(v, v, ss); }
        }
        head_ss[head] = ss;
        workgroupBarrier();
        if head >= heads { return; }
    }
    if n >= step.tokens { return; }
    let r = n / step.width;
    let j = n % step.width;
    let info = rows[r];
    if j >= info.n_new { return; }  // padding: its value is never read as a real key or query
    let pos = info.rope_pos0 + j;
    let first = select(0u, (flat % per_head) * pp, !NORM);
    let end = select(half, first + pp, !NORM);
    // KV_WRITE: where this token's K/V go in the pool (nowhere below global_from)
    let cache_pos = info.pos0 + j;
    let to_pool = KV_WRITE && cache_pos >= info.global_from;
    var block = 0u;
    if to_pool { block = block_table[info.cache_row * MAX_BLOCKS + cache_pos / BLOCK]; }
    let v_offset = T_K_HEADS * BLOCK * D;  // a block's values follow its keys
    if head >= HEADS + T_K_HEADS + K_HEADS {
        // a value head: copied as it is
        let vh = head - HEADS - T_K_HEADS - K_HEADS;
        if !to_pool { return; }
        let src = n * STRIDE + (HEADS + T_K_HEADS + vh) * D;
        let dst = block_elem(block, T_K_HEADS, BLOCK, D, vh, cache_pos) + v_offset;
        for (var i = first; i < end; i += 2u) {
            cache_store(dst + i, vec2<f32>(t[src + i], t[src + i + 1u]));
            cache_store(dst + i + half, vec2<f32>(t[src + i + half], t[src + i + half + 1u]));
        }
        return;
    }
    let is_key = head >= HEADS;
    let in_tk = head >= HEADS + T_K_HEADS;
    let base = select(n * STRIDE + head * D, n * K_STRIDE + (head - HEADS - T_K_HEADS) * D, in_tk);
    var inv = 1.0;
    // NORM_WHOLE: the heads of this one's kind (t's queries, t's keys, t_k's keys) and its place
    // among them; the weight of element i of this head is at w_at + i
    var first_head = head;
    var kind_heads = 1u;
    if NORM_WHOLE {
        if head < HEADS {
            first_head = 0u;
            kind_heads = HEADS;
        } else if !in_tk {
            first_head = HEADS;
            kind_heads = T_K_HEADS;
        } else {
            first_head = HEADS + T_K_HEADS;
            kind_heads = K_HEADS;
        }
    }
    let w_at = (head - first_head) * D;
    if NORM {
        var ss = 0.0;
        if NORM_WHOLE {
            // the kind's heads in order, so every thread of the kind gets the same bits
            for (var k = first_head; k < first_head + kind_heads; k++) { ss += head_ss[k]; }
        } else {
            for (var d = 0u; d < D; d++) { let v = load(in_tk, base + d); ss = fma(v, v, ss); }
        }
        inv = inverseSqrt(ss / f32(kind_heads * D) + EPS);
    }
    let pooled = to_pool && is_key && !in_tk;
    for (var i0 = first; i0 < end; i0 += pp) {
        var lo = vec2<f32>(0.0);  // rotated elements i0, i0 + 1 (the second with two pairs)
        var hi = vec2<f32>(0.0);  // and i0 + half, i0 + half + 1
        for (var p = 0u; p < pp; p++) {
            let i = i0 + p;
            var a = load(in_tk, base + i) * inv;
            var b = load(in_tk, base + i + half) * inv;
            if NORM && is_key && HAS_K_WEIGHT {
                a *= k_weight[w_at + i];
                b *= k_weight[w_at + i + half];
            } else if NORM && !is_key && HAS_WEIGHT {
                a *= weight[w_at + i];
                b *= weight[w_at + i + half];
            }
            if ROTATE {
                let cs = rope[pos * half + i];
                // explicit fma: see dot_fma in common.wgsl
                lo[p] = fma(a, cs.x, -(b * cs.y));
                hi[p] = fma(b, cs.x, a * cs.y);
            } else {
                lo[p] = a;
                hi[p] = b;
            }
            store(in_tk, base + i, lo[p]);
            store(in_tk, base + i + half, hi[p]);
        }
        if pooled {
            let dst = block_elem(block, T_K_HEADS, BLOCK, D, head - HEADS, cache_pos);
            cache_store(dst + i0, lo);
            cache_store(dst + i0 + half, hi);
        }
    }
}
