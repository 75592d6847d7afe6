// y = x, a vec4 per thread: the device's copy bandwidth, measured by the bench as the limit its
// effective weight bandwidth is a fraction of.

override N4: u32;          // vec4 elements to copy
override WG: u32 = 64u;

@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;        // [N4]
@group(0) @binding(1) var<storage, read_write> y: array<vec4<f32>>;  // [N4]

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * WG;  // 2D grids for more than 65535 workgroups
    if i < N4 { y[i] = x[i]; }
}
