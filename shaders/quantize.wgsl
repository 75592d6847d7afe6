// Activations quantized for the integer-dot products (matmul_int.wgsl): each block of 32 input
// features of a token becomes 32 int8 (q8_block in common.wgsl, as llama.cpp quantizes
// activations); d * sum(q) rides along for weights with an offset (Q4_0's -8, Q4_1's min). One
// thread per (token, block), so a token's blocks never depend on the batch. A block's input norm
// quantizes its output itself (rmsnorm.wgsl QUANTIZE): this dispatch serves the other inputs.

override K: u32;                // input features (a multiple of 32)
override X_STRIDE: u32;         // floats per row of x (K, or more when x holds other columns after)
override PER_ROW: bool = false; // inputs are the R chunk rows (LM head), not the R * C tokens
override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;   // [N, X_STRIDE], the first K read
@group(0) @binding(2) var<storage, read_write> xq: array<u32>;  // [N, K / 32, Q8_BLOCK_WORDS] (common.wgsl)

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * WG;  // 2D grids for more than 65535 workgroups
    let blocks = K / 32u;
    let n = i / blocks;
    let kb = i % blocks;
    if n >= select(step.tokens, step.rows, PER_ROW) { return; }
    let base = n * (X_STRIDE / 4u) + kb * 8u;
    var v: array<vec4<f32>, 8>;
    for (var j = 0u; j < 8u; j++) { v[j] = x[base + j]; }
    let q = q8_block(v);
    let out = (n * blocks + kb) * Q8_BLOCK_WORDS;
    for (var j = 0u; j < Q8_BLOCK_WORDS; j++) { xq[out + j] = q[j]; }
}
