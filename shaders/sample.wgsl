// Sampling, one workgroup per chunk row. Scores are logits / T (T > 0) or the logits (greedy).
//   greedy (T <= 0): argmax, ties to the lowest id.
//   otherwise: argmax of score + Gumbel noise over the kept tokens, which is exactly a draw from
//   softmax(score) restricted to them. Kept: score >= a threshold found by bisection so that at
//   least top_k tokens (top_k > 0) and then the smallest set with probability >= top_p
//   (top_p < 1) stay, then those with probability >= min_p x the largest's (min_p > 0), as in
//   Hugging Face's top-k, top-p, min-p order.
// The noise is a hash of (seed, counter, token id): a row's draw depends only on its own seed and
// the position the token will take, whatever else shares the batch.
// Also writes the chosen token's log-probability, and for rows that ask the top_n most likely
// tokens with theirs, under the row's logprob mode: SCALED, softmax(score) before truncation;
// RAW, softmax(logits), before temperature and truncation; PROCESSED, the distribution drawn
// from, softmax(score) over the kept tokens (greedy: RAW's). And how many tokens were kept (the
// tokens the mask allows, when nothing truncates).
// A row with a token mask sees only the tokens its mask allows (constrained decoding): the others
// score MASKED, which no draw can pick while one token is allowed. Logit biases were added to the
// logits by `logit_bias.wgsl` before this dispatch.
// Rows with no new tokens in this chunk keep their previous id.
// SCORE: the same per-token work over every position of the chunk (all-position logits), one
// workgroup per token p = row * width + j, with the chunk's next token ids[p + 1] in place of a
// draw (after the row's last token: its next_id, if any): its log-probability, kept count and
// alternatives are the bits a draw at that position reports (the same code on the same logits),
// written at p.
// The split path (`splits`: rows that truncate nothing and list no alternatives, so greedy rows
// and plain draws) leaves `main` for two dispatches in which no thread walks the vocabulary alone:
// `chunks`, a workgroup per chunk of WG * PER_THREAD entries of a row (CHUNKS chunks), writes the
// chunk's partial results; `merge`, a workgroup per row, combines them chunk by chunk in one fixed
// tree and writes what `main` writes. The same token (argmax and Gumbel-max over every token, ties
// to the lowest id) and kept count as `main`; the log-normalizers are the same sums in another
// fixed order (a logprob may differ from `main`'s in its last bits, never with the batch), and
// PROCESSED's is SCALED's (nothing is truncated).

struct Sampler {
    temperature: f32,  // <= 0: greedy
    seed: u32,
    counter: u32,      // the position the sampled token will take
    top_k: u32,        // 0: off
    top_p: f32,        // >= 1: off
    masked: u32,       // 1: only tokens the row's mask allows
    top_n: u32,        // most likely tokens to report (at most TOP_MAX)
    min_p: f32,        // <= 0: off
    mode: u32,         // logprobs: SCALED, RAW or PROCESSED
    _pad0: u32,
    _pad1: u32,
}

override V: u32;           // vocabulary size
override MASK_WORDS: u32;  // words per mask row: ceil(V / 32)
override SCORE: bool = false;
override SPLIT: bool = false;   // the split path is on (`splits`)
override PER_THREAD: u32 = 1u;  // split path: entries of a chunk per thread
override CHUNKS: u32 = 1u;      // split path: chunks per row, ceil(V / (WG * PER_THREAD))
const WG: u32 = 256u;
const BISECT: u32 = 32u;
const TOP_MAX: u32 = 20u;
const MASKED: f32 = -3.0e38;
const SCALED: u32 = 0u;
const RAW: u32 = 1u;
const PROCESSED: u32 = 2u;
const NEG_INF_BITS: u32 = 0xff800000u;
const NO_TOKEN: u32 = 0xffffffffu;
// a chunk's partial results: max score, its id, sum exp(score - max), best Gumbel score, its id,
// kept count, raw max, sum exp(raw - raw max) (f32 bits but the ids)
const STATS: u32 = 8u;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<storage, read> rows: array<RowInfo>;      // [R]
@group(0) @binding(2) var<storage, read> samplers: array<Sampler>;  // [R]
@group(0) @binding(3) var<storage, read> logits: array<f32>;        // [R, V] (SCORE: [R * C, V])
@group(0) @binding(4) var<storage, read_write> out: array<u32>;     // [3, R]: ids, logprob bits, kept counts (SCORE: [3, R * C])
@group(0) @binding(5) var<storage, read> mask: array<u32>;          // [cache rows, MASK_WORDS]: bit i % 32 of word i / 32 = token i allowed
@group(0) @binding(6) var<storage, read_write> top: array<u32>;     // [R, TOP_MAX, 2]: token id, logprob bits (SCORE: [R * C, ...])
@group(0) @binding(7) var<storage, read> ids: array<u32>;           // [R, C] the chunk's ids (SCORE only)
@group(0) @binding(8) var<storage, read_write> chunk_stats: array<u32>;  // [R, CHUNKS, STATS] (SCORE: [R * C, ...]): split path

var<workgroup> red_v: array<f32, WG>;
var<workgroup> red_i: array<u32, WG>;
var<workgroup> picked: array<u32, TOP_MAX>;
var<private> mask_row: u32;   // first mask word of this workgroup's row
var<private> use_mask: bool;

fn pcg(v: u32) -> u32 {
    let s = v * 747796405u + 2891336453u;
    let w = ((s >> ((s >> 28u) + 4u)) ^ s) * 277803737u;
    return (w >> 22u) ^ w;
}

// uniform in (0, 1) from 24 hashed bits
fn uniform01(seed: u32, counter: u32, id: u32) -> f32 {
    let h = pcg(pcg(pcg(seed) ^ counter) ^ id);
    return (f32(h >> 8u) + 0.5) / 16777216.0;
}

fn score(r: u32, i: u32, t: f32) -> f32 {
    if use_mask && (mask[mask_row + i / 32u] & (1u << (i % 32u))) == 0u {
        return MASKED;
    }
    let l = logits[r * V + i];
    return select(l, l / t, t > 0.0);
}

fn was_picked(i: u32, n: u32) -> bool {
    for (var k = 0u; k < n; k++) {
        if picked[k] == i { return true; }
    }
    return false;
}

// workgroup sum of red_v (every thread calls it; the result is in red_v[0])
fn reduce_sum(t: u32) -> f32 {
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if t < stride { red_v[t] += red_v[t + stride]; }
        workgroupBarrier();
    }
    let v = red_v[0];
    workgroupBarrier();
    return v;
}

// workgroup max (and its lowest index) of (red_v, red_i)
fn reduce_argmax(t: u32) {
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if t < stride {
            let ov = red_v[t + stride];
            let oi = red_i[t + stride];
            if ov > red_v[t] || (ov == red_v[t] && oi < red_i[t]) {
                red_v[t] = ov;
                red_i[t] = oi;
            }
        }
        workgroupBarrier();
    }
}

// The lanes' best (v, i) pair: the largest v, ties to the lowest i (every thread calls it; the
// lane arrays are free again when it returns).
struct Best {
    v: f32,
    i: u32,
}

fn lanes_argmax(t: u32, v: f32, i: u32) -> Best {
    red_v[t] = v;
    red_i[t] = i;
    workgroupBarrier();
    reduce_argmax(t);
    let best = Best(red_v[0], red_i[0]);
    workgroupBarrier();
    return best;
}

// The lanes' sum of v, in the fixed tree (every thread calls it).
fn lanes_sum(t: u32, v: f32) -> f32 {
    red_v[t] = v;
    workgroupBarrier();
    return reduce_sum(t);
}

// Point the mask lookups of `score` at row `row`'s mask, when its sampler has one.
fn use_row_mask(row: u32, s: Sampler) {
    use_mask = s.masked != 0u;
    mask_row = rows[row].cache_row * MASK_WORDS;
}

// Whether a row takes the split path: it is on (EngineOptions::split_sampling), nothing truncates
// (greedy, or a draw without top-k, top-p or min-p) and no alternatives are listed
// (`Sampler::splits` says the same on the host).
fn splits(s: Sampler) -> bool {
    let truncates = s.temperature > 0.0 && ((s.top_k > 0u && s.top_k < V) || s.top_p < 1.0 || s.min_p > 0.0);
    return SPLIT && s.top_n == 0u && !truncates;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let r = wid.x; // SCORE: the token p
    let t = lid.x;
    let row = select(r, r / max(step.width, 1u), SCORE);
    let s = samplers[row];
    if splits(s) { return; }  // the whole workgroup: `chunks` and `merge` take the row
    let temp = s.temperature;
    use_row_mask(row, s);
    // 1. max and min score, softmax normalizer
    var mx = -3.4e38;
    var mn = 3.4e38;
    var bi = 0xffffffffu;
    for (var i = t; i < V; i += WG) {
        let v = score(r, i, temp);
        if v > mx { mx = v; bi = i; }
        mn = min(mn, v);
    }
    red_v[t] = mx;
    red_i[t] = bi;
    workgroupBarrier();
    reduce_argmax(t);
    let m = red_v[0];
    let greedy_id = red_i[0];
    workgroupBarrier();
    red_v[t] = -mn;
    red_i[t] = 0u;
    workgroupBarrier();
    reduce_argmax(t);
    let lo0 = -red_v[0];
    workgroupBarrier();
    var z = 0.0;
    for (var i = t; i < V; i += WG) { z += exp(score(r, i, temp) - m); }
    red_v[t] = z;
    workgroupBarrier();
    z = reduce_sum(t);

    // 2. the kept set: score >= thr
    var thr = lo0;
    if temp > 0.0 && s.top_k > 0u && s.top_k < V {
        var lo = lo0;
        var hi = m;
        for (var it = 0u; it < BISECT; it++) {
            let mid = 0.5 * (lo + hi);
            var c = 0.0;
            for (var i = t; i < V; i += WG) { if score(r, i, temp) >= mid { c += 1.0; } }
            red_v[t] = c;
            workgroupBarrier();
            if reduce_sum(t) >= f32(s.top_k) { lo = mid; } else { hi = mid; }
        }
        thr = lo;
    }
    if temp > 0.0 && s.top_p < 1.0 {
        var zk = 0.0;
        for (var i = t; i < V; i += WG) { let v = score(r, i, temp); if v >= thr { zk += exp(v - m); } }
        red_v[t] = zk;
        workgroupBarrier();
        zk = reduce_sum(t);
        var lo = thr;
        var hi = m;
        for (var it = 0u; it < BISECT; it++) {
            let mid = 0.5 * (lo + hi);
            var p = 0.0;
            for (var i = t; i < V; i += WG) { let v = score(r, i, temp); if v >= mid { p += exp(v - m); } }
            red_v[t] = p;
            workgroupBarrier();
            if reduce_sum(t) >= s.top_p * zk { lo = mid; } else { hi = mid; }
        }
        thr = lo;
    }

    if temp > 0.0 && s.min_p > 0.0 {
        thr = max(thr, m + log(s.min_p));
    }

    // 3. Gumbel-max over the kept set (greedy: the argmax)
    var chosen = greedy_id;
    let last = r % max(step.width, 1u) + 1u >= rows[row].n_new;
    if SCORE {
        chosen = select(ids[min(r + 1u, step.tokens - 1u)], rows[row].next_id, last);
    } else if temp > 0.0 {
        var bv = -3.4e38;
        var bj = 0xffffffffu;
        for (var i = t; i < V; i += WG) {
            let v = score(r, i, temp);
            if v >= thr {
                let g = v - log(-log(uniform01(s.seed, s.counter, i)));
                if g > bv { bv = g; bj = i; }
            }
        }
        red_v[t] = bv;
        red_i[t] = bj;
        workgroupBarrier();
        reduce_argmax(t);
        chosen = red_i[0];
    }
    // 4. the kept count, and the log-normalizer and scores of the row's logprob mode
    var kept = 0.0;
    var zk = 0.0;
    for (var i = t; i < V; i += WG) {
        let v = score(r, i, temp);
        if v >= thr && v > MASKED { kept += 1.0; zk += exp(v - m); }
    }
    red_v[t] = kept;
    workgroupBarrier();
    kept = reduce_sum(t);
    var lz = m + log(z);
    // a mode reads its scores at `temp_of`: the row's temperature, or 1 for RAW (greedy: RAW)
    var temp_of = temp;
    var cut = lo0;
    if s.mode == PROCESSED && temp > 0.0 {
        red_v[t] = zk;
        workgroupBarrier();
        lz = m + log(reduce_sum(t));
        cut = thr;
    } else if s.mode != SCALED && temp > 0.0 {
        temp_of = 1.0;
        var mr = -3.4e38;
        for (var i = t; i < V; i += WG) { mr = max(mr, score(r, i, 1.0)); }
        red_v[t] = mr;
        red_i[t] = 0u;
        workgroupBarrier();
        reduce_argmax(t);
        mr = red_v[0];
        workgroupBarrier();
        var zr = 0.0;
        for (var i = t; i < V; i += WG) { zr += exp(score(r, i, 1.0) - mr); }
        red_v[t] = zr;
        workgroupBarrier();
        lz = mr + log(reduce_sum(t));
    }
    let n = select(step.rows, step.tokens, SCORE);
    let scored = r % step.width < rows[row].n_new && (!last || rows[row].next_id != NO_TOKEN);
    let writes = select(r < step.rows && rows[r].n_new > 0u, scored, SCORE);
    if t == 0u && writes {
        out[r] = chosen;
        out[n + r] = bitcast<u32>(score(r, chosen, temp_of) - lz);
        out[2u * n + r] = u32(kept);
    }

    // 5. the top_n most likely tokens, one argmax round each (ties to the lowest id); under
    // PROCESSED a token not kept has log-probability -inf
    let top_n = min(s.top_n, TOP_MAX);
    for (var k = 0u; k < top_n; k++) {
        var bv = -3.4e38;
        var bj = 0xffffffffu;
        for (var i = t; i < V; i += WG) {
            let v = score(r, i, temp);
            if v > bv && !was_picked(i, k) { bv = v; bj = i; }
        }
        red_v[t] = bv;
        red_i[t] = bj;
        workgroupBarrier();
        reduce_argmax(t);
        if t == 0u {
            picked[k] = red_i[0];
            top[(r * TOP_MAX + k) * 2u] = red_i[0];
            let lp = bitcast<u32>(score(r, red_i[0], temp_of) - lz);
            top[(r * TOP_MAX + k) * 2u + 1u] = select(NEG_INF_BITS, lp, red_v[0] >= cut);
        }
        workgroupBarrier();
    }
}

// The token this workgroup's row (SCORE: position) reports instead of a draw, and whether it
// writes at all: the same rules as `main`.
fn scored_next(r: u32, row: u32) -> u32 {
    let last = r % max(step.width, 1u) + 1u >= rows[row].n_new;
    return select(ids[min(r + 1u, step.tokens - 1u)], rows[row].next_id, last);
}

fn writes_at(r: u32, row: u32) -> bool {
    let last = r % max(step.width, 1u) + 1u >= rows[row].n_new;
    let scored = r % step.width < rows[row].n_new && (!last || rows[row].next_id != NO_TOKEN);
    return select(r < step.rows && rows[r].n_new > 0u, scored, SCORE);
}

// Split path, part 1: workgroup (c, r) takes chunk c of row r (SCORE: position r), entries
// c * WG * PER_THREAD + lane + k * WG, and writes the chunk's partial results.
@compute @workgroup_size(WG)
fn chunks(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let c = wid.x;
    let r = wid.y + wid.z * nwg.y;  // past 65535 rows or positions, on in z
    let t = lid.x;
    if r >= select(step.rows, step.tokens, SCORE) { return; }
    let row = select(r, r / max(step.width, 1u), SCORE);
    let s = samplers[row];
    if !splits(s) { return; }
    let temp = s.temperature;
    let draw = temp > 0.0 && !SCORE;
    let raw = temp > 0.0 && s.mode == RAW;
    use_row_mask(row, s);
    var mx = -3.4e38;
    var bi = NO_TOKEN;
    var gv = -3.4e38;
    var gi = NO_TOKEN;
    var kept = 0.0;
    var mr = -3.4e38;
    let first = c * WG * PER_THREAD + t;
    for (var k = 0u; k < PER_THREAD; k++) {
        let i = first + k * WG;
        if i >= V { break; }
        let v = score(r, i, temp);
        if v > mx { mx = v; bi = i; }
        if v > MASKED { kept += 1.0; }
        if draw {
            let g = v - log(-log(uniform01(s.seed, s.counter, i)));
            if g > gv { gv = g; gi = i; }
        }
        if raw { mr = max(mr, score(r, i, 1.0)); }
    }
    let best = lanes_argmax(t, mx, bi);
    let gumbel = lanes_argmax(t, gv, gi);
    let m_raw = lanes_argmax(t, mr, 0u).v;
    kept = lanes_sum(t, kept);
    var z = 0.0;
    var zr = 0.0;
    for (var k = 0u; k < PER_THREAD; k++) {
        let i = first + k * WG;
        if i >= V { break; }
        z += exp(score(r, i, temp) - best.v);
        if raw { zr += exp(score(r, i, 1.0) - m_raw); }
    }
    z = lanes_sum(t, z);
    zr = lanes_sum(t, zr);
    if t == 0u {
        let at = (r * CHUNKS + c) * STATS;
        chunk_stats[at] = bitcast<u32>(best.v);
        chunk_stats[at + 1u] = best.i;
        chunk_stats[at + 2u] = bitcast<u32>(z);
        chunk_stats[at + 3u] = bitcast<u32>(gumbel.v);
        chunk_stats[at + 4u] = gumbel.i;
        chunk_stats[at + 5u] = bitcast<u32>(kept);
        chunk_stats[at + 6u] = bitcast<u32>(m_raw);
        chunk_stats[at + 7u] = bitcast<u32>(zr);
    }
}

// Split path, part 2: workgroup r combines row r's chunks (lane l: chunks l, l + WG, ..., in
// order, then the tree) and writes the token, its log-probability and the kept count.
@compute @workgroup_size(WG)
fn merge(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let r = wid.x + wid.y * nwg.x;  // past 65535 rows or positions, on in y
    let t = lid.x;
    if r >= select(step.rows, step.tokens, SCORE) { return; }
    let row = select(r, r / max(step.width, 1u), SCORE);
    let s = samplers[row];
    if !splits(s) { return; }
    let temp = s.temperature;
    let raw = temp > 0.0 && s.mode == RAW;
    use_row_mask(row, s);
    var mx = -3.4e38;
    var bi = NO_TOKEN;
    var gv = -3.4e38;
    var gi = NO_TOKEN;
    var kept = 0.0;
    var mr = -3.4e38;
    for (var c = t; c < CHUNKS; c += WG) {
        let at = (r * CHUNKS + c) * STATS;
        let cm = bitcast<f32>(chunk_stats[at]);
        if cm > mx { mx = cm; bi = chunk_stats[at + 1u]; }
        let cg = bitcast<f32>(chunk_stats[at + 3u]);
        if cg > gv { gv = cg; gi = chunk_stats[at + 4u]; }
        kept += bitcast<f32>(chunk_stats[at + 5u]);
        mr = max(mr, bitcast<f32>(chunk_stats[at + 6u]));
    }
    let best = lanes_argmax(t, mx, bi);
    let m = best.v;
    var chosen = best.i;
    let gumbel = lanes_argmax(t, gv, gi);
    if temp > 0.0 { chosen = gumbel.i; }
    let m_raw = lanes_argmax(t, mr, 0u).v;
    kept = lanes_sum(t, kept);
    var z = 0.0;
    var zr = 0.0;
    for (var c = t; c < CHUNKS; c += WG) {
        let at = (r * CHUNKS + c) * STATS;
        z = fma(bitcast<f32>(chunk_stats[at + 2u]), exp(bitcast<f32>(chunk_stats[at]) - m), z);
        if raw { zr = fma(bitcast<f32>(chunk_stats[at + 7u]), exp(bitcast<f32>(chunk_stats[at + 6u]) - m_raw), zr); }
    }
    z = lanes_sum(t, z);
    zr = lanes_sum(t, zr);
    if SCORE { chosen = scored_next(r, row); }
    // RAW reads its scores at temperature 1 (greedy rows: their scores are the logits already)
    var temp_of = temp;
    var lz = m + log(z);
    if raw {
        temp_of = 1.0;
        lz = m_raw + log(zr);
    }
    let n = select(step.rows, step.tokens, SCORE);
    if t == 0u && writes_at(r, row) {
        out[r] = chosen;
        out[n + r] = bitcast<u32>(score(r, chosen, temp_of) - lz);
        out[2u * n + r] = u32(kept);
    }
}
