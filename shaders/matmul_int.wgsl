// Integer-dot variant of matmul.wgsl (appended to it; `KVDECODE_MATMUL=int-dot`): Q8_0, Q4_0 and
// Q4_1 weights stay integers and meet the activations quantized per block of 32 (quantize.wgsl)
// in `dot4I8Packed`, four byte products a step, as llama.cpp's Vulkan and WebGPU backends do. A
// block contributes d_w d_x sum(w_q x_q) (Q4_0: minus 8 d_w d_x sum(x_q); Q4_1: plus m_w d_x
// sum(x_q)), with integer sums exact. Threads as `main`: one per OUTS outputs and 4 tokens (one
// below 4 tokens), each (output, token) summed alone by `int_dot_row`, blocks in order: a row's
// result never depends on the batch, nor on OUTS.
// Rounding the activations costs llama.cpp-like accuracy, hence opt-in.

@group(0) @binding(6) var<storage, read> xq: array<u32>;  // [N, K / 32, Q8_BLOCK_WORDS] (quantize.wgsl)

// acc plus one block's contribution, from the integer sum s of its products (weights as int8, Q4
// nibbles as 0..15), the weights' (scale, min) dm, the token's scale dx and d_x sum(x_q) sx.
fn block_sum(s: i32, dm: vec2<f32>, dx: f32, sx: f32, acc: f32) -> f32 {
    if W_FORMAT == 2u {
        return fma(dm.x * dx, f32(s), acc);
    }
    if W_FORMAT == 3u {
        return fma(dm.x, fma(dx, f32(s), -8.0 * sx), acc);
    }
    return fma(dm.x * dx, f32(s), fma(dm.y, sx, acc));
}

// One token's (quantized row at word xb) dot product with weight row `row`, blocks in order, words
// loaded as they are used: no private arrays (lavapipe keeps those in memory per lane; see
// dots_quad in matmul.wgsl). Every token of every step goes through this one function, so a
// row's bits cannot depend on how many tokens a thread takes: a first version with a separate
// 4-token loop gave results 2e-6 apart from the mat-vec one (Q8_0), which tests/int_dot.rs caught;
// the float math of the two copies was written alike, so the compiler must have treated them
// differently.
fn int_dot_row(row: u32, xb: u32) -> f32 {
    var acc = 0.0;
    for (var kb = 0u; kb < K / 32u; kb++) {
        let base = (row * (K / 32u) + kb) * block_words(W_FORMAT);
        let xo = xb + kb * Q8_BLOCK_WORDS;
        var s = 0i;
        if W_FORMAT == 2u {
            for (var i = 0u; i < 8u; i++) { s += dot4I8Packed(w[base + 1u + i], xq[xo + 2u + i]); }
        } else {
            // word i: weights 4i.. in the low nibbles, 16 + 4i.. in the high ones (common.wgsl)
            for (var i = 0u; i < 4u; i++) {
                let nib = w[base + 1u + i];
                s += dot4I8Packed(nib & 0x0f0f0f0fu, xq[xo + 2u + i]);
                s += dot4I8Packed((nib >> 4u) & 0x0f0f0f0fu, xq[xo + 6u + i]);
            }
        }
        acc = block_sum(s, unpack2x16float(w[base]), bitcast<f32>(xq[xo]), bitcast<f32>(xq[xo + 1u]), acc);
    }
    return acc;
}

@compute @workgroup_size(WG)
fn main_int(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let o = gid.x * OUTS;
    let n_total = select(step.tokens, step.rows, PER_ROW);
    let tokens = tokens_per_thread(n_total);
    let n0 = wid.y * tokens;
    if o >= O_ROWS || n0 >= n_total { return; }
    // tokens past the last re-read it (as row_bases does); store4 drops their results
    let xb = token_rows(n0, n_total) * (K / 32u * Q8_BLOCK_WORDS);
    for (var j = 0u; j < OUTS && o + j < O_ROWS; j++) {
        var acc = vec4<f32>(0.0);
        var up = vec4<f32>(0.0);
        for (var t = 0u; t < tokens; t++) {
            acc[t] = int_dot_row(o + j, xb[t]);
            if gated() { up[t] = int_dot_row(O_ROWS + o + j, xb[t]); }
        }
        store4(o + j, n0, n_total, apply_act(acc, up), tokens);
    }
}
