// Fast path of matmul.wgsl (appended to it) for adapters with subgroups: one subgroup per output column and 4 tokens; the lanes split the input features, so
// neighbouring lanes read neighbouring weights, and `subgroupAdd` sums their partial dot products.
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
    let n0 = wid.z * 4u;
    if o >= O_ROWS || n0 >= n_total { return; }  // uniform across the workgroup
    let k4n = K / 4u;
    let last = n_total - 1u;
    let b0 = n0 * k4n;
    let b1 = min(n0 + 1u, last) * k4n;
    let b2 = min(n0 + 2u, last) * k4n;
    let b3 = min(n0 + 3u, last) * k4n;
    var acc = vec4<f32>(0.0);
    for (var k4 = lane; k4 < k4n; k4 += SG) {
        let wv = w4(o, k4);
        acc += vec4<f32>(dot(x[b0 + k4], wv), dot(x[b1 + k4], wv), dot(x[b2 + k4], wv), dot(x[b3 + k4], wv));
    }
    acc = subgroupAdd(acc);
    if lane == 0u {
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
}
