// Fast path of matmul.wgsl (appended to it) for adapters with subgroups: one subgroup per output
// column and 4 tokens (1 in steps of fewer than 4); the lanes split the input features, so neighbouring lanes read neighbouring
// weights, and `subgroupAdd` sums their partial dot products.
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
    let acc = subgroupAdd(dots(o, row_bases(n0, n_total), lane, SG, tokens));
    if lane == 0u {
        store4(o, n0, n_total, acc, tokens);
    }
}
