// Integer-dot variant of matmul.wgsl (appended to it; `KVDECODE_MATMUL=int-dot`): Q8_0, Q4_0 and
// Q4_1 weights stay integers and meet the activations quantized per block of 32 (quantize.wgsl)
// in `dot4I8Packed`, four byte products a step, as llama.cpp's Vulkan and WebGPU backends do. A
// block contributes d_w d_x sum(w_q x_q) (Q4_0: minus 8 d_w d_x sum(x_q); Q4_1: plus m_w d_x
// sum(x_q)), with integer sums exact. Threads as `main`: one per OUTS outputs and 4 tokens (one
// below 4 tokens), blocks in order, each token's sum alone: a row's result never depends on the
// batch, nor on OUTS.
// Rounding the activations costs llama.cpp-like accuracy, hence opt-in.

@group(0) @binding(5) var<storage, read> xq: array<u32>;  // [N, K / 32, Q8_BLOCK_WORDS] (quantize.wgsl)

// acc plus one block's contribution: weights wq (8 words of 4 int8 in the activations' order,
// Q4 nibbles as 0..15), their scale and min dm, and a token's quantized block xw.
fn block_dot(wq: array<u32, 8>, dm: vec2<f32>, xw: array<u32, Q8_BLOCK_WORDS>, acc: f32) -> f32 {
    var s = 0i;
    for (var i = 0u; i < 8u; i++) {
        s += dot4I8Packed(wq[i], xw[2u + i]);
    }
    let dx = bitcast<f32>(xw[0]);
    if W_FORMAT == 2u {
        return fma(dm.x * dx, f32(s), acc);
    }
    let sx = bitcast<f32>(xw[1]);  // d_x sum(x_q)
    if W_FORMAT == 3u {
        return fma(dm.x, fma(dx, f32(s), -8.0 * sx), acc);
    }
    return fma(dm.x * dx, f32(s), fma(dm.y, sx, acc));
}

// Block kb of weight row `row`: its 8 words of int8 (Q4: nibbles as bytes) and (scale, min).
fn int_weights(row: u32, kb: u32, wq: ptr<function, array<u32, 8>>) -> vec2<f32> {
    let base = (row * (K / 32u) + kb) * block_words(W_FORMAT);
    if W_FORMAT == 2u {
        for (var i = 0u; i < 8u; i++) { (*wq)[i] = w[base + 1u + i]; }
    } else {
        // word i: weights 4i.. in the low nibbles, 16 + 4i.. in the high ones (common.wgsl)
        for (var i = 0u; i < 4u; i++) {
            let nib = w[base + 1u + i];
            (*wq)[i] = nib & 0x0f0f0f0fu;
            (*wq)[4u + i] = (nib >> 4u) & 0x0f0f0f0fu;
        }
    }
    return unpack2x16float(w[base]);
}

// Token block kb of the quantized input whose row starts at word xb.
fn int_input(xb: u32, kb: u32) -> array<u32, Q8_BLOCK_WORDS> {
    var xw: array<u32, Q8_BLOCK_WORDS>;
    for (var i = 0u; i < Q8_BLOCK_WORDS; i++) { xw[i] = xq[xb + kb * Q8_BLOCK_WORDS + i]; }
    return xw;
}

// The tokens' (tokens: 1 or 4; xb: their quantized rows' first words) dot products with OUTS weight
// rows row0 + min(o0 + j, O_ROWS - 1), blocks in order; each token's block is loaded once for all
// OUTS rows (the `wide` shape on CPU adapters, as in matmul.wgsl's dots_outs).
fn int_dots(row0: u32, o0: u32, xb: vec4<u32>, tokens: u32) -> array<vec4<f32>, MAX_OUTS> {
    var acc = array<vec4<f32>, MAX_OUTS>();
    var wq: array<u32, 8>;
    for (var kb = 0u; kb < K / 32u; kb++) {
        let x0 = int_input(xb.x, kb);
        if tokens == 1u {
            for (var j = 0u; j < OUTS; j++) {
                let dm = int_weights(row0 + min(o0 + j, O_ROWS - 1u), kb, &wq);
                acc[j].x = block_dot(wq, dm, x0, acc[j].x);
            }
            continue;
        }
        let x1 = int_input(xb.y, kb);
        let x2 = int_input(xb.z, kb);
        let x3 = int_input(xb.w, kb);
        for (var j = 0u; j < OUTS; j++) {
            let dm = int_weights(row0 + min(o0 + j, O_ROWS - 1u), kb, &wq);
            acc[j] = vec4<f32>(block_dot(wq, dm, x0, acc[j].x), block_dot(wq, dm, x1, acc[j].y),
                block_dot(wq, dm, x2, acc[j].z), block_dot(wq, dm, x3, acc[j].w));
        }
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
    let acc = int_dots(0u, o, xb, tokens);
    var up = array<vec4<f32>, MAX_OUTS>();
    if gated() { up = int_dots(O_ROWS, o, xb, tokens); }
    for (var j = 0u; j < OUTS && o + j < O_ROWS; j++) {
        store4(o + j, n0, n_total, apply_act(acc[j], up[j]), tokens);
    }
}
