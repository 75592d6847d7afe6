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
    if gated() { up = subgroupAdd(dots(O_ROWS + o, b, lane, SG, tokens, vec4<f32>(1.0))) * inv; }
    if lane == 0u {
        store4(o, n0, n_total, apply_act(acc, up), tokens);
    }
}

// The `wide` shape of `main` (OUTS outputs per thread, four at a time) with the inputs shared
// through the subgroup, for Q8_0 / Q4_0 / Q4_1 weights (other formats take `dots_quad`): lane l
// loads vec4 l % 8 of each block of 32 inputs, and every lane takes vec4 g of the block from lane
// g (subgroupShuffle). On lavapipe each lane's storage load is a loop over the SIMD lanes while a
// shuffle by a uniform index is one vector permute, so the inputs cost an eighth of the loads
// they did (SmolLM2's decode products: 78 -> 54 ms a step on an AMD EPYC). The same values in the
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
    let b = row_bases(n0, n_total);
    var inv = vec4<f32>(1.0);
    if NORM && WG == 8u {
        inv = inv_rms_lanes8(b, tokens, sg_lane);
    } else if NORM {
        inv = inv_rms(b, lane);  // all lanes: barriers
    }
    if n0 >= n_total { return; }  // the whole workgroup
    let me = sg_lane % 8u;
    // eight weight rows share each input: four outputs and their up-projection partners (gated
    // MLP_ACT), else eight outputs
    let step_outs = select(8u, 4u, gated());
    for (var j = 0u; j < OUTS; j += step_outs) {
        let r = min(vec4<u32>(o + j) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(O_ROWS - 1u));
        var r_hi = r + O_ROWS;
        if !gated() { r_hi = min(r + 4u, vec4<u32>(O_ROWS - 1u)); }
        let acc = shared_rows8(r, r_hi, b, tokens, inv, me);
        for (var i = 0u; i < 4u && o + j + i < O_ROWS; i++) {
            let up = select(vec4<f32>(0.0), acc[4u + i], gated());
            store4(o + j + i, n0, n_total, apply_act(acc[i], up), tokens);
        }
        for (var i = 4u; i < 8u && !gated() && o + j + i < O_ROWS; i++) {
            store4(o + j + i, n0, n_total, apply_act(acc[i], vec4<f32>(0.0)), tokens);
        }
    }
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

// A block of 32's words after its head: 1..4, and 5..8 for Q8_0 (zeros for Q4).
fn block_lo(base: u32) -> vec4<u32> {
    return vec4<u32>(w[base + 1u], w[base + 2u], w[base + 3u], w[base + 4u]);
}
fn block_hi(base: u32) -> vec4<u32> {
    if W_FORMAT != 2u { return vec4<u32>(0u); }
    return vec4<u32>(w[base + 5u], w[base + 6u], w[base + 7u], w[base + 8u]);
}

// The word quant_word(W_FORMAT, g) of a block, from its words loaded by block_lo and block_hi.
fn block_word(lo: vec4<u32>, hi: vec4<u32>, g: u32) -> u32 {
    if W_FORMAT == 2u { return select(lo[g % 4u], hi[g % 4u], g >= 4u); }
    return lo[g % 4u];
}

// One token's dot product with a block of 32 (its scale dm and words lo, hi), added to acc in
// `dots`' order; g is a constant in each line, so each word and shift is known at compile time.
fn block_dot(acc: f32, dm: vec2<f32>, lo: vec4<u32>, hi: vec4<u32>, x0: vec4<f32>, x1: vec4<f32>, x2: vec4<f32>,
    x3: vec4<f32>, x4: vec4<f32>, x5: vec4<f32>, x6: vec4<f32>, x7: vec4<f32>) -> f32 {
    var a = dot_fma(x0, dequant4_dm(W_FORMAT, dm, block_word(lo, hi, 0u), 0u), acc);
    a = dot_fma(x1, dequant4_dm(W_FORMAT, dm, block_word(lo, hi, 1u), 1u), a);
    a = dot_fma(x2, dequant4_dm(W_FORMAT, dm, block_word(lo, hi, 2u), 2u), a);
    a = dot_fma(x3, dequant4_dm(W_FORMAT, dm, block_word(lo, hi, 3u), 3u), a);
    a = dot_fma(x4, dequant4_dm(W_FORMAT, dm, block_word(lo, hi, 4u), 4u), a);
    a = dot_fma(x5, dequant4_dm(W_FORMAT, dm, block_word(lo, hi, 5u), 5u), a);
    a = dot_fma(x6, dequant4_dm(W_FORMAT, dm, block_word(lo, hi, 6u), 6u), a);
    return dot_fma(x7, dequant4_dm(W_FORMAT, dm, block_word(lo, hi, 7u), 7u), a);
}

// The `dots` of weight rows r and r_hi (eight rows) with the inputs shared through the subgroup
// (`me`: which vec4 of a block this lane loads), each weight word loaded once; other formats than
// blocks of 32 take `dots_quad`, four rows at a time.
fn shared_rows8(r: vec4<u32>, r_hi: vec4<u32>, b: vec4<u32>, tokens: u32, inv: vec4<f32>, me: u32)
    -> array<vec4<f32>, 8> {
    if W_FORMAT < 2u || W_FORMAT > 4u {
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
        let dm0 = unpack2x16float(w[base.x]);
        let dm1 = unpack2x16float(w[base.y]);
        let dm2 = unpack2x16float(w[base.z]);
        let dm3 = unpack2x16float(w[base.w]);
        let dm4 = unpack2x16float(w[base_hi.x]);
        let dm5 = unpack2x16float(w[base_hi.y]);
        let dm6 = unpack2x16float(w[base_hi.z]);
        let dm7 = unpack2x16float(w[base_hi.w]);
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
            let mine = input4(b.x, kb * 8u + me, inv.x);
            let x0 = shuffle4(mine, 0u);
            let x1 = shuffle4(mine, 1u);
            let x2 = shuffle4(mine, 2u);
            let x3 = shuffle4(mine, 3u);
            let x4 = shuffle4(mine, 4u);
            let x5 = shuffle4(mine, 5u);
            let x6 = shuffle4(mine, 6u);
            let x7 = shuffle4(mine, 7u);
            a0.x = block_dot(a0.x, dm0, lo0, hi0, x0, x1, x2, x3, x4, x5, x6, x7);
            a1.x = block_dot(a1.x, dm1, lo1, hi1, x0, x1, x2, x3, x4, x5, x6, x7);
            a2.x = block_dot(a2.x, dm2, lo2, hi2, x0, x1, x2, x3, x4, x5, x6, x7);
            a3.x = block_dot(a3.x, dm3, lo3, hi3, x0, x1, x2, x3, x4, x5, x6, x7);
            a4.x = block_dot(a4.x, dm4, lo4, hi4, x0, x1, x2, x3, x4, x5, x6, x7);
            a5.x = block_dot(a5.x, dm5, lo5, hi5, x0, x1, x2, x3, x4, x5, x6, x7);
            a6.x = block_dot(a6.x, dm6, lo6, hi6, x0, x1, x2, x3, x4, x5, x6, x7);
            a7.x = block_dot(a7.x, dm7, lo7, hi7, x0, x1, x2, x3, x4, x5, x6, x7);
        } else {
            let mine = inputs4(b, kb * 8u + me, inv);
            for (var g = 0u; g < 8u; g++) {
                let xs = mat4x4<f32>(shuffle4(mine[0], g), shuffle4(mine[1], g), shuffle4(mine[2], g),
                    shuffle4(mine[3], g));
                a0 = dots4(xs, dequant4_dm(W_FORMAT, dm0, block_word(lo0, hi0, g), g), a0);
                a1 = dots4(xs, dequant4_dm(W_FORMAT, dm1, block_word(lo1, hi1, g), g), a1);
                a2 = dots4(xs, dequant4_dm(W_FORMAT, dm2, block_word(lo2, hi2, g), g), a2);
                a3 = dots4(xs, dequant4_dm(W_FORMAT, dm3, block_word(lo3, hi3, g), g), a3);
                a4 = dots4(xs, dequant4_dm(W_FORMAT, dm4, block_word(lo4, hi4, g), g), a4);
                a5 = dots4(xs, dequant4_dm(W_FORMAT, dm5, block_word(lo5, hi5, g), g), a5);
                a6 = dots4(xs, dequant4_dm(W_FORMAT, dm6, block_word(lo6, hi6, g), g), a6);
                a7 = dots4(xs, dequant4_dm(W_FORMAT, dm7, block_word(lo7, hi7, g), g), a7);
            }
        }
    }
    return array<vec4<f32>, 8>(a0, a1, a2, a3, a4, a5, a6, a7);
}
