// Attention split along the keys (flash-decoding), part 1 of 2: the global keys a query sees are
// cut into partitions of SPAN positions whose boundaries are absolute positions (partition s holds
// positions s * SPAN .. s * SPAN + SPAN - 1). One workgroup folds one partition for one token and
// one kv head, for all G = H / HK query heads of the group at once, so each K/V element is read
// once per group; it writes the partition's unnormalized softmax state (max, sum, weighted values)
// to `partials`. attention.wgsl (SPLIT) then merges the partitions in position order and goes on
// with the local keys.
// A partition is walked in tiles of TILE keys: all of a tile's scores first (lanes over (head,
// key)), then each head's max and the sum of its weights (trees over the tile's keys, all heads
// at once), then the weighted values (lanes over (key range, head, element), keys in position
// order in a range, the ranges added in order). 256 lanes, so that a partition's serial loop
// stays short at short contexts, where there are few partitions (the occupancy table).
// Exactness: every reduction has one fixed order set by TILE and MAIN_WG, and the partitions' bounds
// depend only on the query's position, so a query's result depends on its position and the keys
// alone: never on the other rows or tokens of the step, nor on how the tokens were chunked.

override H: u32;                // query heads
override HK: u32;               // kv heads
override D: u32;                // head_dim (multiple of 4; G * D <= 4 * MAIN_WG)
override Q_STRIDE: u32;         // floats per token row of qy (its first H * D are the queries)
override BLOCK: u32 = 16u;      // positions per block of the global pool
override MAX_BLOCKS: u32 = 1u;  // block table entries per row
override KV_FORMAT: u32 = 0u;   // 0 f32, 1 f16 pairs, 5 bf16 pairs (common.wgsl)
override SCALE: f32;
override ATTN_SOFTCAP: f32 = 0.0; // > 0: scores become ATTN_SOFTCAP * tanh(score / ATTN_SOFTCAP) (Gemma 2)
override TILE: u32 = 64u;       // keys per tile: a power of two <= WG, G * TILE <= 1024
override SPAN: u32;             // positions per partition: a multiple of TILE
override PARTS: u32;            // partitions per query: ceil(max_len / SPAN)
override GROUP_TOKENS: u32 = 0xffffffffu;  // tokens per dispatch (its token group)
override ROW0: u32 = 0u;        // first cache row held by the bound cache shard
override SHARD_ROWS: u32 = 0xffffffffu;
// `main` at one token a row (decode): qk_rope.wgsl's work for layers without qk-norm or local
// keys, so its dispatch is left out: the queries rotated as they load, and with KV_WRITE the
// token's rotated key and its value stored in the pool by the partition that holds its position,
// before it reads them. The same operations as qk_rope.wgsl, so the same bits.
override FUSED_ROPE: bool = false;
override ROTATE: bool = true;   // false: a NoPE layer
override KV_WRITE: bool = false;

const WG: u32 = 64u;            // lanes per workgroup of `query_tiles`
const MAIN_WG: u32 = 256u;      // lanes per workgroup of `main`: G * D / 4 <= MAIN_WG
const MAX_G: u32 = 16u;         // query heads per kv head

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<uniform> group: TokenGroup;                     // this dispatch's first token
@group(0) @binding(2) var<storage, read> rows: array<RowInfo>;            // [R]
@group(0) @binding(3) var<storage, read> qy: array<vec4<f32>>;            // [R * C, Q_STRIDE]: roped queries first
@group(0) @binding(4) var<storage, read_write> gkv: array<u32>;           // [shard blocks, 2, HK, BLOCK, D] (written with KV_WRITE)
@group(0) @binding(5) var<storage, read_write> partials: array<vec4<f32>>; // [group tokens, H, PARTS, 1 + D / 4]: (max, sum, 0, 0), then values
@group(0) @binding(6) var<storage, read> block_table: array<u32>;         // [rows, MAX_BLOCKS]
@group(0) @binding(7) var<storage, read> rope: array<vec2<f32>>;          // [max_len, D / 2] (cos, sin) (FUSED_ROPE with ROTATE)

var<workgroup> qs: array<vec4<f32>, 256>;       // [G, D / 4] the group's queries
var<workgroup> score: array<f32, 1024>;         // [G, TILE] a tile's scores, then their weights
var<workgroup> tree_v: array<vec4<f32>, MAIN_WG>; // [G, TILE] floats of the max and sum trees, then [ranges, G * D / 4] values
var<workgroup> run_m: array<f32, MAX_G>;        // running max per head
var<workgroup> run_l: array<f32, MAX_G>;        // running sum per head
var<workgroup> corr: array<f32, MAX_G>;         // this tile's rescale of the earlier state
var<workgroup> job: vec4<u32>;                  // (valid, last position, cache row in the shard, row)

// Element index of position pos of kv head kh of cache row `row` (through its block table).
fn key_at(row: u32, kh: u32, pos: u32) -> u32 {
    return block_elem(block_table[row * MAX_BLOCKS + pos / BLOCK], HK, BLOCK, D, kh, pos);
}

// Four K (or V) elements at the key element index e (a multiple of 4) of the global pool.
fn global4(is_v: bool, key_e: u32) -> vec4<f32> {
    let e = select(key_e, key_e + HK * BLOCK * D, is_v);  // a block's values follow its keys
    if KV_FORMAT != 0u {
        let w = e / 2u;
        return half4(KV_FORMAT, gkv[w], gkv[w + 1u]);
    }
    return bitcast<vec4<f32>>(vec4<u32>(gkv[e], gkv[e + 1u], gkv[e + 2u], gkv[e + 3u]));
}

// Where the partial state of query head h, partition s, for the group's token t starts in
// `partials` ((max, sum, 0, 0), then the D / 4 value vec4s): every entry point writes through it.
fn partial_at(t: u32, h: u32, s: u32) -> u32 {
    return ((t * H + h) * PARTS + s) * (1u + D / 4u);
}

// Workgroup (s, kh, t): partition s of kv head kh for token group.token0 + t.
@compute @workgroup_size(MAIN_WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let s = wid.x;
    let kh = wid.y;
    let n = group.token0 + wid.z;
    if n >= step.tokens { return; }
    let g_n = H / HK;
    let d4n = D / 4u;
    if lane == 0u {
        let r = n / step.width;
        let j = n % step.width;
        let info = rows[r];
        let mine = info.cache_row >= ROW0 && info.cache_row - ROW0 < SHARD_ROWS;
        let p = info.pos0 + j;
        let valid = mine && j < info.n_new && s * SPAN <= p;
        // 2: it also stores the token's K/V (FUSED_ROPE with KV_WRITE)
        let stores = FUSED_ROPE && KV_WRITE && s == p / SPAN && p >= info.global_from;
        job = vec4<u32>(select(0u, select(1u, 2u, stores), valid), p, info.cache_row - ROW0, r);
    }
    // one value for the whole workgroup: padding, another shard's row or a partition past the query
    let w = workgroupUniformLoad(&job);
    if w.x == 0u { return; }
    let last = min(w.y, s * SPAN + SPAN - 1u);
    let row = w.z + ROW0;
    let rope_pos = rows[w.w].rope_pos0 + n % step.width;
    for (var i = lane; i < g_n * d4n; i += MAIN_WG) {
        let at = n * (Q_STRIDE / 4u) + kh * g_n * d4n + i;
        var q = qy[at];
        if FUSED_ROPE && ROTATE { q = rotated(at, i % d4n, rope_pos); }
        qs[i] = q * SCALE;
    }
    if FUSED_ROPE && KV_WRITE {
        if w.x == 2u { store_fresh_kv(n, kh, row, w.y, rope_pos, lane); }
        storageBarrier();
    }
    if lane < g_n {
        run_m[lane] = -3.0e38;
        run_l[lane] = 0.0;
    }
    // the value step: lane (range, slot) folds element slot % d4n of head slot / d4n over the
    // keys of its range
    let slots = g_n * d4n;
    let ranges = value_ranges(g_n);
    let slot = lane % slots;
    let range = lane / slots;
    var acc = vec4<f32>(0.0);
    for (var t0 = s * SPAN; t0 <= last; t0 += TILE) {
        let count = min(TILE, last + 1u - t0);
        workgroupBarrier();
        // 1. lane e: the score of (head e / TILE, key e % TILE), and a copy for the max tree
        for (var e = lane; e < g_n * TILE; e += MAIN_WG) {
            let i = e % TILE;
            var sc = -3.0e38;
            if i < count {
                let at = key_at(row, kh, t0 + i);
                var dot_sum = 0.0;
                for (var c = 0u; c < d4n; c++) { dot_sum = dot_fma(qs[(e / TILE) * d4n + c], global4(false, at + c * 4u), dot_sum); }
                sc = softcap_score(ATTN_SOFTCAP, dot_sum);
            }
            score[e] = sc;
            tree_f32_set(e, sc);
        }
        workgroupBarrier();
        // 2. each head's max over the tile (order-free), its rescale
        tile_tree(lane, g_n, false);
        if lane < g_n {
            let mt = max(run_m[lane], tree_f32(lane * TILE));
            corr[lane] = exp(run_m[lane] - mt);
            run_m[lane] = mt;
        }
        workgroupBarrier();
        // 3. the weights (0 past the count), and their sum in the fixed tree `query_tiles` shares
        for (var e = lane; e < g_n * TILE; e += MAIN_WG) {
            let p = select(0.0, exp(score[e] - run_m[e / TILE]), e % TILE < count);
            score[e] = p;
            tree_f32_set(e, p);
        }
        workgroupBarrier();
        tile_tree(lane, g_n, true);
        // 4. the weighted values, as `query_tiles` folds them: one range, the keys in order onto
        //    the rescaled state; several, range q of a slot holds keys q * per .. q * per + per - 1,
        //    folded from zero, and the ranges are added in order
        let g = slot / d4n;
        let v_at = (slot % d4n) * 4u;
        if ranges == 1u {
            if lane < slots {
                var a = acc * corr[g];
                for (var i = 0u; i < count; i++) {
                    a = fma(vec4<f32>(score[g * TILE + i]), global4(true, key_at(row, kh, t0 + i) + v_at), a);
                }
                acc = a;
            }
            if lane < g_n { run_l[lane] = fma(run_l[lane], corr[lane], tree_f32(lane * TILE)); }
            continue;
        }
        var part = vec4<f32>(0.0);
        if range < ranges {
            let per = (count + ranges - 1u) / ranges;
            for (var i = range * per; i < min(count, range * per + per); i++) {
                part = fma(vec4<f32>(score[g * TILE + i]), global4(true, key_at(row, kh, t0 + i) + v_at), part);
            }
        }
        if lane < g_n { run_l[lane] = fma(run_l[lane], corr[lane], tree_f32(lane * TILE)); }
        workgroupBarrier();
        tree_v[lane] = part;
        workgroupBarrier();
        if lane < slots {
            var a = fma(acc, vec4<f32>(corr[g]), tree_v[lane]);
            for (var q = 1u; q < ranges; q++) { a += tree_v[q * slots + lane]; }
            acc = a;
        }
    }
    workgroupBarrier();
    if lane < g_n {
        partials[partial_at(n - group.token0, kh * g_n + lane, s)] = vec4<f32>(run_m[lane], run_l[lane], 0.0, 0.0);
    }
    if lane < slots {
        partials[partial_at(n - group.token0, kh * g_n + slot / d4n, s) + 1u + slot % d4n] = acc;
    }
}

// FUSED_ROPE: vec4 c of a head (its elements 4c .. 4c + 3) at qy[at], rotated at position pos as
// qk_rope.wgsl rotates them: pairs (i, i + D / 2), lo = a cos - b sin, hi = b cos + a sin.
fn rotated(at: u32, c: u32, pos: u32) -> vec4<f32> {
    let half4 = D / 8u;
    let low = c < half4;
    let pair = select(c - half4, c, low) * 4u;
    var a = qy[at];  // the pair's low element, b its high one
    var b = qy[at];
    if low {
        b = qy[at + half4];
    } else {
        a = qy[at - half4];
    }
    var cs = vec4<f32>();
    var sn = vec4<f32>();
    for (var k = 0u; k < 4u; k++) {
        let t = rope[pos * (D / 2u) + pair + k];
        cs[k] = t.x;
        sn[k] = t.y;
    }
    // explicit fma: see dot_fma in common.wgsl
    return select(fma(b, cs, a * sn), fma(a, cs, -(b * sn)), low);
}

// FUSED_ROPE with KV_WRITE: token n's key of kv head kh, rotated (NoPE: as it is), and its value
// into the pool at position p of cache row `row`, as qk_rope.wgsl's KV_WRITE places them.
fn store_fresh_kv(n: u32, kh: u32, row: u32, p: u32, rope_pos: u32, lane: u32) {
    let d4n = D / 4u;
    let k_at = n * (Q_STRIDE / 4u) + (H + kh) * d4n;
    let v_at = n * (Q_STRIDE / 4u) + (H + HK + kh) * d4n;
    let dst = block_elem(block_table[row * MAX_BLOCKS + p / BLOCK], HK, BLOCK, D, kh, p);
    for (var c = lane; c < d4n; c += MAIN_WG) {
        var k = qy[k_at + c];
        if ROTATE { k = rotated(k_at + c, c, rope_pos); }
        pool_store(dst + c * 4u, k);
        pool_store(dst + c * 4u + HK * BLOCK * D, qy[v_at + c]);
    }
}

// Four elements into the pool at element index e (a multiple of 4), in its format.
fn pool_store(e: u32, v: vec4<f32>) {
    if KV_FORMAT != 0u {
        gkv[e / 2u] = pack2(KV_FORMAT, v.xy);
        gkv[e / 2u + 1u] = pack2(KV_FORMAT, v.zw);
    } else {
        gkv[e] = bitcast<u32>(v.x);
        gkv[e + 1u] = bitcast<u32>(v.y);
        gkv[e + 2u] = bitcast<u32>(v.z);
        gkv[e + 3u] = bitcast<u32>(v.w);
    }
}

// Key ranges of a tile's value step: `main`'s spare lanes per (head, value vec4) slot.
fn value_ranges(g_n: u32) -> u32 {
    return max(1u, MAIN_WG / (g_n * (D / 4u)));
}

// The tile trees' scratch: [G, TILE] floats in vec4s (the value step reuses it as its ranges'
// partial values).
fn tree_f32(e: u32) -> f32 {
    return tree_v[e / 4u][e % 4u];
}

fn tree_f32_set(e: u32, v: f32) {
    tree_v[e / 4u][e % 4u] = v;
}

// Each head's max (`sum` false; order-free) or sum over the tile's TILE entries into entry
// g * TILE, in one fixed tree (entry i takes i + stride, strides TILE / 2 down to 1):
// `query_tiles` adds the same pairs. Every lane calls it, after a barrier; it ends with one.
fn tile_tree(lane: u32, g_n: u32, sum: bool) {
    for (var stride = TILE / 2u; stride > 0u; stride /= 2u) {
        for (var e = lane; e < g_n * stride; e += MAIN_WG) {
            let at = (e / stride) * TILE + e % stride;
            let x = tree_f32(at);
            let y = tree_f32(at + stride);
            tree_f32_set(at, select(max(x, y), x + y, sum));
        }
        workgroupBarrier();
    }
}

// The same partial states, one thread per (token, partition, query head) walking its partition's
// keys alone in position order (online softmax, as attention.wgsl's serial walk): no workgroup
// memory and no barriers, the shape that suits adapters that are really a CPU (lanes are SIMD
// lanes, heads of one kv head read the same keys). Same partitions, same output layout.
// Workgroups of HEAD_WG threads: one SIMD vector of a CPU adapter, so a row's few threads still
// spread over every core.
override HEAD_WG: u32 = 8u;

var<private> q: array<vec4<f32>, 64>;    // head_dim <= 256
var<private> acc_h: array<vec4<f32>, 64>;

@compute @workgroup_size(HEAD_WG)
fn per_head(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = gid.x + gid.y * nwg.x * HEAD_WG;  // 2D grids for more than 65535 workgroups
    let h = idx % H;
    let s = (idx / H) % PARTS;
    let local_n = idx / (H * PARTS);
    let n = group.token0 + local_n;
    if local_n >= GROUP_TOKENS || n >= step.tokens { return; }
    let r = n / step.width;
    let j = n % step.width;
    let info = rows[r];
    let p = info.pos0 + j;
    if info.cache_row < ROW0 || info.cache_row - ROW0 >= SHARD_ROWS || j >= info.n_new || s * SPAN > p { return; }
    let d4n = D / 4u;
    let kh = h / (H / HK);
    for (var i = 0u; i < d4n; i++) {
        q[i] = qy[n * (Q_STRIDE / 4u) + h * d4n + i] * SCALE;
        acc_h[i] = vec4<f32>(0.0);
    }
    var m = -3.0e38;
    var l = 0.0;
    for (var t = s * SPAN; t <= min(p, s * SPAN + SPAN - 1u); t++) {
        let at = key_at(info.cache_row, kh, t);
        var sc = 0.0;
        for (var i = 0u; i < d4n; i++) { sc = dot_fma(q[i], global4(false, at + i * 4u), sc); }
        let f = softmax_fold(softcap_score(ATTN_SOFTCAP, sc), m);
        if f.y != 1.0 {
            for (var i = 0u; i < d4n; i++) { acc_h[i] *= f.y; }
        }
        m = f.x;
        let w = f.z;
        l = fma(l, f.y, w);
        for (var i = 0u; i < d4n; i++) { acc_h[i] = fma(vec4<f32>(w), global4(true, at + i * 4u), acc_h[i]); }
    }
    let at = partial_at(local_n, h, s);
    partials[at] = vec4<f32>(m, l, 0.0, 0.0);
    for (var i = 0u; i < d4n; i++) { partials[at + 1u + i] = acc_h[i]; }
}

// Query tiles, for steps of several tokens a row (prefill, speculative checks): `main`'s partial
// states, bit for bit, for QT consecutive tokens of one row in one workgroup. A key is read once
// per query tile (one lane per key, against every query of the tile) where `main` reads it once
// per head and token, and a value once per lane group of the value step instead of once per head
// and token. Every sum keeps `main`'s order: a score is the query's D / 4 products in order; a
// tile's max is order-free; its weights are summed in `main`'s tree (zeros past the count); its
// weighted values per (head, element) are folded over the keys in order, or, where `main`
// spreads a tile's keys over its spare lanes, in its key ranges, each folded from zero and added
// in order. A token whose last key lies before a tile skips the tile, as `main`'s walk ends
// there. So a step may take either kernel.

override QT: u32 = 1u;          // tokens per query tile: QT * G <= 32, QT * G * D <= 1536
const QT_PAIRS: u32 = 32u;      // (token, head) pairs of a tile at most
const QT_ACC: u32 = 12u;        // pairs per lane in the value step: ceil(QT * G / (WG / (D / 4)))
const NO_WORK: u32 = 0xffffffffu;

var<workgroup> tile_q: array<vec4<f32>, 384>;        // [QT * G, D / 4] the tile's queries, scaled
var<workgroup> tile_p: array<f32, 2048>;             // [QT * G, TILE] a key tile's scores, then weights
var<workgroup> tile_m: array<f32, QT_PAIRS>;         // [QT * G] running max per (token, head)
var<workgroup> tile_l: array<f32, QT_PAIRS>;         // [QT * G] running sum
var<workgroup> tile_corr: array<f32, QT_PAIRS>;      // [QT * G] this key tile's rescale of the earlier state
var<workgroup> tile_last: array<u32, 16>;            // [QT] each token's last position in the partition, or NO_WORK
var<workgroup> tile_job: vec4<u32>;                  // (any work, last position of all, cache row in the shard, first token)

// Keys of the current key tile that pair k's token sees (0: its walk has ended).
fn tile_count(k: u32, t0: u32) -> u32 {
    let last = tile_last[k / (H / HK)];
    if last == NO_WORK || last < t0 { return 0u; }
    return min(TILE, last + 1u - t0);
}

// Workgroup (s, kh, z): partition s of kv head kh for query tile z of the token group. A row's
// tokens are cut into tiles of QT from its first; z counts from the tile of the group's first token.
@compute @workgroup_size(WG)
fn query_tiles(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let s = wid.x;
    let kh = wid.y;
    let g_n = H / HK;
    let d4n = D / 4u;
    let pairs = QT * g_n;
    let per_row = (step.width + QT - 1u) / QT;
    let z = (group.token0 / step.width) * per_row + (group.token0 % step.width) / QT + wid.z;
    let r = z / per_row;
    let j0 = (z % per_row) * QT;
    let n0 = r * step.width + j0;
    if lane == 0u {
        var job = vec4<u32>(0u, 0u, 0u, n0);
        for (var t = 0u; t < QT; t++) { tile_last[t] = NO_WORK; }
        if n0 < step.tokens {
            let info = rows[r];
            let mine = info.cache_row >= ROW0 && info.cache_row - ROW0 < SHARD_ROWS;
            job.z = info.cache_row - ROW0;
            for (var t = 0u; t < QT; t++) {
                let j = j0 + t;
                let n = n0 + t;
                let p = info.pos0 + j;
                let in_group = n >= group.token0 && n - group.token0 < GROUP_TOKENS && n < step.tokens;
                if mine && in_group && j < step.width && j < info.n_new && s * SPAN <= p {
                    let last = min(p, s * SPAN + SPAN - 1u);
                    tile_last[t] = last;
                    job.x = 1u;
                    job.y = max(job.y, last);
                }
            }
        }
        tile_job = job;
    }
    // one value for the whole workgroup: no token of the tile has keys in this partition
    let job = workgroupUniformLoad(&tile_job);
    if job.x == 0u { return; }
    let row = job.z + ROW0;
    for (var i = lane; i < pairs * d4n; i += WG) {
        let t = i / (g_n * d4n);
        if tile_last[t] != NO_WORK {
            tile_q[i] = qy[(n0 + t) * (Q_STRIDE / 4u) + kh * g_n * d4n + i % (g_n * d4n)] * SCALE;
        }
    }
    if lane < pairs {
        tile_m[lane] = -3.0e38;
        tile_l[lane] = 0.0;
    }
    // value step: lane (sub, d4) holds element d4 of pairs sub, sub + subs, ...
    let subs = WG / d4n;
    let sub = lane / d4n;
    let d4 = lane % d4n;
    let ranges = value_ranges(g_n);  // `main`'s key ranges of a tile's value step
    var acc: array<vec4<f32>, QT_ACC>;
    for (var k = 0u; k < QT_ACC; k++) { acc[k] = vec4<f32>(0.0); }
    for (var t0 = s * SPAN; t0 <= job.y; t0 += TILE) {
        let keys = min(TILE, job.y + 1u - t0);
        workgroupBarrier();
        // 1. lane i scores key t0 + i against every query of the tile: the key is read once
        if lane < keys {
            var dots: array<f32, QT_PAIRS>;
            for (var k = 0u; k < pairs; k++) { dots[k] = 0.0; }
            let at = key_at(row, kh, t0 + lane);
            for (var c = 0u; c < d4n; c++) {
                let key = global4(false, at + c * 4u);
                for (var k = 0u; k < pairs; k++) { dots[k] = dot_fma(tile_q[k * d4n + c], key, dots[k]); }
            }
            for (var k = 0u; k < pairs; k++) { tile_p[k * TILE + lane] = softcap_score(ATTN_SOFTCAP, dots[k]); }
        }
        workgroupBarrier();
        // 2. lane k, pair k: the tile's max (order-free) and the rescale; then every lane: the
        //    weights, 0 past a pair's count (the sum's tree adds them after the values)
        if lane < pairs {
            let count = tile_count(lane, t0);
            if count > 0u {
                var mt = tile_m[lane];
                for (var i = 0u; i < count; i++) { mt = max(mt, tile_p[lane * TILE + i]); }
                tile_corr[lane] = exp(tile_m[lane] - mt);
                tile_m[lane] = mt;
            }
        }
        workgroupBarrier();
        for (var e = lane; e < pairs * TILE; e += WG) {
            let k = e / TILE;
            tile_p[e] = select(0.0, exp(tile_p[e] - tile_m[k]), e % TILE < tile_count(k, t0));
        }
        workgroupBarrier();
        // 3. the weighted values, each value element read once per lane group
        if sub < subs {
            var count: array<u32, QT_ACC>;
            for (var k = 0u; k < QT_ACC; k++) {
                count[k] = 0u;
                if sub + k * subs < pairs { count[k] = tile_count(sub + k * subs, t0); }
            }
            if ranges == 1u {
                for (var k = 0u; k < QT_ACC; k++) {
                    if count[k] > 0u { acc[k] *= tile_corr[sub + k * subs]; }
                }
                for (var i = 0u; i < keys; i++) {
                    let v = global4(true, key_at(row, kh, t0 + i) + d4 * 4u);
                    for (var k = 0u; k < QT_ACC; k++) {
                        if i < count[k] { acc[k] = fma(vec4<f32>(tile_p[(sub + k * subs) * TILE + i]), v, acc[k]); }
                    }
                }
            } else {
                // range q of a pair: keys q * per .. q * per + per - 1 (of its count), per = ceil(count / ranges)
                var part: array<vec4<f32>, QT_ACC>;
                for (var q = 0u; q < ranges; q++) {
                    var lo = TILE;
                    var hi = 0u;
                    for (var k = 0u; k < QT_ACC; k++) {
                        let per = (count[k] + ranges - 1u) / ranges;
                        if count[k] > 0u {
                            lo = min(lo, q * per);
                            hi = max(hi, min(count[k], q * per + per));
                        }
                        part[k] = vec4<f32>(0.0);
                    }
                    for (var i = lo; i < hi; i++) {
                        let v = global4(true, key_at(row, kh, t0 + i) + d4 * 4u);
                        for (var k = 0u; k < QT_ACC; k++) {
                            let per = (count[k] + ranges - 1u) / ranges;
                            if i >= q * per && i < min(count[k], q * per + per) {
                                part[k] = fma(vec4<f32>(tile_p[(sub + k * subs) * TILE + i]), v, part[k]);
                            }
                        }
                    }
                    for (var k = 0u; k < QT_ACC; k++) {
                        if count[k] > 0u {
                            if q == 0u {
                                acc[k] = fma(acc[k], vec4<f32>(tile_corr[sub + k * subs]), part[k]);
                            } else {
                                acc[k] += part[k];
                            }
                        }
                    }
                }
            }
        }
        // 4. the weights' sum per pair in `main`'s tree (entry i takes i + stride), in place:
        //    the values have read them
        workgroupBarrier();
        for (var stride = TILE / 2u; stride > 0u; stride /= 2u) {
            for (var e = lane; e < pairs * stride; e += WG) {
                let at = (e / stride) * TILE + e % stride;
                tile_p[at] += tile_p[at + stride];
            }
            workgroupBarrier();
        }
        if lane < pairs && tile_count(lane, t0) > 0u {
            tile_l[lane] = fma(tile_l[lane], tile_corr[lane], tile_p[lane * TILE]);
        }
    }
    // the partial states of the tile's tokens, in `main`'s layout
    if lane < pairs && tile_last[lane / g_n] != NO_WORK {
        let at = partial_at(n0 + lane / g_n - group.token0, kh * g_n + lane % g_n, s);
        partials[at] = vec4<f32>(tile_m[lane], tile_l[lane], 0.0, 0.0);
    }
    if sub < subs {
        for (var k = 0u; k < QT_ACC; k++) {
            let pair = sub + k * subs;
            if pair < pairs && tile_last[pair / g_n] != NO_WORK {
                let at = partial_at(n0 + pair / g_n - group.token0, kh * g_n + pair % g_n, s);
                partials[at + 1u + d4] = acc[k];
            }
        }
    }
}
