// y[n, OUT_OFFSET + o] = sum_k x[n, k] * w[o, k] for one row-part of a weight matrix (PyTorch layout
// [out, in]). One thread per output column and 4 tokens: each weight vec4 is read once per 4 tokens
// (register blocking; workgroup memory was slower on lavapipe, see DESIGN.md section 5).

override K: u32;                   // input features (multiple of 4)
override O_ROWS: u32;              // output rows of this part
override OUT_STRIDE: u32;          // row stride of y
override OUT_OFFSET: u32 = 0u;     // first column of y written by this part
override W_FORMAT: u32 = 0u;       // 0 f32, 1 f16 pairs, 5 bf16 pairs, 2 Q8_0, 3 Q4_0, 4 Q4_1 (see common.wgsl)
override ACCUMULATE: bool = false; // y += x W^T (the residual add, fused)
override SOFTCAP: f32 = 0.0;       // > 0: y = SOFTCAP * tanh(y / SOFTCAP) (final logits)
override PER_ROW: bool = false;    // inputs are the R chunk rows (LM head), not the R * C tokens
override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;   // [N, K]
@group(0) @binding(2) var<storage, read> w: array<u32>;         // [O_ROWS, K] in W_FORMAT
@group(0) @binding(3) var<storage, read_write> y: array<f32>;   // [N, OUT_STRIDE]

fn w4(o: u32, k4: u32) -> vec4<f32> {
    if W_FORMAT >= 2u && W_FORMAT <= 4u {
        let base = (o * (K / 32u) + k4 / 8u) * block_words(W_FORMAT);
        let g = k4 % 8u;
        return dequant4(W_FORMAT, w[base], w[base + quant_word(W_FORMAT, g)], g);
    }
    if W_FORMAT == 1u || W_FORMAT == 5u {
        let i = (o * K) / 2u + k4 * 2u;
        return half4(W_FORMAT, w[i], w[i + 1u]);
    }
    let i = o * K + k4 * 4u;
    return bitcast<vec4<f32>>(vec4<u32>(w[i], w[i + 1u], w[i + 2u], w[i + 3u]));
}

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let o = gid.x;
    let n_total = select(step.tokens, step.rows, PER_ROW);
    let n0 = gid.y * 4u;
    if o >= O_ROWS || n0 >= n_total { return; }
    let k4n = K / 4u;
    // Out-of-range tokens of the last block re-read the last valid token; their results are dropped.
    let last = n_total - 1u;
    let b0 = n0 * k4n;
    let b1 = min(n0 + 1u, last) * k4n;
    let b2 = min(n0 + 2u, last) * k4n;
    let b3 = min(n0 + 3u, last) * k4n;
    var acc = vec4<f32>(0.0);
    for (var k4 = 0u; k4 < k4n; k4++) {
        let wv = w4(o, k4);
        acc += vec4<f32>(dot(x[b0 + k4], wv), dot(x[b1 + k4], wv), dot(x[b2 + k4], wv), dot(x[b3 + k4], wv));
    }
    for (var t = 0u; t < 4u; t++) {
        let n = n0 + t;
        if n >= n_total { break; }
        let i = n * OUT_STRIDE + OUT_OFFSET + o;
        var v = acc[t];
        if SOFTCAP > 0.0 { v = SOFTCAP * safe_tanh(v / SOFTCAP); }
        if ACCUMULATE { v += y[i]; }
        y[i] = v;
    }
}
