// Masked softmax attention straight against the cache, grouped-query (query head h reads kv head
// h / (H / HK); K/V are never repeated). One thread per (token, query head), online softmax.
// Query at position p of cache row b sees, in one softmax:
//   global keys (HAS_GLOBAL): positions 0..=p of row b in its group's pool, found through the row's
//     block table (this chunk's
//     keys were scattered there by the group's writer layer before this dispatch);
//   local keys (HAS_LOCAL): positions q with p - W < q <= p, visited in position order: q < pos0
//     from the ring as it was before the chunk (slot q % RING, checked against lpos), q >= pos0
//     from the chunk's fresh keys, which the ring may be too small to hold. The ring is written
//     only after this dispatch. Visiting in position order makes the result independent of how
//     the tokens were chunked: one append of k tokens and k appends of one give the same bits.
// Padding queries produce zeros. A query that sees no key produces zeros too, never NaN.
// SPLIT: the global keys were already folded per partition by attention_split.wgsl; this kernel
// merges those partial states in partition (= position) order instead of walking the keys, then
// goes on with the local keys as above. Binding 4 then holds the partials. A layer without local
// keys merges with a thread per (token, head, value vec4) (`merge_element`), else per (token, head).

override H: u32;                // query heads
override HK: u32;               // kv heads
override D: u32;                // head_dim (multiple of 4, at most 256)
override Q_STRIDE: u32;         // floats per token row of qy (its first H * D are the queries)
override BLOCK: u32 = 16u;      // positions per block of the global pool
override MAX_BLOCKS: u32 = 1u;  // block table entries per row
override W: u32 = 1u;           // sliding window
override RING: u32 = 1u;        // ring slots: W + rollback spares (plus one scratch slot)
override HAS_GLOBAL: bool = true;
override HAS_LOCAL: bool = false;
override KV_FORMAT: u32 = 0u;   // 0 f32, 1 f16 pairs, 5 bf16 pairs (common.wgsl)
override SCALE: f32;
override ATTN_SOFTCAP: f32 = 0.0; // > 0: scores become ATTN_SOFTCAP * tanh(score / ATTN_SOFTCAP) (Gemma 2)
override ROW0: u32 = 0u;        // first cache row held by the bound cache shard
override SHARD_ROWS: u32 = 0xffffffffu;  // cache rows in the shard (caches over one binding are split by rows)
override SPLIT: bool = false;
override SPAN: u32 = 1u;        // SPLIT: positions per partition
override PARTS: u32 = 1u;       // SPLIT: partitions per query
override GROUP_TOKENS: u32 = 0xffffffffu;  // tokens per dispatch (its token group)
override SINKS: bool = false;   // each head's sink logit joins its softmax's denominator (gpt-oss)
override WG: u32 = 64u;

const MAX_D4: u32 = 64u;  // head_dim <= 256: private arrays need a constant size

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<storage, read> rows: array<RowInfo>;          // [R]
@group(0) @binding(2) var<storage, read_write> qy: array<vec4<f32>>;    // [R * C, Q_STRIDE]: q in, y out (in place)
@group(0) @binding(3) var<storage, read> lpos: array<i32>;              // [rows, RING + 1]
@group(0) @binding(4) var<storage, read> gkv: array<u32>;               // [shard blocks, 2, HK, BLOCK, D]; SPLIT: partials [group tokens, H, PARTS, 4 + D] f32 bits
@group(0) @binding(5) var<storage, read> lkv: array<u32>;               // [SHARD_ROWS, 2, HK, RING + 1, D]
@group(0) @binding(6) var<storage, read> fresh: array<vec4<f32>>;       // [R * C, 2, HK, D] local k then v
@group(0) @binding(7) var<uniform> group: TokenGroup;                   // this dispatch's first token
@group(0) @binding(8) var<storage, read> block_table: array<u32>;       // [rows, MAX_BLOCKS]
@group(0) @binding(9) var<storage, read> sinks: array<f32>;             // [H] (SINKS)

fn load4(is_global: bool, e: u32) -> vec4<f32> {
    // e: element index (multiple of 4) into the global pool or the ring
    if KV_FORMAT != 0u {
        let w = e / 2u;
        if is_global { return half4(KV_FORMAT, gkv[w], gkv[w + 1u]); }
        return half4(KV_FORMAT, lkv[w], lkv[w + 1u]);
    }
    if is_global { return bitcast<vec4<f32>>(vec4<u32>(gkv[e], gkv[e + 1u], gkv[e + 2u], gkv[e + 3u])); }
    return bitcast<vec4<f32>>(vec4<u32>(lkv[e], lkv[e + 1u], lkv[e + 2u], lkv[e + 3u]));
}

var<private> q: array<vec4<f32>, MAX_D4>;
var<private> acc: array<vec4<f32>, MAX_D4>;
var<private> m: f32;   // running max of scores
var<private> l: f32;   // running sum of exp(score - m)

// Fold one key/value into the online softmax. `k_at`/`v_at`: element bases; fresh keys pass
// is_fresh and index `fresh` (vec4 units) instead of the cache.
fn visit(is_global: bool, is_fresh: bool, k_at: u32, v_at: u32) {
    let d4n = D / 4u;
    var s = 0.0;  // the score (q was scaled)
    for (var i = 0u; i < d4n; i++) {
        var k: vec4<f32>;
        if is_fresh {
            k = fresh[k_at + i];
            k = round_to(KV_FORMAT, k);
        } else {
            k = load4(is_global, k_at + i * 4u);
        }
        s = dot_fma(q[i], k, s);
    }
    let f = softmax_fold(softcap_score(ATTN_SOFTCAP, s), m);
    if f.y != 1.0 {
        for (var i = 0u; i < d4n; i++) { acc[i] *= f.y; }
    }
    m = f.x;
    let p = f.z;
    l = fma(l, f.y, p);  // f.y == 1: exactly l + p
    for (var i = 0u; i < d4n; i++) {
        var v: vec4<f32>;
        if is_fresh {
            v = fresh[v_at + i];
            v = round_to(KV_FORMAT, v);
        } else {
            v = load4(is_global, v_at + i * 4u);
        }
        acc[i] = fma(vec4<f32>(p), v, acc[i]);
    }
}

// SPLIT: folding the partial state at word `at` of the partials (binding 4) into the running max
// m and sum l gives (the new max, the new sum, the rescale of what was summed so far, the
// partial's weight); both merges below take it, so they fold alike.
fn fold_partial(at: u32, m: f32, l: f32) -> vec4<f32> {
    let ms = bitcast<f32>(gkv[at]);
    let mn = max(m, ms);
    let ca = exp(m - mn);
    let cb = exp(ms - mn);
    return vec4<f32>(mn, fma(l, ca, bitcast<f32>(gkv[at + 1u]) * cb), ca, cb);
}

// The softmax's denominator of head h from the keys' running max m and sum l: with SINKS, plus
// the head's sink, exp(sink - m) (the sink takes weight and gives no value). A sink far above
// every key overflows to inf and the output to 0, the limit; a query without keys gives 0 too.
fn denominator(h: u32, m: f32, l: f32) -> f32 {
    if SINKS { return l + exp(sinks[h] - m); }
    return l;
}

// Value vec4 `i` of the partial state at word `at`.
fn partial_values(at: u32, i: u32) -> vec4<f32> {
    let e = at + 4u * (1u + i);
    return bitcast<vec4<f32>>(vec4<u32>(gkv[e], gkv[e + 1u], gkv[e + 2u], gkv[e + 3u]));
}

// SPLIT without local keys: the merge alone, one thread per (token, query head, value vec4)
// instead of per (token, query head). A thread per head walked the partitions with its head's
// whole output in a private array, so a row at one step ran a few threads, each spilling to slow
// memory (on an H200, 44 us per layer for SmolLM2's 9 heads). Every thread of a head repeats the
// same (max, sum) folds, and its element takes the same operations in the same order as the walk
// below, so the bits are the walk's.
fn merge_element(idx: u32) {
    let d4n = D / 4u;
    let t = idx / (H * d4n);
    let n = group.token0 + t;
    if t >= GROUP_TOKENS || n >= step.tokens { return; }  // the next group's, or past the chunk
    let h = (idx / d4n) % H;
    let i = idx % d4n;
    let r = n / step.width;
    let j = n % step.width;
    let info = rows[r];
    if info.cache_row < ROW0 || info.cache_row - ROW0 >= SHARD_ROWS { return; }  // another shard's row
    let out = n * (Q_STRIDE / 4u) + h * d4n + i;
    if j >= info.n_new {
        qy[out] = vec4<f32>(0.0);
        return;
    }
    let p = info.pos0 + j;
    var mm = -3.0e38;
    var ll = 0.0;
    var a = vec4<f32>(0.0);
    let stride = 4u * (1u + d4n);  // words per partial
    let first = (t * H + h) * PARTS * stride;
    for (var s = 0u; s * SPAN <= p; s++) {
        let at = first + s * stride;
        let f = fold_partial(at, mm, ll);
        a = fma(a, vec4<f32>(f.z), partial_values(at, i) * f.w);
        mm = f.x;
        ll = f.y;
    }
    let total = denominator(h, mm, ll);
    let inv = select(0.0, 1.0 / total, total > 0.0);
    qy[out] = a * inv;
}

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = gid.x + gid.y * nwg.x * WG;  // 2D grids for more than 65535 workgroups
    if HAS_GLOBAL && SPLIT && !HAS_LOCAL {
        merge_element(idx);
        return;
    }
    let n = group.token0 + idx / H;
    let h = idx % H;
    if idx / H >= GROUP_TOKENS || n >= step.tokens { return; }  // the next group's, or past the chunk
    let r = n / step.width;
    let j = n % step.width;
    let info = rows[r];
    if info.cache_row < ROW0 || info.cache_row - ROW0 >= SHARD_ROWS { return; }  // another shard's row
    let local_row = info.cache_row - ROW0;
    let d4n = D / 4u;
    let qbase = n * (Q_STRIDE / 4u) + h * d4n;
    if j >= info.n_new {
        for (var i = 0u; i < d4n; i++) { qy[qbase + i] = vec4<f32>(0.0); }
        return;
    }
    let p = info.pos0 + j;
    let kh = h / (H / HK);
    for (var i = 0u; i < d4n; i++) {
        q[i] = qy[qbase + i] * SCALE;
        acc[i] = vec4<f32>(0.0);
    }
    m = -3.0e38;
    l = 0.0;
    if HAS_GLOBAL && SPLIT {
        // merge the partitions' (max, sum, values) in position order
        let stride = 4u * (1u + d4n);  // words per partial
        let first = ((n - group.token0) * H + h) * PARTS * stride;
        for (var s = 0u; s * SPAN <= p; s++) {
            let at = first + s * stride;
            let f = fold_partial(at, m, l);
            for (var i = 0u; i < d4n; i++) {
                acc[i] = fma(acc[i], vec4<f32>(f.z), partial_values(at, i) * f.w);
            }
            m = f.x;
            l = f.y;
        }
    }
    if HAS_GLOBAL && !SPLIT {
        let table = info.cache_row * MAX_BLOCKS;
        for (var t = 0u; t <= p; t++) {
            let at = block_elem(block_table[table + t / BLOCK], HK, BLOCK, D, kh, t);
            visit(true, false, at, at + HK * BLOCK * D);
        }
    }
    if HAS_LOCAL {
        let base = (local_row * 2u * HK + kh) * (RING + 1u) * D;
        let v_offset = HK * (RING + 1u) * D;
        let first = select(0u, p + 1u - W, p + 1u > W);
        for (var qp = first; qp <= p; qp++) {
            if qp >= info.pos0 {
                let at = (r * step.width + (qp - info.pos0)) * 2u * HK * d4n + kh * d4n;
                visit(false, true, at, at + HK * d4n);
            } else {
                let slot = qp % RING;
                // a slot overwritten since (or rolled back) no longer holds qp: skip it
                if lpos[info.cache_row * (RING + 1u) + slot] == i32(qp) {
                    visit(false, false, base + slot * D, base + slot * D + v_offset);
                }
            }
        }
    }
    let total = denominator(h, m, l);
    let inv = select(0.0, 1.0 / total, total > 0.0);
    for (var i = 0u; i < d4n; i++) { qy[qbase + i] = acc[i] * inv; }
}
