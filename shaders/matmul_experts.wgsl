// The expert products of a mixture of experts, appended to matmul.wgsl (its bindings, weight
// formats and sums): token n's TOP_K experts, as moe.wgsl routed them, each a product against
// its rows of the stacked experts' matrix.
//
// `main_experts`: a workgroup is one expert, a tile of its outputs and a block of TOKEN_BLOCK
// tokens. Its expert is the wid.y-th (in id order) of those the block's (token, slot) pairs were
// routed to, so the host launches no more expert rows than a block can route to (4 at one row of
// top 4, not every expert). It walks the block's pairs in order, takes those routed to its
// expert, and runs them four at a time through matmul.wgsl's sums, so the tokens that picked the
// same expert share each weight read. Each pair's sum runs in `dots`' order over its own input
// alone (the portable bits, whichever other pairs share the call), so a token's results depend
// only on its own input and routes, never on what other tokens picked; and only routed experts'
// weights are read. Pair p = n * TOP_K + s writes row p of y:
//   y[p, o] = act(gate_e[o] . x[in(p)], up_e[o] . x[in(p)]), e = routes[n, s],
//   gate_e[o] = w row e * O_ROWS + o, up_e[o] = w row (EXPERTS + e) * O_ROWS + o (MLP_ACT gated;
//   without an act, y[p, o] = gate_e[o] . x[in(p)]); in(p) = n (the experts' MLP in, whose input
//   is the token's), or p with X_PER_SLOT (the MLP out, whose input is the pair's activation).
//   With BIAS (gpt-oss), each product adds its row's bias before the act: binding 5 then holds a
//   bias per row of the stacked matrix, [w rows].
// OUTS outputs per thread: 1 (`dots`, GPUs) or 8 (`dots_rows8`, eight rows sharing each input
// load, CPU adapters). The same bits either way.
//
// SUM_SLOTS (the experts' MLP out, second half; no weights read): a thread per (token, output)
//   y[n, o] (+)= sum over s = 0 .. TOP_K - 1, in rank order, of weight[n, s] * x[n * TOP_K + s, o],
//   with SHARED plus sigmoid(shared_gate[n]) * shared_out[n, o] (Qwen2-MoE's shared expert,
//   computed by the plain products before).

override EXPERTS: u32 = 1u;        // experts in the stacked matrix
override TOP_K: u32 = 1u;          // experts per token
override ROUTE_STRIDE: u32 = 1u;   // entries per token of routes and route_weights (moe.wgsl)
override ROUTE_OFFSET: u32 = 0u;   // this layer's first
override SUM_SLOTS: bool = false;  // sum the pairs' outputs into one row per token
override SHARED: bool = false;     // add the shared expert's output, weighed by its gate (SUM_SLOTS)
override X_PER_SLOT: bool = false; // the input row of pair p is p, not its token
override TOKEN_BLOCK: u32 = 32u;   // tokens a workgroup walks (workgroup z: the token block)

// words of the routed-experts bit set: MAX_EXPERTS (model/config.rs) / 32
const MASK_WORDS: u32 = 32u;

@group(0) @binding(6) var<storage, read> routes: array<u32>;       // [N, ROUTE_STRIDE, 2]: expert id, weight bits
@group(0) @binding(7) var<storage, read> shared_out: array<f32>;   // [N, OUT_STRIDE] (SHARED)
@group(0) @binding(8) var<storage, read> shared_gate: array<f32>;  // [N] (SHARED)

// The expert of pair p (an id past the last clamped to it, as the stacked matrix has no more).
fn pair_expert(p: u32) -> u32 {
    return min(routes[2u * ((p / TOP_K) * ROUTE_STRIDE + ROUTE_OFFSET + p % TOP_K)], EXPERTS - 1u);
}

// Pairs pairs.x .. (the first `count`) of expert e: their outputs o .. o + OUTS - 1.
fn expert_pairs(e: u32, o: u32, pairs: vec4<u32>, count: u32) {
    // the rest padded with the first, computed and not stored
    let live = vec4<bool>(true, count > 1u, count > 2u, count > 3u);
    let p = select(vec4<u32>(pairs.x), pairs, live);
    let b = select(p / TOP_K, p, X_PER_SLOT) * (X_STRIDE / 4u);
    let tokens = select(4u, 1u, count == 1u);
    let one = vec4<f32>(1.0);
    let first = e * O_ROWS;
    if OUTS == 1u {
        if o >= O_ROWS { return; }
        var gate = dots(first + o, b, 0u, 1u, tokens, one);
        var up = vec4<f32>(0.0);
        if GATED { up = dots((EXPERTS + e) * O_ROWS + o, b, 0u, 1u, tokens, one); }
        if BIAS {
            gate += bias[first + o];
            if GATED { up += bias[(EXPERTS + e) * O_ROWS + o]; }
        }
        store_pairs(o, p, count, apply_act(gate, up));
        return;
    }
    let step_outs = select(8u, 4u, GATED);
    for (var j = 0u; j < OUTS; j += step_outs) {
        let r = first + min(vec4<u32>(o + j) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(O_ROWS - 1u));
        var r_hi = r + EXPERTS * O_ROWS;
        if !GATED { r_hi = first + min(vec4<u32>(o + j + 4u) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(O_ROWS - 1u)); }
        var acc = dots_rows8(r, r_hi, b, tokens, one, 0u);
        if BIAS {
            for (var i = 0u; i < 4u; i++) {
                acc[i] += bias[r[i]];
                acc[4u + i] += bias[r_hi[i]];
            }
        }
        // rows 0..3 are outputs; 4..7 their up rows (gated) or four more outputs
        for (var i = 0u; i < step_outs && o + j + i < O_ROWS; i++) {
            let up = select(vec4<f32>(0.0), acc[(4u + i) % 8u], GATED);
            store_pairs(o + j + i, p, count, apply_act(acc[i], up));
        }
    }
}

// matmul.wgsl's own entry points, which this module carries but never runs, store through
// `store_out`; the experts take no adapters (matmul_lora.wgsl, the dense products' epilogue, is
// not appended here: its two bindings would make ten).
fn store_out(o: u32, n0: u32, n_total: u32, acc: vec4<f32>, up: vec4<f32>, tokens: u32) {
    store4(o, n0, n_total, apply_act(acc, up), tokens);
}
const LORA: bool = false;
fn store_lora_rows(o: u32, ns: vec4<u32>, live: u32, acc: array<vec4<f32>, 8>) {}
fn block_tokens(n0: u32, n_total: u32) -> vec4<u32> {
    return token_rows(n0, n_total);
}

// Output o of the first `count` pairs p (rows of y).
fn store_pairs(o: u32, p: vec4<u32>, count: u32, v: vec4<f32>) {
    for (var t = 0u; t < count; t++) {
        y[p[t] * OUT_STRIDE + OUT_OFFSET + o] = v[t];
    }
}

@compute @workgroup_size(WG)
fn main_experts(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
    if SUM_SLOTS {
        sum_slots(gid.x, wid.y + wid.z * 65535u);
        return;
    }
    let o = gid.x * OUTS;
    let first = wid.z * TOKEN_BLOCK * TOP_K;
    let end = min(first + TOKEN_BLOCK * TOP_K, step.tokens * TOP_K);
    let e = routed_expert(first, end, wid.y);
    if e >= EXPERTS { return; }  // the whole workgroup: its block routes to fewer experts
    var pairs = vec4<u32>(0u);
    var count = 0u;
    for (var p = first; p < end; p++) {
        if pair_expert(p) != e { continue; }
        pairs[count] = p;
        count++;
        if count == 4u {
            expert_pairs(e, o, pairs, 4u);
            count = 0u;
        }
    }
    if count > 0u { expert_pairs(e, o, pairs, count); }
}

// The experts pairs first .. end - 1 were routed to, as a bit set: the j-th of them in id order,
// or EXPERTS when they are fewer.
fn routed_expert(first: u32, end: u32, j: u32) -> u32 {
    // initialised explicitly, as lora.wgsl's sums are: SwiftShader once zeroed an array declared
    // without one only the first time
    var routed = array<u32, MASK_WORDS>();
    for (var p = first; p < end; p++) {
        let e = pair_expert(p);
        routed[e / 32u] |= 1u << (e % 32u);
    }
    var left = j;
    for (var w = 0u; w < (EXPERTS + 31u) / 32u; w++) {
        let count = countOneBits(routed[w]);
        if left < count {
            var bits = routed[w];
            for (var i = 0u; i < left; i++) { bits &= bits - 1u; }  // drop the lowest `left`
            return w * 32u + firstTrailingBit(bits);
        }
        left -= count;
    }
    return EXPERTS;
}

// SUM_SLOTS: token n's output o, its pairs' outputs summed by their routes' weights.
fn sum_slots(o: u32, n: u32) {
    if o >= O_ROWS || n >= step.tokens { return; }
    let r = n * ROUTE_STRIDE + ROUTE_OFFSET;
    var total = 0.0;
    for (var s = 0u; s < TOP_K; s++) {
        let at = (n * TOP_K + s) * X_STRIDE + o;
        total = fma(bitcast<f32>(routes[2u * (r + s) + 1u]), x[at / 4u][at % 4u], total);
    }
    if SHARED {
        let weight = 1.0 / (1.0 + exp(-shared_gate[n]));
        total = fma(weight, shared_out[n * OUT_STRIDE + o], total);
    }
    store4(o, n, step.tokens, vec4<f32>(total, 0.0, 0.0, 0.0), 1u);
}
