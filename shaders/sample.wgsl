// Sampling, one workgroup per chunk row. Scores are logits / T (T > 0) or the logits (greedy).
//   greedy (T <= 0): argmax, ties to the lowest id.
//   otherwise: argmax of score + Gumbel noise over the kept tokens, which is exactly a draw from
//   softmax(score) restricted to them. Kept: score >= a threshold, in Hugging Face's top-k,
//   top-p, min-p order:
//   - top-k (0 < top_k < V): the top_k-th largest score (its ties stay too);
//   - top-p (top_p < 1): the largest score s such that the tokens kept so far with score >= s
//     hold at least top_p of their mass. Masses are exp(score - max) in fixed point (units of
//     2^-31, rounded), summed in integers: the same total in any order, so a row's threshold
//     never depends on how its vocabulary was cut up. The comparison is f32(mass) >=
//     top_p * f32(total) (`reaches`);
//   - min-p (min_p > 0): scores >= max + log(min_p).
//   The two thresholds are found by radix select over the scores' order-preserving u32 keys, 8
//   bits a pass: a histogram of the candidates' next digit, then the digit whose bucket the
//   goal falls in (`choose`). Four passes find a key exactly.
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
// The split path (EngineOptions::split_sampling: every row or position) replaces `main` by dispatches in which no thread
// walks the vocabulary alone, each a workgroup per chunk of WG * PER_THREAD entries of a row
// (CHUNKS chunks) but the merge:
//   `chunks`: the chunk's max, normalizer, kept count, raw statistics, Gumbel-max (rows that
//     truncate nothing) and its top_n candidates;
//   `radix` (PASS 0-3: top-k, 4-7: top-p; rows that truncate so): one radix pass, its histogram
//     added into the row's (position's) with atomics (counts and fixed-point masses: exact in
//     any order);
//   `kept` (rows that truncate): the Gumbel-max, kept count and kept mass over the kept tokens;
//   `merge`, a workgroup per row: combines the chunks in one fixed tree and writes what `main`
//     writes. The same token, kept count and alternatives as `main`; the log-normalizers are the
//     same sums in another fixed order (a logprob may differ from `main`'s in its last bits,
//     never with the batch).

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
override PER_THREAD: u32 = 1u;  // split path: entries of a chunk per thread (at most 32)
override CHUNKS: u32 = 1u;      // split path: chunks per row, ceil(V / (WG * PER_THREAD))
override STAT_WORDS: u32 = 0u;  // split path: words of `work`'s chunk statistics, before its rows
override PASS: u32 = 0u;        // `radix`: the pass, 0-3 top-k's digits, 4-7 top-p's
const WG: u32 = 256u;
const TOP_MAX: u32 = 20u;
const MASKED: f32 = -3.0e38;
const SCALED: u32 = 0u;
const RAW: u32 = 1u;
const PROCESSED: u32 = 2u;
const NEG_INF_BITS: u32 = 0xff800000u;
const NO_TOKEN: u32 = 0xffffffffu;
// a chunk's partial results: max score, its id, sum exp(score - max), best Gumbel score, its id,
// kept count, raw max, sum exp(raw - raw max), sum exp(score - row max) over the kept (f32 bits
// but the ids)
const STATS: u32 = 9u;
// radix select: buckets a pass (8-bit digits), passes (4 a threshold), words of a row's
// histograms ([PASSES, BUCKETS, 2]: high and low word of a count or fixed-point mass) and of its
// states (`Select` after each pass, then the final threshold)
const BUCKETS: u32 = 256u;
const PASSES: u32 = 8u;
const HIST_WORDS: u32 = PASSES * BUCKETS * 2u;
const STATE_WORDS: u32 = (PASSES + 1u) * 4u;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<storage, read> rows: array<RowInfo>;      // [R]
@group(0) @binding(2) var<storage, read> samplers: array<Sampler>;  // [R]
@group(0) @binding(3) var<storage, read> logits: array<f32>;        // [R, V] (SCORE: [R * C, V])
@group(0) @binding(4) var<storage, read_write> out: array<u32>;     // [3, R]: ids, logprob bits, kept counts (SCORE: [3, R * C])
@group(0) @binding(5) var<storage, read> mask: array<u32>;          // [cache rows, MASK_WORDS]: bit i % 32 of word i / 32 = token i allowed
@group(0) @binding(6) var<storage, read_write> top: array<u32>;     // [R, TOP_MAX, 2]: token id, logprob bits (SCORE: [R * C, ...])
@group(0) @binding(7) var<storage, read> ids: array<u32>;           // [R, C] the chunk's ids (SCORE only)
// split path: chunk statistics (SCORE: [R * C, ...]; STAT_WORDS in all), then per sampled row
// HIST_WORDS of histograms, STATE_WORDS of states and [CHUNKS, TOP_MAX, 2] top candidates (id,
// score bits). Atomic for the histograms; plain loads and stores elsewhere.
@group(0) @binding(8) var<storage, read_write> work: array<atomic<u32>>;  // [R, CHUNKS, STATS], then [R, HIST_WORDS + STATE_WORDS + CHUNKS * TOP_MAX * 2]

var<workgroup> red_v: array<f32, WG>;
var<workgroup> red_i: array<u32, WG>;
var<workgroup> picked: array<u32, TOP_MAX>;
var<workgroup> red_max: array<vec4<f32>, WG>;
var<workgroup> red_ids: array<vec2<u32>, WG>;
var<workgroup> red_sum: array<vec4<f32>, WG>;
// radix select: the workgroup's histogram, suffix sums of a histogram ([BUCKETS] is 0) and the
// chosen digit with the count or mass above its bucket
var<workgroup> hist_hi: array<atomic<u32>, BUCKETS>;
var<workgroup> hist_lo: array<atomic<u32>, BUCKETS>;
var<workgroup> suf_hi: array<u32, 257>;
var<workgroup> suf_lo: array<u32, 257>;
var<workgroup> chosen_digit: array<u32, 4>;
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

// Several independent reductions in one tree, for the split path's partial results: maxes.x
// and .y argmaxes (ids in ids.x, .y; ties to the lowest id), maxes.z a max, sums four sums. The
// same pairs as `lanes_argmax` and `reduce_sum`, so the same bits, for one tree's barriers.
struct Reduced {
    maxes: vec4<f32>,
    ids: vec2<u32>,
    sums: vec4<f32>,
}

fn lanes_reduce(t: u32, maxes: vec4<f32>, ids: vec2<u32>, sums: vec4<f32>) -> Reduced {
    red_max[t] = maxes;
    red_ids[t] = ids;
    red_sum[t] = sums;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if t < stride {
            let a = red_max[t];
            let b = red_max[t + stride];
            let ai = red_ids[t];
            let bi = red_ids[t + stride];
            let x = b.x > a.x || (b.x == a.x && bi.x < ai.x);
            let y = b.y > a.y || (b.y == a.y && bi.y < ai.y);
            red_max[t] = vec4<f32>(select(a.x, b.x, x), select(a.y, b.y, y), select(a.z, b.z, b.z > a.z), 0.0);
            red_ids[t] = vec2<u32>(select(ai.x, bi.x, x), select(ai.y, bi.y, y));
            red_sum[t] += red_sum[t + stride];
        }
        workgroupBarrier();
    }
    let r = Reduced(red_max[0], red_ids[0], red_sum[0]);
    workgroupBarrier();
    return r;
}

// Point the mask lookups of `score` at row `row`'s mask, when its sampler has one.
fn use_row_mask(row: u32, s: Sampler) {
    use_mask = s.masked != 0u;
    mask_row = rows[row].cache_row * MASK_WORDS;
}

fn has_top_k(s: Sampler) -> bool {
    return s.temperature > 0.0 && s.top_k > 0u && s.top_k < V;
}

fn has_top_p(s: Sampler) -> bool {
    return s.temperature > 0.0 && s.top_p < 1.0;
}

fn truncates(s: Sampler) -> bool {
    return has_top_k(s) || has_top_p(s) || (s.temperature > 0.0 && s.min_p > 0.0);
}

fn ld(i: u32) -> u32 {
    return atomicLoad(&work[i]);
}

fn st(i: u32, v: u32) {
    atomicStore(&work[i], v);
}

// A sampled row's words of `work` past the chunk statistics.
fn hist_at(r: u32) -> u32 {
    return STAT_WORDS + r * (HIST_WORDS + STATE_WORDS + CHUNKS * TOP_MAX * 2u);
}

fn state_at(r: u32) -> u32 {
    return hist_at(r) + HIST_WORDS;
}

fn cand_at(r: u32, c: u32, k: u32) -> u32 {
    return state_at(r) + STATE_WORDS + (c * TOP_MAX + k) * 2u;
}

// The u32 whose unsigned order is the scores' order (-0 is 0), and back.
fn key_of(v: f32) -> u32 {
    let b = bitcast<u32>(select(v, 0.0, v == 0.0));
    return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

fn value_of(k: u32) -> f32 {
    return bitcast<f32>(select(~k, k & 0x7fffffffu, (k & 0x80000000u) != 0u));
}

// Fixed-point mass of a score: exp(v - max) in units of 2^-31, rounded (at most 2^31).
fn mass_q(v: f32, m: f32) -> u32 {
    return u32(round(exp(v - m) * 2147483648.0));
}

// Two-word unsigned integers (high, low).
fn add_wide(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    let lo = a.y + b.y;
    return vec2<u32>(a.x + b.x + select(0u, 1u, lo < a.y), lo);
}

fn wide_f32(a: vec2<u32>) -> f32 {
    // the products are exact: fma rounds what a multiply and an add round
    return fma(f32(a.x), 4294967296.0, fma(f32(a.y >> 16u), 65536.0, f32(a.y & 0xffffu)));
}

// A radix select's progress: the key bits found so far (the rest 0), the count or mass of the
// candidates above them, and the goal (top-k's count; top-p's mass as f32 bits, known once its
// first pass has the total).
struct Select {
    prefix: u32,
    above_hi: u32,
    above_lo: u32,
    goal: u32,
}

fn select_start(s: Sampler, mass: bool) -> Select {
    return Select(0u, 0u, 0u, select(s.top_k, 0u, mass));
}

// Whether key k is a candidate of digit pass j (its higher digits are the prefix's).
fn in_prefix(k: u32, prefix: u32, j: u32) -> bool {
    return j == 0u || (k >> (32u - 8u * j)) == (prefix >> (32u - 8u * j));
}

fn digit(k: u32, j: u32) -> u32 {
    return (k >> (24u - 8u * j)) & 0xffu;
}

// Add q to the workgroup's bucket b (the carry into the high word: exact in any order).
fn hist_add(b: u32, q: u32) {
    let old = atomicAdd(&hist_lo[b], q);
    if old > 0xffffffffu - q { atomicAdd(&hist_hi[b], 1u); }
}

fn hist_clear(t: u32) {
    atomicStore(&hist_hi[t], 0u);
    atomicStore(&hist_lo[t], 0u);
}

// Whether the count or mass `cum` of the tokens at or above a key reaches the goal.
fn reaches(cum: vec2<u32>, goal: u32, mass: bool) -> bool {
    if mass { return wide_f32(cum) >= bitcast<f32>(goal); }
    return cum.x > 0u || cum.y >= goal;
}

// Digit pass j of a radix select, from its histogram in suf_hi/suf_lo (thread t: bucket t, and
// suf[BUCKETS] = 0): the largest digit whose bucket with those above reaches the goal (such a
// digit exists: the total does). Every thread calls it; the result is uniform.
fn choose(t: u32, j: u32, mass: bool, top_p: f32, sel: Select) -> Select {
    for (var off = 1u; off < BUCKETS; off *= 2u) {
        var h = vec2<u32>(suf_hi[t], suf_lo[t]);
        if t + off < BUCKETS { h = add_wide(h, vec2<u32>(suf_hi[t + off], suf_lo[t + off])); }
        workgroupBarrier();
        suf_hi[t] = h.x;
        suf_lo[t] = h.y;
        workgroupBarrier();
    }
    var goal = sel.goal;
    if mass && j == 0u { goal = bitcast<u32>(top_p * wide_f32(vec2<u32>(suf_hi[0], suf_lo[0]))); }
    let above = vec2<u32>(sel.above_hi, sel.above_lo);
    let here = reaches(add_wide(above, vec2<u32>(suf_hi[t], suf_lo[t])), goal, mass);
    let below_next = add_wide(above, vec2<u32>(suf_hi[t + 1u], suf_lo[t + 1u]));
    if here && (t + 1u == BUCKETS || !reaches(below_next, goal, mass)) {
        chosen_digit[0] = t;
        chosen_digit[1] = below_next.x;
        chosen_digit[2] = below_next.y;
        chosen_digit[3] = goal;
    }
    let c = workgroupUniformLoad(&chosen_digit);
    return Select(sel.prefix | (c[0] << (24u - 8u * j)), c[1], c[2], c[3]);
}

// The workgroup's own histogram into the suffix arrays (after a barrier).
fn hist_to_suffix(t: u32) {
    suf_hi[t] = atomicLoad(&hist_hi[t]);
    suf_lo[t] = atomicLoad(&hist_lo[t]);
    if t == 0u {
        suf_hi[BUCKETS] = 0u;
        suf_lo[BUCKETS] = 0u;
    }
    workgroupBarrier();
}

// `main`'s radix select over the whole vocabulary: top-k's (mass false) or top-p's threshold key
// among the tokens with keys >= `floor`.
fn select_whole(t: u32, r: u32, s: Sampler, mass: bool, floor: u32, m: f32) -> u32 {
    var sel = select_start(s, mass);
    for (var j = 0u; j < 4u; j++) {
        hist_clear(t);
        workgroupBarrier();
        for (var i = t; i < V; i += WG) {
            let v = score(r, i, s.temperature);
            let k = key_of(v);
            if k >= floor && in_prefix(k, sel.prefix, j) { hist_add(digit(k, j), select(1u, mass_q(v, m), mass)); }
        }
        workgroupBarrier();
        hist_to_suffix(t);
        sel = choose(t, j, mass, s.top_p, sel);
    }
    return sel.prefix;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let r = wid.x; // SCORE: the token p
    let t = lid.x;
    let row = select(r, r / max(step.width, 1u), SCORE);
    let s = samplers[row];
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

    // 2. the kept set: score >= thr (top-k, then top-p among the tokens top-k keeps)
    var thr = lo0;
    var floor = 0u;
    if has_top_k(s) {
        floor = select_whole(t, r, s, false, 0u, m);
        thr = value_of(floor);
    }
    if has_top_p(s) {
        thr = value_of(select_whole(t, r, s, true, floor, m));
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

// The sampler's row of workgroup row r (SCORE: of position r).
fn split_row(r: u32) -> u32 {
    return select(r, r / max(step.width, 1u), SCORE);
}

// The row's max score: the max of its chunks' (exact in any order).
fn row_max(t: u32, r: u32) -> f32 {
    var mx = -3.4e38;
    for (var c = t; c < CHUNKS; c += WG) { mx = max(mx, bitcast<f32>(ld((r * CHUNKS + c) * STATS))); }
    return lanes_argmax(t, mx, 0u).v;
}

// Split path: the state of row r's radix select after pass g, from the stored state after pass
// g - 1 (its mode's start at a mode's first pass) and pass g's histogram. Chunk 0 stores it for
// the dispatches after this one (the others of this dispatch read only earlier states).
fn state_after(t: u32, r: u32, c: u32, g: u32, s: Sampler) -> Select {
    let at = hist_at(r) + g * BUCKETS * 2u;
    suf_hi[t] = ld(at + 2u * t);
    suf_lo[t] = ld(at + 2u * t + 1u);
    if t == 0u {
        suf_hi[BUCKETS] = 0u;
        suf_lo[BUCKETS] = 0u;
    }
    let mass = g >= 4u;
    var sel = select_start(s, mass);
    if g % 4u != 0u {
        let p = state_at(r) + (g - 1u) * 4u;
        sel = Select(ld(p), ld(p + 1u), ld(p + 2u), ld(p + 3u));
    }
    workgroupBarrier();
    sel = choose(t, g % 4u, mass, s.top_p, sel);
    if c == 0u && t == 0u {
        let p = state_at(r) + g * 4u;
        st(p, sel.prefix);
        st(p + 1u, sel.above_hi);
        st(p + 2u, sel.above_lo);
        st(p + 3u, sel.goal);
    }
    return sel;
}

// Split path, part 1: workgroup (c, r) takes chunk c of row r (SCORE: position r), entries
// c * WG * PER_THREAD + lane + k * WG, and writes the chunk's partial results; a sampled row that
// truncates also clears its histograms here, and one that lists alternatives gets the chunk's
// top_n candidates.
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
    let row = split_row(r);
    let s = samplers[row];
    let temp = s.temperature;
    let draw = temp > 0.0 && !SCORE && !truncates(s);
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
    let found = lanes_reduce(t, vec4<f32>(mx, gv, mr, 0.0), vec2<u32>(bi, gi), vec4<f32>(kept, 0.0, 0.0, 0.0));
    let best = Best(found.maxes.x, found.ids.x);
    let gumbel = Best(found.maxes.y, found.ids.y);
    let m_raw = found.maxes.z;
    kept = found.sums.x;
    var z = 0.0;
    var zr = 0.0;
    for (var k = 0u; k < PER_THREAD; k++) {
        let i = first + k * WG;
        if i >= V { break; }
        z += exp(score(r, i, temp) - best.v);
        if raw { zr += exp(score(r, i, 1.0) - m_raw); }
    }
    let sums = lanes_reduce(t, vec4<f32>(), vec2<u32>(), vec4<f32>(z, zr, 0.0, 0.0)).sums;
    z = sums.x;
    zr = sums.y;
    if t == 0u {
        let at = (r * CHUNKS + c) * STATS;
        st(at, bitcast<u32>(best.v));
        st(at + 1u, best.i);
        st(at + 2u, bitcast<u32>(z));
        st(at + 3u, bitcast<u32>(gumbel.v));
        st(at + 4u, gumbel.i);
        st(at + 5u, bitcast<u32>(kept));
        st(at + 6u, bitcast<u32>(m_raw));
        st(at + 7u, bitcast<u32>(zr));
    }
    if truncates(s) {
        for (var w = c * WG + t; w < HIST_WORDS; w += CHUNKS * WG) { st(hist_at(r) + w, 0u); }
    }
    // the chunk's top_n: rounds of argmax (ties to the lowest id), each thread skipping its
    // entries already taken (bit k: entry first + k * WG)
    var taken = 0u;
    for (var q = 0u; q < min(s.top_n, TOP_MAX); q++) {
        var bv = -3.4e38;
        var bj = NO_TOKEN;
        for (var k = 0u; k < PER_THREAD; k++) {
            let i = first + k * WG;
            if i >= V { break; }
            let v = score(r, i, temp);
            if (taken & (1u << k)) == 0u && v > bv { bv = v; bj = i; }
        }
        let b = lanes_argmax(t, bv, bj);
        if b.i != NO_TOKEN && b.i >= first && (b.i - first) % WG == 0u { taken |= 1u << ((b.i - first) / WG); }
        if t == 0u {
            st(cand_at(r, c, q), b.i);
            st(cand_at(r, c, q) + 1u, bitcast<u32>(b.v));
        }
    }
}

// Split path, a radix pass (rows whose sampler truncates by top-k, PASS 0-3, or top-p, 4-7):
// workgroup (c, r) adds chunk c's candidates' digits to row r's histogram of the pass.
@compute @workgroup_size(WG)
fn radix(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let c = wid.x;
    let r = wid.y + wid.z * nwg.y;
    let t = lid.x;
    if r >= select(step.rows, step.tokens, SCORE) { return; }
    let row = split_row(r);
    let s = samplers[row];
    let mass = PASS >= 4u;
    if select(!has_top_k(s), !has_top_p(s), mass) { return; }
    use_row_mask(row, s);
    let j = PASS % 4u;
    // top-p counts the tokens top-k keeps: keys >= its threshold
    var floor = 0u;
    if mass && has_top_k(s) {
        if PASS == 4u {
            floor = state_after(t, r, c, 3u, s).prefix;
        } else {
            floor = ld(state_at(r) + 3u * 4u);
        }
    }
    var sel = select_start(s, mass);
    if j > 0u { sel = state_after(t, r, c, PASS - 1u, s); }
    var m = 0.0;
    if mass { m = row_max(t, r); }
    hist_clear(t);
    workgroupBarrier();
    let first = c * WG * PER_THREAD + t;
    for (var k = 0u; k < PER_THREAD; k++) {
        let i = first + k * WG;
        if i >= V { break; }
        let v = score(r, i, s.temperature);
        let key = key_of(v);
        if key >= floor && in_prefix(key, sel.prefix, j) { hist_add(digit(key, j), select(1u, mass_q(v, m), mass)); }
    }
    workgroupBarrier();
    let h = vec2<u32>(atomicLoad(&hist_hi[t]), atomicLoad(&hist_lo[t]));
    let at = hist_at(r) + (PASS * BUCKETS + t) * 2u;
    if h.y != 0u {
        let old = atomicAdd(&work[at + 1u], h.y);
        if old > 0xffffffffu - h.y { atomicAdd(&work[at], 1u); }
    }
    if h.x != 0u { atomicAdd(&work[at], h.x); }
}

// Split path, rows that truncate: workgroup (c, r) finds the row's threshold (top-k's or top-p's
// last pass, then min-p) and writes chunk c's Gumbel-max, kept count and kept mass over the kept
// tokens in place of the `chunks` pass's; chunk 0 stores the threshold for the merge.
@compute @workgroup_size(WG)
fn kept(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let c = wid.x;
    let r = wid.y + wid.z * nwg.y;
    let t = lid.x;
    if r >= select(step.rows, step.tokens, SCORE) { return; }
    let row = split_row(r);
    let s = samplers[row];
    if !truncates(s) { return; }
    use_row_mask(row, s);
    let temp = s.temperature;
    var thr = -3.4e38;
    if has_top_p(s) {
        thr = value_of(state_after(t, r, c, 7u, s).prefix);
    } else if has_top_k(s) {
        thr = value_of(state_after(t, r, c, 3u, s).prefix);
    }
    let m = row_max(t, r);
    if s.min_p > 0.0 { thr = max(thr, m + log(s.min_p)); }
    if c == 0u && t == 0u { st(state_at(r) + PASSES * 4u, bitcast<u32>(thr)); }
    var gv = -3.4e38;
    var gi = NO_TOKEN;
    var kept = 0.0;
    var zk = 0.0;
    let first = c * WG * PER_THREAD + t;
    for (var k = 0u; k < PER_THREAD; k++) {
        let i = first + k * WG;
        if i >= V { break; }
        let v = score(r, i, temp);
        if v >= thr {
            let g = v - log(-log(uniform01(s.seed, s.counter, i)));
            if g > gv { gv = g; gi = i; }
            if v > MASKED {
                kept += 1.0;
                zk += exp(v - m);
            }
        }
    }
    let found = lanes_reduce(t, vec4<f32>(gv, 0.0, 0.0, 0.0), vec2<u32>(gi, 0u), vec4<f32>(kept, zk, 0.0, 0.0));
    let gumbel = Best(found.maxes.x, found.ids.x);
    kept = found.sums.x;
    zk = found.sums.y;
    if t == 0u {
        let at = (r * CHUNKS + c) * STATS;
        st(at + 3u, bitcast<u32>(gumbel.v));
        st(at + 4u, gumbel.i);
        st(at + 5u, bitcast<u32>(kept));
        st(at + 8u, bitcast<u32>(zk));
    }
}

// Split path, the merge: workgroup r combines row r's chunks (lane l: chunks l, l + WG, ..., in
// order, then the tree) and writes the token, its log-probability, the kept count and the top_n
// alternatives (from the chunks' candidates).
@compute @workgroup_size(WG)
fn merge(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
) {
    let r = wid.x + wid.y * nwg.x;  // past 65535 rows or positions, on in y
    let t = lid.x;
    if r >= select(step.rows, step.tokens, SCORE) { return; }
    let row = split_row(r);
    let s = samplers[row];
    let temp = s.temperature;
    let raw = temp > 0.0 && s.mode == RAW;
    let cut_kept = truncates(s);
    use_row_mask(row, s);
    var mx = -3.4e38;
    var bi = NO_TOKEN;
    var gv = -3.4e38;
    var gi = NO_TOKEN;
    var kept = 0.0;
    var mr = -3.4e38;
    for (var c = t; c < CHUNKS; c += WG) {
        let at = (r * CHUNKS + c) * STATS;
        let cm = bitcast<f32>(ld(at));
        if cm > mx { mx = cm; bi = ld(at + 1u); }
        let cg = bitcast<f32>(ld(at + 3u));
        if cg > gv { gv = cg; gi = ld(at + 4u); }
        kept += bitcast<f32>(ld(at + 5u));
        mr = max(mr, bitcast<f32>(ld(at + 6u)));
    }
    let found = lanes_reduce(t, vec4<f32>(mx, gv, mr, 0.0), vec2<u32>(bi, gi), vec4<f32>(kept, 0.0, 0.0, 0.0));
    let m = found.maxes.x;
    var chosen = found.ids.x;
    if temp > 0.0 { chosen = found.ids.y; }
    let m_raw = found.maxes.z;
    kept = found.sums.x;
    var z = 0.0;
    var zr = 0.0;
    var zk = 0.0;
    for (var c = t; c < CHUNKS; c += WG) {
        let at = (r * CHUNKS + c) * STATS;
        z = fma(bitcast<f32>(ld(at + 2u)), exp(bitcast<f32>(ld(at)) - m), z);
        if raw { zr = fma(bitcast<f32>(ld(at + 7u)), exp(bitcast<f32>(ld(at + 6u)) - m_raw), zr); }
        if cut_kept { zk += bitcast<f32>(ld(at + 8u)); }
    }
    let sums = lanes_reduce(t, vec4<f32>(), vec2<u32>(), vec4<f32>(z, zr, zk, 0.0)).sums;
    z = sums.x;
    zr = sums.y;
    zk = sums.z;
    if SCORE { chosen = scored_next(r, row); }
    // RAW reads its scores at temperature 1 (greedy rows: their scores are the logits already);
    // PROCESSED, over the kept tokens, reports the others as -inf
    var temp_of = temp;
    var lz = m + log(z);
    var cut = -3.4e38;
    if raw {
        temp_of = 1.0;
        lz = m_raw + log(zr);
    } else if cut_kept && s.mode == PROCESSED {
        lz = m + log(zk);
        cut = bitcast<f32>(ld(state_at(r) + PASSES * 4u));
    }
    let n = select(step.rows, step.tokens, SCORE);
    let writes = writes_at(r, row);
    if t == 0u && writes {
        out[r] = chosen;
        out[n + r] = bitcast<u32>(score(r, chosen, temp_of) - lz);
        out[2u * n + r] = u32(kept);
    }
    // the top_n: rounds of argmax over the heads of the chunks' candidate lists (lane l: chunk l,
    // at most 256 chunks). Each list is in (score desc, id asc) order, so the best untaken
    // candidate is always a head: the same list as rounds over every candidate.
    let n_top = min(s.top_n, TOP_MAX);
    var head = 0u;
    for (var q = 0u; q < n_top; q++) {
        var v = -3.4e38;
        var id = NO_TOKEN;
        if t < CHUNKS && head < n_top {
            let at = cand_at(r, t, head);
            id = ld(at);
            if id != NO_TOKEN { v = bitcast<f32>(ld(at + 1u)); }
        }
        let b = lanes_argmax(t, v, id);
        if id != NO_TOKEN && b.i == id { head++; }
        if t == 0u && writes {
            top[(r * TOP_MAX + q) * 2u] = b.i;
            let lp = bitcast<u32>(score(r, b.i, temp_of) - lz);
            top[(r * TOP_MAX + q) * 2u + 1u] = select(NEG_INF_BITS, lp, b.v >= cut);
        }
    }
}
