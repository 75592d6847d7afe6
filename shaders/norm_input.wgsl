// A product's input read as RMS-norm(x) where the block's norm is fused into its consumers (the
// dense products, matmul.wgsl, and the adapters' `A x`, lora.wgsl): the values rmsnorm.wgsl would
// have written, bit for bit. Appended to each; the module declares x and norm_w (vec4 arrays), K,
// EPS, NORM, NORM_WEIGHT and NORM_LANES (64: rmsnorm.wgsl's lanes and tree).

// NORM: 1 / rms of the four tokens at row bases b, summed as rmsnorm.wgsl does (lane i takes
// elements i, i + 64, ...; then a fixed tree). Every invocation of a workgroup of NORM_LANES calls it.
fn inv_rms(b: vec4<u32>, lane: u32) -> vec4<f32> {
    var ss = vec4<f32>(0.0);
    for (var d = lane; d < K; d += NORM_LANES) {
        let v = vec4<f32>(x[b.x + d / 4u][d % 4u], x[b.y + d / 4u][d % 4u], x[b.z + d / 4u][d % 4u],
            x[b.w + d / 4u][d % 4u]);
        ss = fma(v, v, ss);  // explicit fma: see dot_fma in common.wgsl
    }
    return inverseSqrt(tree_sum(ss, lane, NORM_LANES) / f32(K) + EPS);
}

// Input features k4 of the 4 tokens at row bases b (the columns): x, or with NORM
// x * inv [* norm_w] in rmsnorm.wgsl's order, norm_w loaded once for all four.
fn inputs4(b: vec4<u32>, k4: u32, inv: vec4<f32>) -> mat4x4<f32> {
    let v = mat4x4<f32>(x[b.x + k4], x[b.y + k4], x[b.z + k4], x[b.w + k4]);
    if !NORM { return v; }
    if !NORM_WEIGHT { return mat4x4<f32>(v[0] * inv.x, v[1] * inv.y, v[2] * inv.z, v[3] * inv.w); }
    let nw = norm_w[k4];
    return mat4x4<f32>(v[0] * inv.x * nw, v[1] * inv.y * nw, v[2] * inv.z * nw, v[3] * inv.w * nw);
}
