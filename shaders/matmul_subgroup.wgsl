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
