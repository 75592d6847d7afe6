// Add each sampling row's sparse logit bias (OpenAI's `logit_bias`, and presence / frequency
// penalties kept up to date by the host) to its logits, before `sample.wgsl` reads them. One
// thread per (chunk row, bias slot); a row's entries name distinct tokens, so no two threads add
// to the same logit. Recorded only in steps where some row has a bias.

override V: u32;        // vocabulary size
override SLOTS: u32;    // bias entries per cache row
override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<storage, read> rows: array<RowInfo>;      // [R]
@group(0) @binding(2) var<storage, read> bias_n: array<u32>;        // [cache rows]: entries in use
@group(0) @binding(3) var<storage, read> bias: array<vec2<u32>>;    // [cache rows, SLOTS]: (token id, bias f32 bits)
@group(0) @binding(4) var<storage, read_write> logits: array<f32>;  // [R, V]

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = gid.x + gid.y * nwg.x * WG;  // 2D grids for more than 65535 workgroups
    let r = idx / SLOTS;
    let k = idx % SLOTS;
    if r >= step.rows { return; }
    let info = rows[r];
    if info.n_new == 0u || k >= bias_n[info.cache_row] { return; }
    let e = bias[info.cache_row * SLOTS + k];
    logits[r * V + e.x] += bitcast<f32>(e.y);
}
