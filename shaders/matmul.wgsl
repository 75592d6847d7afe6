// y[n, OUT_OFFSET + o] = sum_k x[n, k] * w[o, k] for one row-part of a weight matrix (PyTorch layout
// [out, in]). One thread per output column and 4 tokens: each weight vec4 is read once per 4 tokens
// (register blocking; workgroup memory was slower on lavapipe); with OUTS > 1 (the `wide` variants,
// for CPU adapters) a thread takes OUTS neighbouring outputs too, eight weight rows at a time
// (dots_rows8), and each input vec4 is read once for those eight (with subgroups, once per 8
// lanes: the lane hooks of matmul_subgroup.wgsl; without, matmul_lanes.wgsl's). Steps of fewer
// than 4 tokens (a decode step of 1-3 rows) take
// one token per thread instead (mat-vec: no lane computes dot products it throws away); a token's
// sum runs over k in the same order of fused steps either way (dot_fma), so both give the same
// bits.
// Two neighbours fuse into the product, each saving a dispatch per layer:
//   NORM: x is the residual stream and the product reads its RMS norm (the block's input norm),
//     computed per workgroup with rmsnorm.wgsl's lanes and tree (the same bits). One output per
//     thread (entry point `main_normed`) stages the normed input in workgroup memory a tile at a
//     time; the wide shape (`main_wide`, OUTS > 1) normalizes each input as it loads it, once per
//     8 rows. Its sums need barriers on 64 lanes, so CPU adapters keep the norm apart there
//     (`Fusion::auto`), unless the products are wide-subgroup's 8-lane workgroups (inv_rms_lanes8).
//   MLP_ACT: the MLP activation as an epilogue; gated ones pair output o's weight row (the gate)
//     with row O_ROWS + o (the up projection), each summed in the usual order.
//   LORA: the adapters' B (A x) as an epilogue (`store_out`, matmul_lora.wgsl, appended to every
//     dense product kernel), the A x from lora.wgsl's dispatch before.

override K: u32;                   // input features (multiple of 4)
override X_STRIDE: u32;            // floats per row of x (K, or more when x holds other columns after)
override O_ROWS: u32;              // output rows of this part
override OUT_STRIDE: u32;          // row stride of y
override OUT_OFFSET: u32 = 0u;     // first column of y written by this part
override W_FORMAT: u32 = 0u;       // 0 f32, 1 f16 pairs, 5 bf16 pairs, 2 Q8_0, 3 Q4_0, 4 Q4_1, 6 Q4_K, 7 Q6_K, 8 Q5_0, 9 Q5_1, 10 IQ4_NL, 11 Q5_K, 12 Q3_K, 13 Q2_K, 14 IQ4_XS, 15 MXFP4 (common.wgsl)
override ACCUMULATE: bool = false; // y += x W^T (the residual add, fused)
override SOFTCAP: f32 = 0.0;       // > 0: y = SOFTCAP * tanh(y / SOFTCAP) (final logits)
override PER_ROW: bool = false;    // inputs are the R chunk rows (LM head), not the R * C tokens
override NORM: bool = false;       // read RMS-norm(x) (over K) instead of x
override NORM_WEIGHT: bool = false; // the norm has a weight (norm_w)
override EPS: f32 = 1e-6;          // the norm's epsilon
override MLP_ACT: u32 = 0u;        // 0: none; else mlp_act(MLP_ACT - 1, gate, up) of common.wgsl
override BIAS: bool = false;       // y = x W^T + bias (Qwen2's q/k/v projections)
override WG: u32 = 64u;            // lanes per workgroup: 64 with NORM (NORM_LANES), but for inv_rms_lanes8
override OUTS: u32 = 1u;           // outputs per thread: 1 (`main`) or a multiple of 8 (`main_wide`: 8, see wide_outputs)
// Derived, never set: a branch on them is decided with the pipeline, and natively cut before the
// driver sees it (gpu/specialize.rs), where a call of common.wgsl's is_ext32 would stay.
override W_EXT32: bool = (W_FORMAT >= 8u && W_FORMAT <= 10u) || W_FORMAT == 15u;                 // is_ext32(W_FORMAT)
override W_KQUANT: bool = W_FORMAT == 6u || W_FORMAT == 7u || (W_FORMAT >= 11u && W_FORMAT <= 14u); // is_kquant(W_FORMAT)
override W_BLOCK32: bool = (W_FORMAT >= 2u && W_FORMAT <= 4u) || W_EXT32;      // is_block32(W_FORMAT)
override GATED: bool = MLP_ACT >= 2u;  // MLP_ACT pairs each output with a second weight row

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;   // [N, X_STRIDE], the first K read
@group(0) @binding(2) var<storage, read> w: array<u32>;         // [O_ROWS, K] in W_FORMAT
@group(0) @binding(3) var<storage, read_write> y: array<f32>;   // [N, OUT_STRIDE]
@group(0) @binding(4) var<storage, read> norm_w: array<vec4<f32>>; // [K] (read with NORM_WEIGHT)
@group(0) @binding(5) var<storage, read> bias: array<f32>;      // [O_ROWS] (read with BIAS)

// main_normed: the normalized input of the workgroup's tokens, a tile of k4 at a time (16 KiB).
const STAGE: u32 = 1024u;
var<workgroup> staged: array<vec4<f32>, STAGE>;
// rmsnorm.wgsl's lanes: a fused norm sums as they do, so it gives the same bits.
const NORM_LANES: u32 = 64u;

fn w4(o: u32, k4: u32) -> vec4<f32> {
    if W_EXT32 {
        let at = quant_at(W_FORMAT, o, k4, K);
        return dequant_ext(W_FORMAT, block_dm(W_FORMAT, w[at.x]), w[at.x + 1u], w[at.x + quant_word(W_FORMAT, at.y)], at.y);
    }
    if W_KQUANT {
        let at = quant_at(W_FORMAT, o, k4, K);
        return dequant_kq(W_FORMAT, kq_head(at.x), kq_data(at.x, at.y), at.y);
    }
    if W_FORMAT >= 2u && W_FORMAT <= 4u {
        let at = quant_at(W_FORMAT, o, k4, K);
        return dequant4(W_FORMAT, w[at.x], w[at.x + quant_word(W_FORMAT, at.y)], at.y);
    }
    return w4_float(o, k4);
}

// w4 of the 32- and 16-bit formats (0, 1, 5). dots_quad calls it for them (it takes blocks of 256
// itself, and dots_rows8 the blocks of 32), so its eight calls inline no copy of the quantized
// decoders: drivers that inline before they fold the format's branches (Mesa's) compile each
// pipeline several times faster.
fn w4_float(o: u32, k4: u32) -> vec4<f32> {
    if W_FORMAT == 1u || W_FORMAT == 5u {
        let i = (o * K) / 2u + k4 * 2u;
        return half4(W_FORMAT, w[i], w[i + 1u]);
    }
    let i = o * K + k4 * 4u;
    return bitcast<vec4<f32>>(vec4<u32>(w[i], w[i + 1u], w[i + 2u], w[i + 3u]));
}

// The head slots of the block of 256 at word `base` of w (common.wgsl's kquant_head_word).
fn kq_head(base: u32) -> array<u32, KQ_HEAD> {
    return array<u32, KQ_HEAD>(w[base + kquant_head_word(W_FORMAT, 0u)], w[base + kquant_head_word(W_FORMAT, 1u)],
        w[base + kquant_head_word(W_FORMAT, 2u)], w[base + kquant_head_word(W_FORMAT, 3u)],
        w[base + kquant_head_word(W_FORMAT, 4u)]);
}

// The data words of weights 4g .. 4g + 3 of the block of 256 at word `base` of w.
fn kq_data(base: u32, g: u32) -> vec2<u32> {
    let first = w[base + kquant_data_word(W_FORMAT, g, 0u)];
    if kquant_data_words(W_FORMAT) == 1u { return vec2<u32>(first, 0u); }
    return vec2<u32>(first, w[base + kquant_data_word(W_FORMAT, g, 1u)]);
}

// Input row bases (in vec4 units) of tokens n0 .. n0 + 3; out-of-range tokens of the last block
// re-read the last valid token and their results are dropped by `store4`.
fn row_bases(n0: u32, n_total: u32) -> vec4<u32> {
    return token_rows(n0, n_total) * (X_STRIDE / 4u);
}

// Tokens n0 .. n0 + 3, those past the last clamped to it.
fn token_rows(n0: u32, n_total: u32) -> vec4<u32> {
    return min(vec4<u32>(n0) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(max(n_total, 1u) - 1u));
}

// Tokens per thread: 4, or 1 for steps of fewer than 4 tokens (the host sizes the grid the same way).
fn tokens_per_thread(n_total: u32) -> u32 {
    return select(4u, 1u, n_total < 4u);
}

// Input features k4 of the token at row base `base`: x, or with NORM x * inv [* norm_w] (the
// operations of rmsnorm.wgsl, in its order; the subgroup path passes inv = 1 and scales the sum).
fn input4(base: u32, k4: u32, inv: f32) -> vec4<f32> {
    var v = x[base + k4];
    if NORM {
        v *= inv;
        if NORM_WEIGHT { v *= norm_w[k4]; }
    }
    return v;
}

// The tokens' dot products with weights w4(o, k4) for k4 = start, start + stride, ... (`inv`: the
// tokens' norm factors with NORM).
fn dots(o: u32, b: vec4<u32>, start: u32, stride: u32, tokens: u32, inv: vec4<f32>) -> vec4<f32> {
    if W_BLOCK32 && stride == 1u {
        return dots_blocks(o, b, tokens, inv);
    }
    if W_KQUANT && stride == 1u {
        return dots_kblocks(o, b, tokens, inv);
    }
    var acc = vec4<f32>(0.0);
    if tokens == 1u {
        for (var k4 = start; k4 < K / 4u; k4 += stride) {
            acc.x = dot_fma(input4(b.x, k4, inv.x), w4(o, k4), acc.x);
        }
        return acc;
    }
    for (var k4 = start; k4 < K / 4u; k4 += stride) {
        let wv = w4(o, k4);
        acc = vec4<f32>(dot_fma(input4(b.x, k4, inv.x), wv, acc.x), dot_fma(input4(b.y, k4, inv.y), wv, acc.y),
            dot_fma(input4(b.z, k4, inv.z), wv, acc.z), dot_fma(input4(b.w, k4, inv.w), wv, acc.w));
    }
    return acc;
}

// The tokens' sums acc plus their inputs k4 times the weights wv (the first `tokens` of them).
fn dots_at(acc: vec4<f32>, b: vec4<u32>, k4: u32, inv: vec4<f32>, wv: vec4<f32>, tokens: u32) -> vec4<f32> {
    var a = acc;
    a.x = dot_fma(input4(b.x, k4, inv.x), wv, a.x);
    if tokens == 4u {
        a.y = dot_fma(input4(b.y, k4, inv.y), wv, a.y);
        a.z = dot_fma(input4(b.z, k4, inv.z), wv, a.z);
        a.w = dot_fma(input4(b.w, k4, inv.w), wv, a.w);
    }
    return a;
}

// `dots` over all of K for blocks of 32 (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL): each block's words are read once
// (w4 reads the block's head again for every 4 weights), the weights visited in w4's k4 order,
// so the sums are the same bits. On CPU adapters, where every per-lane load is a gather, this
// halves the loads of a Q4 product.
fn dots_blocks(o: u32, b: vec4<u32>, tokens: u32, inv: vec4<f32>) -> vec4<f32> {
    var acc = vec4<f32>(0.0);
    let bw = block_words(W_FORMAT);
    for (var kb = 0u; kb < K / 32u; kb++) {
        let base = (o * (K / 32u) + kb) * bw;
        let head = w[base];
        var words: array<u32, 8>;
        for (var i = 0u; i + 1u < bw; i++) { words[i] = w[base + 1u + i]; }
        for (var g = 0u; g < 8u; g++) {
            var wv: vec4<f32>;
            if W_EXT32 {
                // words[0]: a Q5 block's fifth bits
                wv = dequant_ext(W_FORMAT, block_dm(W_FORMAT, head), words[0], words[quant_word(W_FORMAT, g) - 1u], g);
            } else {
                wv = dequant4(W_FORMAT, head, words[quant_word(W_FORMAT, g) - 1u], g);
            }
            acc = dots_at(acc, b, kb * 8u + g, inv, wv, tokens);
        }
    }
    return acc;
}

// `dots` over all of K for blocks of 256: each block's head is loaded once, then one or two words
// per 4 weights (w4 loads the head again for every 4), in w4's k4 order: the same bits.
fn dots_kblocks(o: u32, b: vec4<u32>, tokens: u32, inv: vec4<f32>) -> vec4<f32> {
    var acc = vec4<f32>(0.0);
    for (var kb = 0u; kb < K / 256u; kb++) {
        let base = (o * (K / 256u) + kb) * block_words(W_FORMAT);
        let h = kq_head(base);
        for (var g = 0u; g < 64u; g++) {
            let wv = dequant_kq(W_FORMAT, h, kq_data(base, g), g);
            acc = dots_at(acc, b, kb * 64u + g, inv, wv, tokens);
        }
    }
    return acc;
}

// dots over k4 in [k0, k0 + len) from the staged tile (token t's features at t * span), added to acc.
fn dots_staged(o: u32, k0: u32, len: u32, span: u32, tokens: u32, acc_in: vec4<f32>) -> vec4<f32> {
    var acc = acc_in;
    if tokens == 1u {
        for (var i = 0u; i < len; i++) {
            acc.x = dot_fma(staged[i], w4(o, k0 + i), acc.x);
        }
        return acc;
    }
    for (var i = 0u; i < len; i++) {
        let wv = w4(o, k0 + i);
        acc = vec4<f32>(dot_fma(staged[i], wv, acc.x), dot_fma(staged[span + i], wv, acc.y),
            dot_fma(staged[2u * span + i], wv, acc.z), dot_fma(staged[3u * span + i], wv, acc.w));
    }
    return acc;
}

// The epilogue's input: outputs o (and with a gated MLP_ACT, their up-projection partners).
fn apply_act(gate: vec4<f32>, up: vec4<f32>) -> vec4<f32> {
    if MLP_ACT == 0u { return gate; }
    return vec4<f32>(mlp_act(MLP_ACT - 1u, gate.x, up.x), mlp_act(MLP_ACT - 1u, gate.y, up.y),
        mlp_act(MLP_ACT - 1u, gate.z, up.z), mlp_act(MLP_ACT - 1u, gate.w, up.w));
}

// Write output column o of tokens n0 .. n0 + tokens - 1 (those that exist), with bias, softcap
// and residual.
fn store4(o: u32, n0: u32, n_total: u32, acc: vec4<f32>, tokens: u32) {
    for (var t = 0u; t < tokens; t++) {
        let n = n0 + t;
        if n >= n_total { break; }
        let i = n * OUT_STRIDE + OUT_OFFSET + o;
        y[i] = finish(o, i, acc[t]);
    }
}

// Output o's sum v as y[i] takes it: with bias, softcap and residual.
fn finish(o: u32, i: u32, sum: f32) -> f32 {
    var v = sum;
    if BIAS { v += bias[o]; }
    if SOFTCAP > 0.0 { v = SOFTCAP * safe_tanh(v / SOFTCAP); }
    if ACCUMULATE { v += y[i]; }
    return v;
}

// Outputs r.x .. r.w's `dots` four at once, for the formats that are not blocks of 32 (dots_rows8
// takes those): each input vec4 is loaded once for all four, each weight as it is used, into four
// named accumulators. Lavapipe loads storage buffers lane by lane (Mesa's source does), so loads
// are its cost; it keeps dynamically indexed private arrays in memory per lane, hence no arrays.
// Each output's sum runs in `dots`' order: the same bits.
fn dots_quad(r: vec4<u32>, b: vec4<u32>, tokens: u32, inv: vec4<f32>) -> array<vec4<f32>, 4> {
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    if W_KQUANT {
        // blocks of 256: the four rows' heads loaded once per block
        let bw = block_words(W_FORMAT);
        for (var kb = 0u; kb < K / 256u; kb++) {
            let base = (r * (K / 256u) + kb) * bw;
            let h0 = kq_head(base.x);
            let h1 = kq_head(base.y);
            let h2 = kq_head(base.z);
            let h3 = kq_head(base.w);
            for (var g = 0u; g < 64u; g++) {
                let k4 = kb * 64u + g;
                let w0 = dequant_kq(W_FORMAT, h0, kq_data(base.x, g), g);
                let w1 = dequant_kq(W_FORMAT, h1, kq_data(base.y, g), g);
                let w2 = dequant_kq(W_FORMAT, h2, kq_data(base.z, g), g);
                let w3 = dequant_kq(W_FORMAT, h3, kq_data(base.w, g), g);
                if tokens == 1u {
                    let x0 = input4(b.x, k4, inv.x);
                    a0.x = dot_fma(x0, w0, a0.x);
                    a1.x = dot_fma(x0, w1, a1.x);
                    a2.x = dot_fma(x0, w2, a2.x);
                    a3.x = dot_fma(x0, w3, a3.x);
                } else {
                    let xs = inputs4(b, k4, inv);
                    a0 = dots4(xs, w0, a0);
                    a1 = dots4(xs, w1, a1);
                    a2 = dots4(xs, w2, a2);
                    a3 = dots4(xs, w3, a3);
                }
            }
        }
        return array<vec4<f32>, 4>(a0, a1, a2, a3);
    }
    if tokens == 1u {
        for (var k4 = 0u; k4 < K / 4u; k4++) {
            let x0 = input4(b.x, k4, inv.x);
            a0.x = dot_fma(x0, w4_float(r.x, k4), a0.x);
            a1.x = dot_fma(x0, w4_float(r.y, k4), a1.x);
            a2.x = dot_fma(x0, w4_float(r.z, k4), a2.x);
            a3.x = dot_fma(x0, w4_float(r.w, k4), a3.x);
        }
    } else {
        for (var k4 = 0u; k4 < K / 4u; k4++) {
            let xs = inputs4(b, k4, inv);
            a0 = dots4(xs, w4_float(r.x, k4), a0);
            a1 = dots4(xs, w4_float(r.y, k4), a1);
            a2 = dots4(xs, w4_float(r.z, k4), a2);
            a3 = dots4(xs, w4_float(r.w, k4), a3);
        }
    }
    return array<vec4<f32>, 4>(a0, a1, a2, a3);
}

// The wide shape's outputs o .. o + OUTS - 1 of the block of tokens at n0 (ns: those tokens,
// block_tokens; `me`: this lane's share of a block's inputs with subgroups, see the lane hooks),
// eight weight rows at a time: eight outputs,
// or four and their up-projection partners (gated MLP_ACT). Rows past the end are clamped and
// not stored.
fn wide_outputs(o: u32, n0: u32, ns: vec4<u32>, n_total: u32, b: vec4<u32>, tokens: u32, inv: vec4<f32>, me: u32) {
    let step_outs = select(8u, 4u, GATED);
    for (var j = 0u; j < OUTS; j += step_outs) {
        let r = min(vec4<u32>(o + j) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(O_ROWS - 1u));
        var r_hi = r + O_ROWS;
        if !GATED { r_hi = min(r + 4u, vec4<u32>(O_ROWS - 1u)); }
        let acc = dots_rows8(r, r_hi, b, tokens, inv, me);
        if LORA {
            // the adapters' epilogue four outputs at a time (matmul_lora.wgsl)
            store_lora_rows(o + j, ns, min(tokens, n_total - n0), acc);
            continue;
        }
        // rows 0..3 are outputs; 4..7 their up rows (gated) or four more outputs
        for (var i = 0u; i < step_outs && o + j + i < O_ROWS; i++) {
            let up = select(vec4<f32>(0.0), acc[(4u + i) % 8u], GATED);
            store_out(o + j + i, n0, n_total, acc[i], up, tokens);
        }
    }
}

// A block of 32's words after its head: its first four words of weights (1..4; Q5: 2..5), and
// the rest: 5..8 for Q8_0, the fifth bits (word 1) for Q5, zeros for the 4-bit formats.
fn block_lo(base: u32) -> vec4<u32> {
    let at = base + select(1u, 2u, W_FORMAT == 8u || W_FORMAT == 9u);
    return vec4<u32>(w[at], w[at + 1u], w[at + 2u], w[at + 3u]);
}
fn block_hi(base: u32) -> vec4<u32> {
    if W_FORMAT == 8u || W_FORMAT == 9u { return vec4<u32>(w[base + 1u], 0u, 0u, 0u); }
    if W_FORMAT != 2u { return vec4<u32>(0u); }
    return vec4<u32>(w[base + 5u], w[base + 6u], w[base + 7u], w[base + 8u]);
}

// The word quant_word(W_FORMAT, g) of a block, from its words loaded by block_lo and block_hi.
fn block_word(lo: vec4<u32>, hi: vec4<u32>, g: u32) -> u32 {
    if W_FORMAT == 2u { return select(lo[g % 4u], hi[g % 4u], g >= 4u); }
    return lo[g % 4u];
}

// Weights 4g .. 4g + 3 of a block of 32 from its scale (and min) and the words block_lo and
// block_hi loaded: what w4 gives, the block read once.
fn block_dequant(dm: vec2<f32>, lo: vec4<u32>, hi: vec4<u32>, g: u32) -> vec4<f32> {
    if W_EXT32 { return dequant_ext(W_FORMAT, dm, hi.x, lo[g % 4u], g); }
    return dequant4_dm(W_FORMAT, dm, block_word(lo, hi, g), g);
}

// One token's dot product with a block of 32 (its scale dm and words lo, hi), added to acc in
// `dots`' order; g is a constant in each line, so each word and shift is known at compile time.
fn block_dot(acc: f32, dm: vec2<f32>, lo: vec4<u32>, hi: vec4<u32>, x0: vec4<f32>, x1: vec4<f32>, x2: vec4<f32>,
    x3: vec4<f32>, x4: vec4<f32>, x5: vec4<f32>, x6: vec4<f32>, x7: vec4<f32>) -> f32 {
    var a = dot_fma(x0, block_dequant(dm, lo, hi, 0u), acc);
    a = dot_fma(x1, block_dequant(dm, lo, hi, 1u), a);
    a = dot_fma(x2, block_dequant(dm, lo, hi, 2u), a);
    a = dot_fma(x3, block_dequant(dm, lo, hi, 3u), a);
    a = dot_fma(x4, block_dequant(dm, lo, hi, 4u), a);
    a = dot_fma(x5, block_dequant(dm, lo, hi, 5u), a);
    a = dot_fma(x6, block_dequant(dm, lo, hi, 6u), a);
    return dot_fma(x7, block_dequant(dm, lo, hi, 7u), a);
}

// The `dots` of weight rows r and r_hi (eight rows sharing each input), each weight word loaded
// once; the inputs of a block come through the lane hooks (`me`: which vec4 of a block this lane
// loads for the others, with subgroups). Formats other than blocks of 32 take `dots_quad`, four
// rows at a time.
fn dots_rows8(r: vec4<u32>, r_hi: vec4<u32>, b: vec4<u32>, tokens: u32, inv: vec4<f32>, me: u32)
    -> array<vec4<f32>, 8> {
    if !W_BLOCK32 {
        let lo = dots_quad(r, b, tokens, inv);
        let hi = dots_quad(r_hi, b, tokens, inv);
        return array<vec4<f32>, 8>(lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]);
    }
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    var a4 = vec4<f32>(0.0);
    var a5 = vec4<f32>(0.0);
    var a6 = vec4<f32>(0.0);
    var a7 = vec4<f32>(0.0);
    let bw = block_words(W_FORMAT);
    for (var kb = 0u; kb < K / 32u; kb++) {
        let base = (r * (K / 32u) + kb) * bw;
        let base_hi = (r_hi * (K / 32u) + kb) * bw;
        // the heads' scales (and mins), unpacked once per block
        let dm0 = block_dm(W_FORMAT, w[base.x]);
        let dm1 = block_dm(W_FORMAT, w[base.y]);
        let dm2 = block_dm(W_FORMAT, w[base.z]);
        let dm3 = block_dm(W_FORMAT, w[base.w]);
        let dm4 = block_dm(W_FORMAT, w[base_hi.x]);
        let dm5 = block_dm(W_FORMAT, w[base_hi.y]);
        let dm6 = block_dm(W_FORMAT, w[base_hi.z]);
        let dm7 = block_dm(W_FORMAT, w[base_hi.w]);
        let lo0 = block_lo(base.x);
        let lo1 = block_lo(base.y);
        let lo2 = block_lo(base.z);
        let lo3 = block_lo(base.w);
        let lo4 = block_lo(base_hi.x);
        let lo5 = block_lo(base_hi.y);
        let lo6 = block_lo(base_hi.z);
        let lo7 = block_lo(base_hi.w);
        let hi0 = block_hi(base.x);
        let hi1 = block_hi(base.y);
        let hi2 = block_hi(base.z);
        let hi3 = block_hi(base.w);
        let hi4 = block_hi(base_hi.x);
        let hi5 = block_hi(base_hi.y);
        let hi6 = block_hi(base_hi.z);
        let hi7 = block_hi(base_hi.w);
        if tokens == 1u {
            let mine = lane_input(b.x, kb, me, inv.x);
            let x0 = block_input(mine, b.x, kb, 0u, inv.x);
            let x1 = block_input(mine, b.x, kb, 1u, inv.x);
            let x2 = block_input(mine, b.x, kb, 2u, inv.x);
            let x3 = block_input(mine, b.x, kb, 3u, inv.x);
            let x4 = block_input(mine, b.x, kb, 4u, inv.x);
            let x5 = block_input(mine, b.x, kb, 5u, inv.x);
            let x6 = block_input(mine, b.x, kb, 6u, inv.x);
            let x7 = block_input(mine, b.x, kb, 7u, inv.x);
            a0.x = block_dot(a0.x, dm0, lo0, hi0, x0, x1, x2, x3, x4, x5, x6, x7);
            a1.x = block_dot(a1.x, dm1, lo1, hi1, x0, x1, x2, x3, x4, x5, x6, x7);
            a2.x = block_dot(a2.x, dm2, lo2, hi2, x0, x1, x2, x3, x4, x5, x6, x7);
            a3.x = block_dot(a3.x, dm3, lo3, hi3, x0, x1, x2, x3, x4, x5, x6, x7);
            a4.x = block_dot(a4.x, dm4, lo4, hi4, x0, x1, x2, x3, x4, x5, x6, x7);
            a5.x = block_dot(a5.x, dm5, lo5, hi5, x0, x1, x2, x3, x4, x5, x6, x7);
            a6.x = block_dot(a6.x, dm6, lo6, hi6, x0, x1, x2, x3, x4, x5, x6, x7);
            a7.x = block_dot(a7.x, dm7, lo7, hi7, x0, x1, x2, x3, x4, x5, x6, x7);
        } else {
            let mine = lane_inputs(b, kb, me, inv);
            for (var g = 0u; g < 8u; g++) {
                let xs = block_inputs(mine, b, kb, g, inv);
                a0 = dots4(xs, block_dequant(dm0, lo0, hi0, g), a0);
                a1 = dots4(xs, block_dequant(dm1, lo1, hi1, g), a1);
                a2 = dots4(xs, block_dequant(dm2, lo2, hi2, g), a2);
                a3 = dots4(xs, block_dequant(dm3, lo3, hi3, g), a3);
                a4 = dots4(xs, block_dequant(dm4, lo4, hi4, g), a4);
                a5 = dots4(xs, block_dequant(dm5, lo5, hi5, g), a5);
                a6 = dots4(xs, block_dequant(dm6, lo6, hi6, g), a6);
                a7 = dots4(xs, block_dequant(dm7, lo7, hi7, g), a7);
            }
        }
    }
    return array<vec4<f32>, 8>(a0, a1, a2, a3, a4, a5, a6, a7);
}

// One weight vec4 against 4 tokens' inputs (the columns of xs), added to their sums.
fn dots4(xs: mat4x4<f32>, wv: vec4<f32>, acc: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(dot_fma(xs[0], wv, acc.x), dot_fma(xs[1], wv, acc.y), dot_fma(xs[2], wv, acc.z),
        dot_fma(xs[3], wv, acc.w));
}

// One output per thread (OUTS = 1; with NORM the host takes `main_normed`). The wide shape is an
// entry point of its own, `main_wide`: a driver that inlines every call before it folds the
// format's branches (Mesa's) then compiles neither shape's code into the other's pipelines.
@compute @workgroup_size(WG)
fn main(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    let o = gid.x;
    let n_total = select(step.tokens, step.rows, PER_ROW);
    let tokens = tokens_per_thread(n_total);
    let n0 = wid.y * tokens;
    if o >= O_ROWS || n0 >= n_total { return; }
    let b = row_bases(n0, n_total);
    let acc = dots(o, b, 0u, 1u, tokens, vec4<f32>(1.0));
    var up = vec4<f32>(0.0);
    if GATED { up = dots(O_ROWS + o, b, 0u, 1u, tokens, vec4<f32>(1.0)); }
    store_out(o, n0, n_total, acc, up, tokens);
}

// The wide shape (OUTS > 1). With NORM every lane first helps with the workgroup's norm sums, then
// reads x * inv [* norm_w] straight from x: the values rmsnorm.wgsl would have written, each
// computed once per 8 weight rows, without staging. Every lane runs on past the last output too
// (with subgroups, in main_wide_subgroup, it shares its inputs).
@compute @workgroup_size(WG)
fn main_wide(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lane: u32,
) {
    let o = gid.x * OUTS;
    let n_total = select(step.tokens, step.rows, PER_ROW);
    let tokens = tokens_per_thread(n_total);
    let n0 = wid.y * tokens;
    let ns = block_tokens(n0, n_total);
    let b = ns * (X_STRIDE / 4u);
    var inv = vec4<f32>(1.0);
    if NORM { inv = inv_rms(b, lane); }  // all lanes: barriers
    if n0 >= n_total { return; }  // the whole workgroup
    wide_outputs(o, n0, ns, n_total, b, tokens, inv, 0u);
}

// The NORM variant of `main` for one output per thread (a separate entry point: only it holds
// the 16 KiB tile).
@compute @workgroup_size(WG)
fn main_normed(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lane: u32,
) {
    let o = gid.x;
    let n_total = select(step.tokens, step.rows, PER_ROW);
    let tokens = tokens_per_thread(n_total);
    let n0 = wid.y * tokens;
    let b = row_bases(n0, n_total);
    let live = o < O_ROWS && n0 < n_total;
    // every lane takes part in the sums and the staging (barriers), live or not
    let inv = inv_rms(b, lane);
    let span = STAGE / tokens;  // k4 per token per tile
    var acc = vec4<f32>(0.0);
    var up = vec4<f32>(0.0);
    for (var k0 = 0u; k0 < K / 4u; k0 += span) {
        let len = min(span, K / 4u - k0);
        for (var i = lane; i < len * tokens; i += WG) {
            let t = i / len;
            staged[t * span + i % len] = input4(b[t], k0 + i % len, inv[t]);
        }
        workgroupBarrier();
        if live {
            acc = dots_staged(o, k0, len, span, tokens, acc);
            if GATED { up = dots_staged(O_ROWS + o, k0, len, span, tokens, up); }
        }
        workgroupBarrier();
    }
    if live { store_out(o, n0, n_total, acc, up, tokens); }
}
