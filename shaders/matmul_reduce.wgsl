// The GPU shape of `main_subgroup` for adapters without subgroups (appended to matmul.wgsl): one
// workgroup of WG lanes per output column and 4 tokens (1 in steps of fewer than 4). Lane l takes
// the weight vec4s l, l + WG, ... of the row, so neighbouring lanes read neighbouring words
// (coalesced), and the lanes' partial sums meet in workgroup memory in one fixed tree (strides
// WG / 2 .. 1). Its own summation order, not the portable one, but the same for every batch and
// chunking: a row's bits never depend on the step. NORM reads x * inv [* norm_w] with inv from
// rmsnorm.wgsl's tree (inv_rms): the values the norm kernel would have written, so fused and
// unfused give the same bits.

// The workgroup's sum of every lane's `v`, in the fixed tree. Every lane calls it (barriers).
fn sum_lanes(v: vec4<f32>, lane: u32) -> vec4<f32> {
    return tree_sum(v, lane, WG);
}

@compute @workgroup_size(WG)
fn main_reduce(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lane: u32,
) {
    let o = wid.x + wid.y * nwg.x;
    let n_total = select(step.tokens, step.rows, PER_ROW);
    let tokens = tokens_per_thread(n_total);
    let n0 = wid.z * tokens;
    if o >= O_ROWS || n0 >= n_total { return; }  // uniform across the workgroup
    let b = row_bases(n0, n_total);
    var inv = vec4<f32>(1.0);
    if NORM { inv = inv_rms(b, lane); }  // WG = NORM_LANES: rmsnorm's bits
    let acc = sum_lanes(dots(o, b, lane, WG, tokens, inv), lane);
    var up = vec4<f32>(0.0);
    if GATED { up = sum_lanes(dots(O_ROWS + o, b, lane, WG, tokens, inv), lane); }
    if lane == 0u {
        store_out(o, n0, n_total, acc, up, tokens);
    }
}
