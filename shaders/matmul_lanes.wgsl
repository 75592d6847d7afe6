// The lane hooks of dots_rows8 (matmul.wgsl) without subgroups (appended to matmul.wgsl where
// matmul_subgroup.wgsl is not): every lane loads every input itself, so there is nothing to share.
// One token (at row base `base`) ...
fn lane_input(base: u32, kb: u32, me: u32, inv: f32) -> vec4<f32> {
    return vec4<f32>(0.0);
}
fn block_input(mine: vec4<f32>, base: u32, kb: u32, g: u32, inv: f32) -> vec4<f32> {
    return input4(base, kb * 8u + g, inv);
}
// ... and 4 tokens (the columns).
fn lane_inputs(b: vec4<u32>, kb: u32, me: u32, inv: vec4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>();
}
fn block_inputs(mine: mat4x4<f32>, b: vec4<u32>, kb: u32, g: u32, inv: vec4<f32>) -> mat4x4<f32> {
    return inputs4(b, kb * 8u + g, inv);
}
