// Fast path of matmul.wgsl (appended to it) for adapters with subgroups: one subgroup per output
// column and 4 tokens (1 in steps of fewer than 4); the lanes split the input features, so neighbouring lanes read neighbouring
// weights, and `subgroupAdd` sums their partial dot products. NORM reads the norm's input on the
// fly (a workgroup is one output: staging would cost as much as the product).
// Used only when the device has the `subgroups` feature and a fixed subgroup size SG; the portable
// `main` above is the reference (KVDECODE_PORTABLE=1 forces it).

override SG: u32 = 32u;  // the adapter's (fixed) subgroup size = workgroup size

@compute @workgroup_size(SG)
fn main_subgroup(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let o = wid.x + wid.y * nwg.x;
    let n_total = select(step.tokens, step.rows, PER_ROW);
    let tokens = tokens_per_thread(n_total);
    let n0 = wid.z * tokens;
    if o >= O_ROWS || n0 >= n_total { return; }  // uniform across the workgroup
    let b = row_bases(n0, n_total);
    // NORM: y = inv * sum_k w_k (x_k g_k), inv = 1 / rms of the token (the lanes' sums of squares,
    // then subgroupAdd; one order per adapter). Factoring inv out of the sum leaves one multiply
    // per input on the fly; this path's sums are not the portable ones anyway.
    var inv = vec4<f32>(1.0);
    if NORM {
        var ss = vec4<f32>(0.0);
        for (var k4 = lane; k4 < K / 4u; k4 += SG) {
            let v = mat4x4<f32>(x[b.x + k4], x[b.y + k4], x[b.z + k4], x[b.w + k4]);
            ss = vec4<f32>(dot_fma(v[0], v[0], ss.x), dot_fma(v[1], v[1], ss.y), dot_fma(v[2], v[2], ss.z),
                dot_fma(v[3], v[3], ss.w));
        }
        inv = inverseSqrt(subgroupAdd(ss) / f32(K) + EPS);
    }
    let acc = subgroupAdd(dots(o, b, lane, SG, tokens, vec4<f32>(1.0))) * inv;
    var up = vec4<f32>(0.0);
    if GATED { up = subgroupAdd(dots(O_ROWS + o, b, lane, SG, tokens, vec4<f32>(1.0))) * inv; }
    if lane == 0u {
        store_out(o, n0, n_total, acc, up, tokens);
    }
}

// The `wide` shape of `main` (OUTS outputs per thread, eight weight rows at a time) with the
// inputs shared through the subgroup, for Q8_0 / Q4_0 / Q4_1 weights (other formats take
// `dots_quad`): lane l loads vec4 l % 8 of each block of 32 inputs, and every lane takes vec4 g of
// the block from lane g (subgroupShuffle, the lane hooks below). On lavapipe each lane's storage
// load is a loop over the SIMD lanes while a 32-bit shuffle among 8 lanes is one vector permute,
// so the inputs cost an eighth of the loads (SmolLM2 Q4_1 on an AMD EPYC: 50 ms of products a
// decode step against plain `wide`'s 56, prefill 81-83 tok/s against 64). The same values in the
// same order as `dots`: the portable bits. Every lane runs to the end: the shuffles read other
// lanes' registers, so a thread past the last output still loads and passes on its share.
// Needs subgroups of at least 8 lanes (wide-subgroup in variants.rs). With WG = 8 (CPU adapters:
// a workgroup is one subgroup of exactly 8) a fused norm sums through shuffles (inv_rms_lanes8),
// without barriers.
@compute @workgroup_size(WG)
fn main_wide_subgroup(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lane: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
) {
    let o = gid.x * OUTS;
    let n_total = select(step.tokens, step.rows, PER_ROW);
    let tokens = tokens_per_thread(n_total);
    let n0 = wid.y * tokens;
    let ns = block_tokens(n0, n_total);
    let b = ns * (X_STRIDE / 4u);
    var inv = vec4<f32>(1.0);
    if NORM && WG == 8u {
        inv = inv_rms_lanes8(b, tokens, sg_lane);
    } else if NORM {
        inv = inv_rms(b, lane);  // all lanes: barriers
    }
    if n0 >= n_total { return; }  // the whole workgroup
    wide_outputs(o, n0, ns, n_total, b, tokens, inv, sg_lane % 8u);
}

// inv_rms for a workgroup of one 8-lane subgroup: lane p plays rmsnorm.wgsl's lanes p, p + 8, ...,
// p + 56 (NORM_LANES = 64), each summing its elements in their order; the tree's strides 32, 16
// and 8 add lanes that live in one thread, strides 4, 2 and 1 take the partner's sum by shuffle.
// Every addition is the tree's own (own sum + partner's): the bits of rmsnorm.wgsl.
fn inv_rms_lanes8(b: vec4<u32>, tokens: u32, p: u32) -> vec4<f32> {
    var s0 = lane_squares(b, tokens, p);
    var s1 = lane_squares(b, tokens, p + 8u);
    var s2 = lane_squares(b, tokens, p + 16u);
    var s3 = lane_squares(b, tokens, p + 24u);
    s0 += lane_squares(b, tokens, p + 32u);
    s1 += lane_squares(b, tokens, p + 40u);
    s2 += lane_squares(b, tokens, p + 48u);
    s3 += lane_squares(b, tokens, p + 56u);
    s0 += s2;
    s1 += s3;
    s0 += s1;
    // lanes p >= stride compute sums nobody reads (the `& 7u` keeps their partner in range)
    s0 += shuffle4(s0, (p + 4u) & 7u);
    s0 += shuffle4(s0, (p + 2u) & 7u);
    s0 += shuffle4(s0, (p + 1u) & 7u);
    return inverseSqrt(shuffle4(s0, 0u) / f32(K) + EPS);
}

// Lane `v` of NORM_LANES's sum of squares of the tokens at row bases b: elements v, v + 64, ...
// (one token: only .x, the others are never read)
fn lane_squares(b: vec4<u32>, tokens: u32, v: u32) -> vec4<f32> {
    var ss = vec4<f32>(0.0);
    if tokens == 1u {
        for (var d = v; d < K; d += NORM_LANES) {
            let e = x[b.x + d / 4u][d % 4u];
            ss.x = fma(e, e, ss.x);
        }
        return ss;
    }
    for (var d = v; d < K; d += NORM_LANES) {
        let e = vec4<f32>(x[b.x + d / 4u][d % 4u], x[b.y + d / 4u][d % 4u], x[b.z + d / 4u][d % 4u],
            x[b.w + d / 4u][d % 4u]);
        ss = fma(e, e, ss);  // explicit fma: see dot_fma in common.wgsl
    }
    return ss;
}

// Lane `src`'s vec4 (every lane asks for the same lane): subgroupShuffle of each component
// (lavapipe shuffles scalars; each is one vector permute).
fn shuffle4(v: vec4<f32>, src: u32) -> vec4<f32> {
    return vec4<f32>(subgroupShuffle(v.x, src), subgroupShuffle(v.y, src), subgroupShuffle(v.z, src),
        subgroupShuffle(v.w, src));
}

// The lane hooks of dots_rows8 (matmul.wgsl) with subgroups: lane l loads vec4 `me` = l % 8 of a
// block of 32 inputs, and takes vec4 g from lane g. One token (the .x token of row bases b) ...
fn lane_input(base: u32, kb: u32, me: u32, inv: f32) -> vec4<f32> {
    return input4(base, kb * 8u + me, inv);
}
fn block_input(mine: vec4<f32>, base: u32, kb: u32, g: u32, inv: f32) -> vec4<f32> {
    return shuffle4(mine, g);
}
// ... and 4 tokens (the columns).
fn lane_inputs(b: vec4<u32>, kb: u32, me: u32, inv: vec4<f32>) -> mat4x4<f32> {
    return inputs4(b, kb * 8u + me, inv);
}
fn block_inputs(mine: mat4x4<f32>, b: vec4<u32>, kb: u32, g: u32, inv: vec4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(shuffle4(mine[0], g), shuffle4(mine[1], g), shuffle4(mine[2], g), shuffle4(mine[3], g));
}
