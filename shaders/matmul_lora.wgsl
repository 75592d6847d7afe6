// The dense products' epilogue (appended to matmul.wgsl for every product kernel but the
// experts'): `store_out` stores an output column of the step's tokens and, with LORA, adds each
// token's adapter `scale_t * B_t[row] . (A_t x)`, the `A_t x` and the head (slot, ranks, scales)
// as lora.wgsl wrote them for the group of targets this product belongs to. A gated activation
// takes the adapted gate and up; otherwise the adapter is added to what the product stored (bias,
// softcap and residual included), one fma, as a dispatch after it would. The sum over the rank
// runs in one order for every kernel and batch (four ranks at a time where the module's rank is
// a multiple of 4, added as (x + y) + (z + w) last; one at a time otherwise), so the kernels
// that give the portable bits still do with adapters, and a row's bits never depend on its
// neighbours' adapters.

override LORA: bool = false;     // add the adapters of the group's head in lora_ax
override LORA_ROW0: u32 = 0u;    // the group's B row of this part's weight row 0
override LORA_T1: u32 = 0u;      // the group's first B row of target 1 (0: the group has one)
override LORA_T2: u32 = 0u;      // ... of target 2 (0: it has at most two)
override LORA_RANK: u32 = 8u;    // ranks a slot holds room for (a multiple of 8)
override LORA_SLOT: u32 = 8u;    // values per slot in lora_ab
override LORA_B0: u32 = 0u;      // a slot's first value of B (after the group's A)
override LORA_AX: u32 = 8u;      // u32s per token of lora_ax (a multiple of 8)
override LORA_HALF: bool = false; // A and B as halves, two to a u32 (EngineOptions::lora_dtype)

// lora.wgsl's output: per token the head (slot or NO_ADAPTER, 3 ranks; 3 scales' bits, a pad),
// then A_t x of the group's targets at 8 + t * LORA_RANK (f32 bits)
@group(0) @binding(6) var<storage, read> lora_ax: array<vec4<u32>>;  // [N, LORA_AX / 4]
// the group's adapters (src/gpu/lora.rs): per slot A, then each target's B [rows, rank]
@group(0) @binding(7) var<storage, read> lora_ab: array<vec4<u32>>;  // [slots, LORA_SLOT / 4 or / 8]

// The group target of the group's B row g (0 to 2).
fn lora_target(g: u32) -> u32 {
    return select(0u, 1u, LORA_T1 > 0u && g >= LORA_T1) + select(0u, 1u, LORA_T2 > 0u && g >= LORA_T2);
}

// v plus token n's adapter on the group's B row g, of target t (v itself without one). A gated
// product passes t as a constant (0 for a gate, 1 for an up row): then, as in a product of one
// target, the token's `A x` has one address for all lanes (a CPU adapter loads it once, not once
// a lane).
fn lora_add(n: u32, t: u32, g: u32, v: f32) -> f32 {
    let at = n * (LORA_AX / 4u);
    let head = lora_ax[at];
    if head.x == NO_ADAPTER { return v; }
    let rank = head[t + 1u];
    if rank == 0u { return v; }  // this adapter leaves the target alone
    let first = select(select(0u, LORA_T1, t == 1u), LORA_T2, t == 2u);
    let b0 = head.x * LORA_SLOT + LORA_B0 + first * LORA_RANK + (g - first) * rank;
    let ax0 = at + 2u + t * (LORA_RANK / 4u);
    var acc = 0.0;
    if rank % 4u == 0u {
        var acc4 = vec4<f32>(0.0);
        for (var j4 = 0u; j4 < rank / 4u; j4++) {
            let i = b0 + 4u * j4;
            acc4 = fma(lora_values4(lora_ab[lora_word(i, LORA_HALF)], i, LORA_HALF), bitcast<vec4<f32>>(lora_ax[ax0 + j4]), acc4);
        }
        acc = (acc4.x + acc4.y) + (acc4.z + acc4.w);
    } else {
        for (var j = 0u; j < rank; j++) {
            let i = b0 + j;
            acc = fma(lora_value(lora_ab[lora_word(i, LORA_HALF)], i, LORA_HALF), bitcast<f32>(lora_ax[ax0 + j / 4u][j % 4u]), acc);
        }
    }
    let scale = bitcast<f32>(lora_ax[at + 1u][t]);
    return fma(scale, acc, v);  // fma: see dot_fma in common.wgsl
}

// Store output column o of tokens n0 .. n0 + tokens - 1 (those that exist), with the activation
// and the adapters (before the activation, where the product has one).
fn store_out(o: u32, n0: u32, n_total: u32, acc: vec4<f32>, up: vec4<f32>, tokens: u32) {
    if LORA && MLP_ACT != 0u {
        var gate = acc;
        var up_lora = up;
        for (var t = 0u; t < tokens; t++) {
            if n0 + t >= n_total { break; }
            gate[t] = lora_add(n0 + t, 0u, LORA_ROW0 + o, gate[t]);
            if GATED { up_lora[t] = lora_add(n0 + t, 1u, LORA_ROW0 + O_ROWS + o, up_lora[t]); }
        }
        store4(o, n0, n_total, apply_act(gate, up_lora), tokens);
        return;
    }
    if !LORA {
        store4(o, n0, n_total, apply_act(acc, up), tokens);
        return;
    }
    // after bias, softcap and residual, in one pass: each output is written once
    let g = LORA_ROW0 + o;
    let tg = lora_target(g);
    for (var t = 0u; t < tokens; t++) {
        let n = n0 + t;
        if n >= n_total { break; }
        let i = n * OUT_STRIDE + OUT_OFFSET + o;
        y[i] = lora_add(n, tg, g, finish(o, i, acc[t]));
    }
}
