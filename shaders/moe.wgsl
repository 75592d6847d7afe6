// The router of a mixture of experts, per token: the TOP_K experts of the highest router logits,
// in that order, ties to the lower expert id (the highest probabilities: softmax keeps the order
// of the logits, and rounding cannot swap two of them), and their weights, each the softmax over
// all EXPERTS logits, divided by the chosen ones' sum (in rank order) with NORM_TOPK. One thread
// per token and a fixed order of operations: a token's routes do not depend on the batch.
// The expert products (matmul_experts.wgsl) read what this writes. With LOG, each real token's
// experts are also kept at its row and position in the route log (`Engine::routes`).

override EXPERTS: u32;
override TOP_K: u32;
override NORM_TOPK: bool = false;
override ROUTE_STRIDE: u32;      // entries per token of routes and weights: MoE layers x TOP_K
override ROUTE_OFFSET: u32;      // this layer's first entry (its place among the MoE layers x TOP_K)
override LOG: bool = false;      // keep the routes of real tokens in route_log
override MAX_LEN: u32 = 1u;      // positions per row of route_log
override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<storage, read> row_info: array<RowInfo>;     // [R]
@group(0) @binding(2) var<storage, read> logits: array<f32>;           // [N, EXPERTS]
// each route an expert id and its weight's bits: one binding for both, as the expert products
// are at WebGPU's 8 storage buffers per stage
@group(0) @binding(3) var<storage, read_write> routes: array<u32>;     // [N, ROUTE_STRIDE, 2]
@group(0) @binding(4) var<storage, read_write> route_log: array<u32>;  // [cache rows, MAX_LEN, ROUTE_STRIDE] (LOG)

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let n = gid.x + gid.y * nwg.x * WG;  // 2D grids for more than 65535 workgroups
    if n >= step.tokens { return; }
    let base = n * EXPERTS;
    var top = logits[base];
    for (var e = 1u; e < EXPERTS; e++) { top = max(top, logits[base + e]); }
    var denom = 0.0;
    for (var e = 0u; e < EXPERTS; e++) { denom += exp(logits[base + e] - top); }
    let out = n * ROUTE_STRIDE + ROUTE_OFFSET;
    // pick s: the first expert in (logit descending, id ascending) order after pick s - 1
    var prev_logit = 0.0;
    var prev_id = -1;
    var total = 0.0;
    for (var s = 0u; s < TOP_K; s++) {
        var best = -1;
        var best_logit = 0.0;
        for (var e = 0u; e < EXPERTS; e++) {
            let l = logits[base + e];
            let after = s == 0u || l < prev_logit || (l == prev_logit && i32(e) > prev_id);
            if after && (best < 0 || l > best_logit) {
                best = i32(e);
                best_logit = l;
            }
        }
        // NaN logits pick nothing: expert 0, so no product reads past the experts
        let id = u32(max(best, 0));
        let w = exp(logits[base + id] - top) / denom;
        routes[2u * (out + s)] = id;
        routes[2u * (out + s) + 1u] = bitcast<u32>(w);
        total += w;
        prev_logit = best_logit;
        prev_id = best;
    }
    if NORM_TOPK {
        for (var s = 0u; s < TOP_K; s++) {
            let at = 2u * (out + s) + 1u;
            routes[at] = bitcast<u32>(bitcast<f32>(routes[at]) / total);
        }
    }
    if LOG {
        let info = row_info[n / step.width];
        let j = n % step.width;
        if j < info.n_new {
            let at = (info.cache_row * MAX_LEN + info.pos0 + j) * ROUTE_STRIDE + ROUTE_OFFSET;
            for (var s = 0u; s < TOP_K; s++) { route_log[at + s] = routes[2u * (out + s)]; }
        }
    }
}
