// Engram output, one thread per real token: k, v = W_k e_t, W_v e_t (computed by the matmul before
// this), alpha = sigmoid(dot(rmsnorm(x), rmsnorm(k)) / sqrt(D)), x += alpha * v.

override D: u32;            // d_model
override EPS: f32;
override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<storage, read> rows: array<RowInfo>;     // [R]
@group(0) @binding(2) var<storage, read> kv: array<f32>;           // [R * C, 2, D]: k then v
@group(0) @binding(3) var<storage, read_write> x: array<f32>;      // [R * C, D] residual stream

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let n = gid.x + gid.y * nwg.x * WG;  // 2D grids for more than 65535 workgroups
    if n >= step.tokens { return; }
    if n % step.width >= rows[n / step.width].n_new { return; }
    var sx = 0.0;
    var sk = 0.0;
    var dxk = 0.0;
    for (var d = 0u; d < D; d++) {
        let a = x[n * D + d];
        let b = kv[n * 2u * D + d];
        sx = fma(a, a, sx);  // explicit fma: see dot_fma in common.wgsl
        sk = fma(b, b, sk);
        dxk = fma(a, b, dxk);
    }
    let z = dxk * inverseSqrt(sx / f32(D) + EPS) * inverseSqrt(sk / f32(D) + EPS) / sqrt(f32(D));
    let alpha = 1.0 / (1.0 + exp(-z));
    for (var d = 0u; d < D; d++) {
        x[n * D + d] = fma(alpha, kv[n * 2u * D + D + d], x[n * D + d]);
    }
}
