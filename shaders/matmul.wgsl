// y[n, OUT_OFFSET + o] = sum_k x[n, k] * w[o, k] for one row-part of a weight matrix (PyTorch layout
// [out, in]). One thread per output column and 4 tokens: each weight vec4 is read once per 4 tokens
// (register blocking; workgroup memory was slower on lavapipe). Steps of fewer than 4 tokens (a
// decode step of 1-3 rows) take one token per thread instead (mat-vec: no lane computes dot
// products it throws away); a token's sum runs over k in the same order of fused steps either way
// (dot_fma), so both give the same bits.

override K: u32;                   // input features (multiple of 4)
override X_STRIDE: u32;            // floats per row of x (K, or more when x holds other columns after)
override O_ROWS: u32;              // output rows of this part
override OUT_STRIDE: u32;          // row stride of y
override OUT_OFFSET: u32 = 0u;     // first column of y written by this part
override W_FORMAT: u32 = 0u;       // 0 f32, 1 f16 pairs, 5 bf16 pairs, 2 Q8_0, 3 Q4_0, 4 Q4_1, 6 Q4_K, 7 Q6_K (common.wgsl)
override ACCUMULATE: bool = false; // y += x W^T (the residual add, fused)
override SOFTCAP: f32 = 0.0;       // > 0: y = SOFTCAP * tanh(y / SOFTCAP) (final logits)
override PER_ROW: bool = false;    // inputs are the R chunk rows (LM head), not the R * C tokens
override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;   // [N, X_STRIDE], the first K read
@group(0) @binding(2) var<storage, read> w: array<u32>;         // [O_ROWS, K] in W_FORMAT
@group(0) @binding(3) var<storage, read_write> y: array<f32>;   // [N, OUT_STRIDE]

fn w4(o: u32, k4: u32) -> vec4<f32> {
    if W_FORMAT >= 6u {
        let at = quant_at(W_FORMAT, o, k4, K);
        var words: array<u32, 5>;
        for (var i = 0u; i < kquant_words(W_FORMAT); i++) { words[i] = w[at.x + kquant_word(W_FORMAT, at.y, i)]; }
        return dequant_k4(W_FORMAT, words, at.y);
    }
    if W_FORMAT >= 2u && W_FORMAT <= 4u {
        let at = quant_at(W_FORMAT, o, k4, K);
        return dequant4(W_FORMAT, w[at.x], w[at.x + quant_word(W_FORMAT, at.y)], at.y);
    }
    if W_FORMAT == 1u || W_FORMAT == 5u {
        let i = (o * K) / 2u + k4 * 2u;
        return half4(W_FORMAT, w[i], w[i + 1u]);
    }
    let i = o * K + k4 * 4u;
    return bitcast<vec4<f32>>(vec4<u32>(w[i], w[i + 1u], w[i + 2u], w[i + 3u]));
}

// Input row bases (in vec4 units) of tokens n0 .. n0 + 3; out-of-range tokens of the last block
// re-read the last valid token and their results are dropped by `store4`.
fn row_bases(n0: u32, n_total: u32) -> vec4<u32> {
    let last = n_total - 1u;
    return vec4<u32>(n0, min(n0 + 1u, last), min(n0 + 2u, last), min(n0 + 3u, last)) * (X_STRIDE / 4u);
}

// Tokens per thread: 4, or 1 for steps of fewer than 4 tokens (the host sizes the grid the same way).
fn tokens_per_thread(n_total: u32) -> u32 {
    return select(4u, 1u, n_total < 4u);
}

// The tokens' dot products with weights w4(o, k4) for k4 = start, start + stride, ...
fn dots(o: u32, b: vec4<u32>, start: u32, stride: u32, tokens: u32) -> vec4<f32> {
    var acc = vec4<f32>(0.0);
    if tokens == 1u {
        for (var k4 = start; k4 < K / 4u; k4 += stride) {
            acc.x = dot_fma(x[b.x + k4], w4(o, k4), acc.x);
        }
        return acc;
    }
    for (var k4 = start; k4 < K / 4u; k4 += stride) {
        let wv = w4(o, k4);
        acc = vec4<f32>(dot_fma(x[b.x + k4], wv, acc.x), dot_fma(x[b.y + k4], wv, acc.y), dot_fma(x[b.z + k4], wv, acc.z),
            dot_fma(x[b.w + k4], wv, acc.w));
    }
    return acc;
}

// Write output column o of tokens n0 .. n0 + tokens - 1 (those that exist), with softcap and
// residual.
fn store4(o: u32, n0: u32, n_total: u32, acc: vec4<f32>, tokens: u32) {
    for (var t = 0u; t < tokens; t++) {
        let n = n0 + t;
        if n >= n_total { break; }
        let i = n * OUT_STRIDE + OUT_OFFSET + o;
        var v = acc[t];
        if SOFTCAP > 0.0 { v = SOFTCAP * safe_tanh(v / SOFTCAP); }
        if ACCUMULATE { v += y[i]; }
        y[i] = v;
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let o = gid.x;
    let n_total = select(step.tokens, step.rows, PER_ROW);
    let tokens = tokens_per_thread(n_total);
    let n0 = gid.y * tokens;
    if o >= O_ROWS || n0 >= n_total { return; }
    store4(o, n0, n_total, dots(o, row_bases(n0, n_total), 0u, 1u, tokens), tokens);
}
