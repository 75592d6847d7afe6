// The dense products' epilogue (appended to matmul.wgsl for every product kernel but the
// experts'): `store_out` stores an output column of the step's tokens and, with LORA, adds each
// token's adapter `scale_t * B_t[row] . (A_t x)`, the `A_t x` and the head (slot, ranks, scales)
// as lora.wgsl wrote them for the group of targets this product belongs to. A gated activation
// takes the adapted gate and up; otherwise the adapter is added to what the product stored (bias,
// softcap and residual included), one fma, as a dispatch after it would. The sum over the rank
// runs in one order for every kernel and batch (four ranks at a time where the module's rank is
// a multiple of 4, added as (x + y) + (z + w) last; one at a time otherwise), so the kernels
// that give the portable bits still do with adapters, and a row's bits never depend on its
// neighbours' adapters. The wide products store through `store_lora_rows` with LORA instead
// (four outputs at a time, each in store_out's order), without it through store_out; they take
// the step's tokens in the host's adapter order (block_tokens), so a block's tokens on one
// adapter share each load of B (lora_tokens).

override LORA: bool = false;     // add the adapters of the group's head in lora_ax
override LORA_ROW0: u32 = 0u;    // the group's B row of this part's weight row 0
override LORA_T1: u32 = 0u;      // the group's first B row of target 1 (0: the group has one)
override LORA_T2: u32 = 0u;      // ... of target 2 (0: it has at most two)
override LORA_RANK: u32 = 8u;    // ranks a slot holds room for (a multiple of 8)
override LORA_SLOT: u32 = 8u;    // values per slot in lora_ab
override LORA_B0: u32 = 0u;      // a slot's first value of B (after the group's A)
override LORA_AX: u32 = 8u;      // u32s per token of lora_ax (a multiple of 8)
override LORA_HALF: bool = false; // A and B as halves, two to a u32 (EngineOptions::lora_dtype)

// lora.wgsl's output: per token the head (slot or NO_ADAPTER, 3 ranks; 3 scales' bits, the token
// at this position of the products' order), then A_t x of the group's targets at 8 + t *
// LORA_RANK (f32 bits)
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
    // components picked by select, not by index: lavapipe keeps a dynamically indexed vector in
    // memory, lane by lane
    let rank = target_rank(head, t);
    var out = v;
    for (var live = rank > 0u; live; live = false) {  // once, where the token's adapter has t
        let b0 = target_b0(head.x, t, g, rank);
        let ax0 = at + 2u + t * (LORA_RANK / 4u);
        var acc = 0.0;
        if rank % 4u == 0u {
            var acc4 = vec4<f32>(0.0);
            for (var j4 = 0u; j4 < rank / 4u; j4++) {
                acc4 = fma(lora_b4(b0 + 4u * j4), bitcast<vec4<f32>>(lora_ax[ax0 + j4]), acc4);
            }
            acc = (acc4.x + acc4.y) + (acc4.z + acc4.w);
        } else {
            for (var j = 0u; j < rank; j++) {
                acc = fma(lora_b(b0 + j), ax_value(ax0, j), acc);
            }
        }
        out = fma(target_scale(at, t), acc, v);  // fma: see dot_fma in common.wgsl
    }
    return out;
}

// The first value in lora_ab of the group's B row g (of target t) in `slot`, whose t has `rank`.
fn target_b0(slot: u32, t: u32, g: u32, rank: u32) -> u32 {
    let first = select(select(0u, LORA_T1, t == 1u), LORA_T2, t == 2u);
    return slot * LORA_SLOT + LORA_B0 + first * LORA_RANK + (g - first) * rank;
}

// The scale of target t in the adapter of the token whose head is at `at`.
fn target_scale(at: u32, t: u32) -> f32 {
    let scales = lora_ax[at + 1u];
    return bitcast<f32>(select(select(scales.x, scales.y, t == 1u), scales.z, t == 2u));
}

// The rank of target t in the adapter of a token with this head: 0 where the token has no
// adapter (lora.wgsl writes its head with ranks 0) or its adapter leaves t alone. The epilogue's
// work for a token then sits in a loop that runs once where this is not 0, not under an `if`:
// lavapipe runs an `if`'s body for every lane, masked, but leaves a loop that no lane enters,
// so a token on the base model costs its head's load and little more.
fn target_rank(head: vec4<u32>, t: u32) -> u32 {
    return select(select(head.y, head.z, t == 1u), head.w, t == 2u);
}

// Store output column o of tokens n0 .. n0 + tokens - 1 (those that exist), with the activation
// and the adapters (before the activation, where the product has one).
fn store_out(o: u32, n0: u32, n_total: u32, acc: vec4<f32>, up: vec4<f32>, tokens: u32) {
    if LORA && MLP_ACT != 0u {
        let gate = lora_add4(n0, n_total, tokens, 0u, LORA_ROW0 + o, acc);
        var up_lora = up;
        if GATED { up_lora = lora_add4(n0, n_total, tokens, 1u, LORA_ROW0 + O_ROWS + o, up); }
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
    lora_store(o, n0, tg, g, acc.x, n0 < n_total);
    lora_store(o, n0 + 1u, tg, g, acc.y, tokens > 1u && n0 + 1u < n_total);
    lora_store(o, n0 + 2u, tg, g, acc.z, tokens > 2u && n0 + 2u < n_total);
    lora_store(o, n0 + 3u, tg, g, acc.w, tokens > 3u && n0 + 3u < n_total);
}

// Tokens n0 .. n0 + 3's v plus their adapters on the group's B row g of target t, those of the
// block's `tokens` that exist: a component at a time by name (lavapipe keeps a dynamically
// indexed vector in memory, lane by lane).
fn lora_add4(n0: u32, n_total: u32, tokens: u32, t: u32, g: u32, v: vec4<f32>) -> vec4<f32> {
    var r = v;
    if n0 < n_total { r.x = lora_add(n0, t, g, v.x); }
    if tokens > 1u && n0 + 1u < n_total { r.y = lora_add(n0 + 1u, t, g, v.y); }
    if tokens > 2u && n0 + 2u < n_total { r.z = lora_add(n0 + 2u, t, g, v.z); }
    if tokens > 3u && n0 + 3u < n_total { r.w = lora_add(n0 + 3u, t, g, v.w); }
    return r;
}

// Output o of token n (if `live`): its sum v with bias, softcap and residual, then its adapter.
fn lora_store(o: u32, n: u32, t: u32, g: u32, v: f32, live: bool) {
    if !live { return; }
    let i = n * OUT_STRIDE + OUT_OFFSET + o;
    y[i] = lora_add(n, t, g, finish(o, i, v));
}

// The tokens at positions n0 .. n0 + 3 of the step (those past the last clamped to it). With LORA
// the positions follow the host's order of the step's tokens (lora_groups in src/engine/step.rs,
// written by lora.wgsl into each head's last word): an adapter's tokens four to a block where
// they can be, so the wide products' epilogue loads each B value once for the block
// (lora_tokens). A token's sums do not depend on its block: any order gives it the same bits.
fn block_tokens(n0: u32, n_total: u32) -> vec4<u32> {
    let p = token_rows(n0, n_total);
    if !LORA { return p; }
    let s = LORA_AX / 4u;
    return vec4<u32>(lora_ax[p.x * s + 1u].w, lora_ax[p.y * s + 1u].w, lora_ax[p.z * s + 1u].w, lora_ax[p.w * s + 1u].w);
}

// wide_outputs' stores with LORA: outputs o .. o + 3 and their up rows (gated), else o .. o + 7,
// of the block's tokens ns (its first `live` real), each as store_out stores it (the same
// operations in the same order: the same bits), with each token's head and `A x` loaded once for
// four outputs, not once an output (lavapipe loads storage lane by lane, even where every lane
// reads one address), and B once for the block where its tokens share an adapter.
fn store_lora_rows(o: u32, ns: vec4<u32>, live: u32, acc: array<vec4<f32>, 8>) {
    let lo = mat4x4<f32>(acc[0], acc[1], acc[2], acc[3]);
    let hi = mat4x4<f32>(acc[4], acc[5], acc[6], acc[7]);
    if GATED {
        store_outs4(o, ns, live, lo, hi);
        return;
    }
    store_outs4(o, ns, live, lo, mat4x4<f32>());
    store_outs4(o + 4u, ns, live, hi, mat4x4<f32>());
}

// Outputs o .. o + 3 (those below O_ROWS) of the block's tokens ns: acc's columns the outputs,
// their components the tokens (up: the outputs' up rows, gated). Its loops over the tokens run
// `live` times, where code for all four would run four times on lavapipe (it runs both sides of
// a branch, masked, but leaves a loop when no lane goes on).
fn store_outs4(o: u32, ns: vec4<u32>, live: u32, acc: mat4x4<f32>, up: mat4x4<f32>) {
    if o >= O_ROWS { return; }
    let count = min(4u, O_ROWS - o);
    let g = LORA_ROW0 + o;
    if MLP_ACT != 0u {
        let gate = transpose(lora_tokens(ns, live, 0u, g, count, transpose(acc)));
        var up_lora = up;
        if GATED { up_lora = transpose(lora_tokens(ns, live, 1u, LORA_ROW0 + O_ROWS + o, count, transpose(up))); }
        store_tokens(o, ns, live, apply_act(gate[0], up_lora[0]));
        if count > 1u { store_tokens(o + 1u, ns, live, apply_act(gate[1], up_lora[1])); }
        if count > 2u { store_tokens(o + 2u, ns, live, apply_act(gate[2], up_lora[2])); }
        if count > 3u { store_tokens(o + 3u, ns, live, apply_act(gate[3], up_lora[3])); }
        return;
    }
    // four rows from o (a multiple of 4) never span two targets: every target and part starts on
    // a multiple of 4 (head_dim is one; Builder::lora_epilogue checks). No path for the other
    // case: lavapipe runs both sides of every branch (masked), so it would cost every output.
    let t = lora_target(g);
    let by_token = transpose(acc);
    var f = by_token;
    var k = 0u;
    loop {
        f = set_column(f, k, finish4(o, count, pick(ns, k), column(by_token, k)));
        continuing {
            k++;
            break if k >= live;
        }
    }
    let r = lora_tokens(ns, live, t, g, count, f);
    k = 0u;
    loop {
        store_rows(o, count, pick(ns, k), column(r, k));
        continuing {
            k++;
            break if k >= live;
        }
    }
}

// Component k of v (k < 4), picked by select: lavapipe keeps a dynamically indexed vector in
// memory, lane by lane.
fn pick(v: vec4<u32>, k: u32) -> u32 {
    return select(select(select(v.x, v.y, k == 1u), v.z, k == 2u), v.w, k == 3u);
}
fn pick_f(v: vec4<f32>, k: u32) -> f32 {
    return select(select(select(v.x, v.y, k == 1u), v.z, k == 2u), v.w, k == 3u);
}

// Column k of m (k < 4), picked by select (see pick).
fn column(m: mat4x4<f32>, k: u32) -> vec4<f32> {
    return select(select(select(m[0], m[1], k == 1u), m[2], k == 2u), m[3], k == 3u);
}

// m with column k (k < 4) set to v, by select (see pick).
fn set_column(m: mat4x4<f32>, k: u32, v: vec4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(select(m[0], v, k == 0u), select(m[1], v, k == 1u), select(m[2], v, k == 2u), select(m[3], v, k == 3u));
}

// Output o of the block's tokens ns (the first `live`), v's components: with bias, softcap and
// residual, as store4 stores them.
fn store_tokens(o: u32, ns: vec4<u32>, live: u32, v: vec4<f32>) {
    var k = 0u;
    loop {
        let i = pick(ns, k) * OUT_STRIDE + OUT_OFFSET + o;
        y[i] = finish(o, i, pick_f(v, k));
        continuing {
            k++;
            break if k >= live;
        }
    }
}

// The adapters of the block's tokens ns (m's columns; their components B rows g .. g + count - 1
// of target t) added to m, those of its first `live`: a pass for each adapter among them, each
// load of B serving the pass's tokens (the host's order puts an adapter's tokens four to a block,
// so that is one pass where a block would take four a token at a time; none where no token has
// an adapter). Each row's sum runs in lora_add's order (four ranks a load where the rank is a
// multiple of 4, added as (x + y) + (z + w) last; one at a time otherwise), whatever the pass.
fn lora_tokens(ns: vec4<u32>, live: u32, t: u32, g: u32, count: u32, m: mat4x4<f32>) -> mat4x4<f32> {
    let at = ns * (LORA_AX / 4u);
    let h0 = lora_ax[at.x];
    let h1 = lora_ax[at.y];
    let h2 = lora_ax[at.z];
    let h3 = lora_ax[at.w];
    let slots = vec4<u32>(h0.x, h1.x, h2.x, h3.x);
    let ranks = vec4<u32>(target_rank(h0, t), target_rank(h1, t), target_rank(h2, t), target_rank(h3, t));
    // the tokens whose adapter has target t and has not been added yet
    var todo = (ranks > vec4<u32>(0u)) & (vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(live));
    let rows = min(vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(count - 1u));
    let ax0 = at + vec4<u32>(2u + t * (LORA_RANK / 4u));
    var r = m;
    // a loop, not an `if`: lavapipe leaves a loop that no lane goes on in (todo is one value for
    // the whole workgroup), where it runs an `if`'s body masked
    for (; any(todo);) {
        // the first token left: its adapter is this pass's
        let slot = select(select(select(slots.w, slots.z, todo.z), slots.y, todo.y), slots.x, todo.x);
        let rank = select(select(select(ranks.w, ranks.z, todo.z), ranks.y, todo.y), ranks.x, todo.x);
        let now = todo & (slots == vec4<u32>(slot));
        todo = todo & !now;
        let b = vec4<u32>(target_b0(slot, t, g, rank)) + rows * rank;
        // four ranks a load: per token its four rows' vec4 sums (lora_add's acc4)
        var a0 = mat4x4<f32>();
        var a1 = mat4x4<f32>();
        var a2 = mat4x4<f32>();
        var a3 = mat4x4<f32>();
        for (var j4 = 0u; j4 < select(0u, rank / 4u, rank % 4u == 0u); j4++) {
            let bs = mat4x4<f32>(lora_b4(b.x + 4u * j4), lora_b4(b.y + 4u * j4), lora_b4(b.z + 4u * j4),
                lora_b4(b.w + 4u * j4));
            a0 = fma_rows(bs, bitcast<vec4<f32>>(lora_ax[ax0.x + j4]), a0);
            a1 = fma_rows(bs, bitcast<vec4<f32>>(lora_ax[ax0.y + j4]), a1);
            a2 = fma_rows(bs, bitcast<vec4<f32>>(lora_ax[ax0.z + j4]), a2);
            a3 = fma_rows(bs, bitcast<vec4<f32>>(lora_ax[ax0.w + j4]), a3);
        }
        // their sums (0 for a rank not a multiple of 4, which then adds one rank at a time)
        var s0 = row_sums(a0);
        var s1 = row_sums(a1);
        var s2 = row_sums(a2);
        var s3 = row_sums(a3);
        for (var j = 0u; j < select(rank, 0u, rank % 4u == 0u); j++) {
            let bj = vec4<f32>(lora_b(b.x + j), lora_b(b.y + j), lora_b(b.z + j), lora_b(b.w + j));
            s0 = fma(bj, vec4<f32>(ax_value(ax0.x, j)), s0);
            s1 = fma(bj, vec4<f32>(ax_value(ax0.y, j)), s1);
            s2 = fma(bj, vec4<f32>(ax_value(ax0.z, j)), s2);
            s3 = fma(bj, vec4<f32>(ax_value(ax0.w, j)), s3);
        }
        r = mat4x4<f32>(select(r[0], lora_scaled(at.x, t, s0, m[0]), now.x), select(r[1], lora_scaled(at.y, t, s1, m[1]), now.y),
            select(r[2], lora_scaled(at.z, t, s2, m[2]), now.z), select(r[3], lora_scaled(at.w, t, s3, m[3]), now.w));
    }
    return r;
}

// acc's columns (four B rows' vec4 sums) plus each row's values bs times the token's `A x` values.
fn fma_rows(bs: mat4x4<f32>, ax: vec4<f32>, acc: mat4x4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(fma(bs[0], ax, acc[0]), fma(bs[1], ax, acc[1]), fma(bs[2], ax, acc[2]), fma(bs[3], ax, acc[3]));
}

// Each column's four values added as (x + y) + (z + w).
fn row_sums(acc: mat4x4<f32>) -> vec4<f32> {
    return vec4<f32>((acc[0].x + acc[0].y) + (acc[0].z + acc[0].w), (acc[1].x + acc[1].y) + (acc[1].z + acc[1].w),
        (acc[2].x + acc[2].y) + (acc[2].z + acc[2].w), (acc[3].x + acc[3].y) + (acc[3].z + acc[3].w));
}

// Value j of a token's `A x` of a target, from its first vec4 at ax0.
fn ax_value(ax0: u32, j: u32) -> f32 {
    return bitcast<f32>(lora_ax[ax0 + j / 4u][j % 4u]);
}

// v plus a token's scaled adapter sums (`at`: its head): lora_add's fma.
fn lora_scaled(at: u32, t: u32, sums: vec4<f32>, v: vec4<f32>) -> vec4<f32> {
    return fma(vec4<f32>(target_scale(at, t)), sums, v);
}

// Token n's outputs o .. o + count - 1 as store_out finishes them (bias, softcap, residual).
fn finish4(o: u32, count: u32, n: u32, v: vec4<f32>) -> vec4<f32> {
    let i = n * OUT_STRIDE + OUT_OFFSET + o;
    var f = v;
    f.x = finish(o, i, v.x);
    if count > 1u { f.y = finish(o + 1u, i + 1u, v.y); }
    if count > 2u { f.z = finish(o + 2u, i + 2u, v.z); }
    if count > 3u { f.w = finish(o + 3u, i + 3u, v.w); }
    return f;
}

// Token n's outputs o .. o + count - 1, stored.
fn store_rows(o: u32, count: u32, n: u32, r: vec4<f32>) {
    let i = n * OUT_STRIDE + OUT_OFFSET + o;
    y[i] = r.x;
    if count > 1u { y[i + 1u] = r.y; }
    if count > 2u { y[i + 2u] = r.z; }
    if count > 3u { y[i + 3u] = r.w; }
}

// B values i .. i + 3 (i a multiple of 4), and value i alone (f32, or halves with LORA_HALF).
fn lora_b4(i: u32) -> vec4<f32> {
    return lora_values4(lora_ab[lora_word(i, LORA_HALF)], i, LORA_HALF);
}
fn lora_b(i: u32) -> f32 {
    return lora_value(lora_ab[lora_word(i, LORA_HALF)], i, LORA_HALF);
}
