// MLP activation between the up and down projections (`mlp_act` in common.wgsl), where the up
// projection's product cannot fuse it (a gated matrix stored in several parts).
//   ACT 0: relu(x)^2 (the seed's TinyAgent MLP), input [N, F]
//   ACT 1: silu(gate) * up (SwiGLU: Llama, Qwen3), input [N, 2F] = [gate | up]
//   ACT 2: gelu_tanh(gate) * up (Gemma), input [N, 2F] = [gate | up]

override F: u32;        // ffn size (output width)
override ACT: u32;
override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<storage, read> up: array<f32>;          // [R * C, F] or [R * C, 2F]
@group(0) @binding(2) var<storage, read_write> act: array<f32>;   // [R * C, F]

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = gid.x + gid.y * nwg.x * WG;  // 2D grids for more than 65535 workgroups
    let n = idx / F;
    let f = idx % F;
    if n >= step.tokens { return; }
    if ACT == 0u {
        act[n * F + f] = mlp_act(ACT, up[n * F + f], 0.0);
    } else {
        act[n * F + f] = mlp_act(ACT, up[n * 2u * F + f], up[n * 2u * F + F + f]);
    }
}
