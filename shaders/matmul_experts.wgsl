// The expert products of a mixture of experts, appended to matmul.wgsl (its bindings, weight
// formats and sums): token n's TOP_K experts, as moe.wgsl routed them, each a product against
// its rows of the stacked experts' matrix. One output per thread and one token per workgroup
// row, each sum in `dots`' order for one token (the mat-vec form: matmul.wgsl's portable bits),
// so a token's results depend only on its own input and routes, never on what other tokens
// picked; and only the routed experts' weights are read.
//   SUM_SLOTS false, the experts' MLP in (MLP_ACT gated):
//     y[n * TOP_K + s, o] = act(gate_e[o] . x[n], up_e[o] . x[n]), e = routes[n, s],
//     gate_e[o] = w row e * O_ROWS + o, up_e[o] = w row (EXPERTS + e) * O_ROWS + o;
//   SUM_SLOTS true, the experts' MLP out:
//     y[n, o] (+)= sum over s = 0 .. TOP_K - 1, in rank order, of weight[n, s] * (w_e[o] . x[n * TOP_K + s]),
//     w_e[o] = w row e * O_ROWS + o; with SHARED, plus sigmoid(shared_gate[n]) * shared_out[n, o]
//     (Qwen2-MoE's shared expert, computed by the plain products before).

override EXPERTS: u32 = 1u;        // experts in the stacked matrix
override TOP_K: u32 = 1u;          // experts per token
override ROUTE_STRIDE: u32 = 1u;   // entries per token of routes and route_weights (moe.wgsl)
override ROUTE_OFFSET: u32 = 0u;   // this layer's first
override SUM_SLOTS: bool = false;  // sum the experts' outputs into one row per token
override SHARED: bool = false;     // add the shared expert's output, weighed by its gate (SUM_SLOTS)

@group(0) @binding(6) var<storage, read> routes: array<u32>;       // [N, ROUTE_STRIDE, 2]: expert id, weight bits
@group(0) @binding(7) var<storage, read> shared_out: array<f32>;   // [N, OUT_STRIDE] (SHARED)
@group(0) @binding(8) var<storage, read> shared_gate: array<f32>;  // [N] (SHARED)

@compute @workgroup_size(WG)
fn main_experts(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    let o = gid.x;
    let n = wid.y + wid.z * 65535u;  // grids of more than 65535 tokens go on in z
    if o >= O_ROWS || n >= step.tokens { return; }
    let r = n * ROUTE_STRIDE + ROUTE_OFFSET;
    let one = vec4<f32>(1.0);
    if SUM_SLOTS {
        var total = 0.0;
        for (var s = 0u; s < TOP_K; s++) {
            let e = min(routes[2u * (r + s)], EXPERTS - 1u);
            let b = vec4<u32>((n * TOP_K + s) * (X_STRIDE / 4u));
            total = fma(bitcast<f32>(routes[2u * (r + s) + 1u]), dots(e * O_ROWS + o, b, 0u, 1u, 1u, one).x, total);
        }
        if SHARED {
            let weight = 1.0 / (1.0 + exp(-shared_gate[n]));
            total = fma(weight, shared_out[n * OUT_STRIDE + o], total);
        }
        store4(o, n, step.tokens, vec4<f32>(total, 0.0, 0.0, 0.0), 1u);
        return;
    }
    let b = vec4<u32>(n * (X_STRIDE / 4u));
    for (var s = 0u; s < TOP_K; s++) {
        let e = min(routes[2u * (r + s)], EXPERTS - 1u);
        let gate = dots(e * O_ROWS + o, b, 0u, 1u, 1u, one);
        var up = vec4<f32>(0.0);
        if GATED { up = dots((EXPERTS + e) * O_ROWS + o, b, 0u, 1u, 1u, one); }
        store4(o, n * TOP_K + s, step.tokens * TOP_K, apply_act(gate, up), 1u);
    }
}
