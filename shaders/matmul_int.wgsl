// Integer-dot variant of matmul.wgsl (appended to it; `KVDECODE_MATMUL=int-dot`): Q8_0, Q4_0,
// Q4_1, Q5_0, Q5_1 and IQ4_NL weights stay integers and meet the activations quantized per block
// of 32 (quantize.wgsl) in `dot4I8Packed`, four byte products a step, as llama.cpp's Vulkan and
// WebGPU backends do. A block contributes d_w d_x sum(w_q x_q) (Q4_0 / Q5_0: minus 8 / 16 d_w d_x
// sum(x_q); Q4_1 / Q5_1: plus m_w d_x sum(x_q); IQ4_NL's w_q are its table's values), with
// integer sums exact. Threads as `main`: one per OUTS outputs and 4 tokens (one below 4 tokens),
// each (output, token) summed alone by `int_dot_row`, blocks in order: a row's result never
// depends on the batch, nor on OUTS.
// Rounding the activations costs llama.cpp-like accuracy, hence opt-in.

@group(0) @binding(8) var<storage, read> xq: array<u32>;  // [N, K / 32, Q8_BLOCK_WORDS] (quantize.wgsl)

// acc plus one block's contribution, from the integer sum s of its products (weights as int8,
// Q4/Q5 quants as 0..15 / 0..31, IQ4_NL's as its table's values), the weights' (scale, min) dm,
// the token's scale dx and d_x sum(x_q) sx.
fn block_sum(s: i32, dm: vec2<f32>, dx: f32, sx: f32, acc: f32) -> f32 {
    if W_FORMAT == 2u || W_FORMAT == 10u {
        return fma(dm.x * dx, f32(s), acc);
    }
    if W_FORMAT == 3u || W_FORMAT == 8u {
        return fma(dm.x, fma(dx, f32(s), select(-8.0, -16.0, W_FORMAT == 8u) * sx), acc);
    }
    return fma(dm.x * dx, f32(s), fma(dm.y, sx, acc));
}

// Bits 0..3 of h moved to bit 4 of bytes 0..3: a Q5 block's fifth bits of four weights, beside
// their nibbles.
fn fifth_bits(h: u32) -> u32 {
    return ((h & 1u) << 4u) | ((h & 2u) << 11u) | ((h & 4u) << 18u) | ((h & 8u) << 25u);
}

// Four IQ4_NL nibbles (one per byte) replaced by their table values, as int8 bytes.
fn iq4nl_bytes(nib: u32) -> u32 {
    let n = (vec4<u32>(nib) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(15u);
    let b = (vec4<u32>(bitcast<vec4<i32>>(iq4nl_values_i(n))) & vec4<u32>(0xffu)) << vec4<u32>(0u, 8u, 16u, 24u);
    return b.x | b.y | b.z | b.w;
}

// Word i of a block of 32's quantized weights as int8 bytes: weights 4i .. 4i + 3 for i < 4,
// 16 + 4(i - 4) .. for i >= 4 (nibble formats), or word i of Q8_0's 8.
fn int_word(base: u32, i: u32) -> u32 {
    if W_FORMAT == 2u { return w[base + 1u + i]; }
    let five = W_FORMAT == 8u || W_FORMAT == 9u;
    let nib = (w[base + select(1u, 2u, five) + i % 4u] >> select(0u, 4u, i >= 4u)) & 0x0f0f0f0fu;
    if W_FORMAT == 10u { return iq4nl_bytes(nib); }
    if five { return nib | fifth_bits(w[base + 1u] >> (4u * i)); }
    return nib;
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
        // the activations' word i holds features 4i .. 4i + 3 of the block
        for (var i = 0u; i < 8u; i++) { s += dot4I8Packed(int_word(base, i), xq[xo + 2u + i]); }
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
            if GATED { up[t] = int_dot_row(O_ROWS + o + j, xb[t]); }
        }
        store_out(o + j, n0, n_total, acc, up, tokens);
    }
}
