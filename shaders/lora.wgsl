// LoRA adapters applied unmerged, y = W x + scale_t * B_t (A_t x), in two halves: this kernel,
// once per block and input before the products that read that input, computes each token's
// `A_t x` for the targets of the input's group (q, k and v; o; gate and up; down) into `ax`, with
// a head saying the token's adapter slot and each target's rank and scale; the products then add
// `scale_t * B_t[o] . (A_t x)` to each output as their epilogue (matmul_lora.wgsl), before the
// MLP's activation and after the residual add. The base weights are never touched, and a token
// of a row without an adapter (or padding) gets the head NO_ADAPTER: the products leave its
// outputs as the base model's bits.
//
// Workgroup row w writes the heads of tokens w * WG .. (w + 1) * WG, a lane each, and computes
// the `A x` of group w of the host's list (`groups`, src/engine/step.rs): up to 4 tokens of one
// adapter, so each load of A serves them all (Punica's SGMV). The host sizes the grid by its
// groups (Grid::LoraGroups): a CPU adapter runs a workgroup with no group through its code once,
// masked, and a row a token left 12 of 16 rows idle at 16 rows over 4 adapters. With NORM, x is
// the residual stream and the kernel reads its RMS norm, x * inv [* norm_w], with each token's inv
// summed by rmsnorm.wgsl's 64 lanes and tree: the values the norm kernel would have written, so
// the block's norm stays fused into its products.
// Then a lane per four rows of A (targets' ranks one after another) sums each row against each
// token's normed x over every input, four at a time in order (every input width is a multiple of
// 4), the four sums added last as (x + y) + (z + w); each input vec4 of the group's tokens is
// loaded and normed once for the four rows. With SLICES > 1 (GPUs: `Builder::lora`), a lane takes
// one row, SLICES lanes split its inputs (lane s takes vec4s s, s + SLICES, ..., neighbouring
// lanes neighbouring words) and their sums meet in a fixed tree, and the grid's workgroups along
// x share the rows of A, so no lane walks a whole row alone (a workgroup per group walked 144 to
// 384 vec4s on SmolLM2's shape, the longest loop of the step, in 16 workgroups). A token's sums
// have one order whatever its group (it depends on the shapes and SLICES only): its bits are the
// same in any batch, with any adapters beside it, in any chunking.
//
// Why this shape: a CPU adapter (lavapipe) gathers a lane's loads one by one, even where every
// lane reads one address (a token's x), so a lane shares each x load among four rows there; a GPU
// coalesces 16-byte loads and broadcasts one address to every lane, so values are read four at a
// time (A and x); no lane waits on another's partial sums; and the group's tokens sit in named
// accumulators (lavapipe keeps an indexed private array in memory). With AB_HALF the values are
// halves (EngineOptions::lora_dtype): the same sums of the rounded values.

override K: u32;              // input features
override X_STRIDE: u32;       // floats per token row of x
override TARGETS: u32;        // the group's targets computed, from its first (1 to 3)
override MAX_RANK: u32;       // ranks each slot holds room for (a multiple of 8, at most 256)
override SLOT_FLOATS: u32;    // floats per adapter slot in `ab`
override META0: u32;          // meta entry of (this layer, slot 0, the group's first target)
override AX_STRIDE: u32;      // u32s per token of `ax`: 8 of head, then 3 targets' MAX_RANK values
override NORM: bool = false;         // read RMS-norm(x) over K (x is the residual stream)
override NORM_WEIGHT: bool = false;  // the norm has a weight (norm_w)
override EPS: f32 = 1e-6;            // the norm's epsilon
const WG: u32 = 64u;                 // lanes: rmsnorm.wgsl's, whose tree gives the norm's bits
const NORM_LANES: u32 = WG;          // norm_input.wgsl's inv_rms
override SLICES: u32 = 1u;           // lanes that split a row of A's inputs (a power of 2, at most WG)
override AB_HALF: bool = false;      // A and B as halves, two to a u32 (EngineOptions::lora_dtype)

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<storage, read> row_info: array<RowInfo>;   // [R]
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;        // [R * C, X_STRIDE / 4]
// per token: slot, the 3 targets' ranks, their 3 scales' bits and the products' order's token at
// this position, then A_t x (f32 bits) at
// 8 + t * MAX_RANK; matmul_lora.wgsl reads it as vec4s
@group(0) @binding(3) var<storage, read_write> ax: array<u32>;       // [R * C, AX_STRIDE]
// per slot: A [group targets, MAX_RANK, K], then the targets' B (src/gpu/lora.rs), as u32s: f32
// bits, or two halves each (AB_HALF). SLOT_FLOATS and MAX_RANK are multiples of 8 and K of 4, so
// every slot and A row starts on a whole vec4 of values.
@group(0) @binding(4) var<storage, read> ab: array<vec4<u32>>;       // [slots, SLOT_FLOATS / 4 or / 8]
@group(0) @binding(5) var<storage, read> lora_meta: array<vec2<u32>>;     // [layers, slots, 7]: rank, scale bits
@group(0) @binding(6) var<storage, read> norm_w: array<vec4<f32>>;   // [K / 4] (read with NORM_WEIGHT)
// the step's token groups: their count and where the order starts, then per group (slot,
// tokens, 0, 0) and its tokens, then the products' order of the step's tokens, four a vec4
@group(0) @binding(7) var<storage, read> groups: array<vec4<u32>>;   // [1 + 2 * R * C + R * C / 4]

// the group's slot and token count, the slot's ranks of the group's targets, and its tokens
var<workgroup> group: array<vec4<u32>, 3>;
// SLICES > 1: each lane's sums of the group's 4 tokens, then the slices' tree's (4 KiB)
var<workgroup> slice_sums: array<mat4x4<f32>, 64>;

// Values `i .. i + 4` of `ab` (i a multiple of 4).
fn ab4(i: u32) -> vec4<f32> {
    return lora_values4(ab[lora_word(i, AB_HALF)], i, AB_HALF);
}

// The (rank, scale bits) of `slot`'s target i of the dispatch (rank 0 past them).
fn target_meta(slot: u32, i: u32) -> vec2<u32> {
    if i >= TARGETS { return vec2<u32>(0u); }
    return lora_meta[META0 + slot * 7u + i];
}

@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lane: u32,
) {
    let w = wid.y + wid.z * 65535u;
    // token w * WG + lane's head (the grid's first column of workgroups writes them: the host
    // sizes the grid by the step's groups, at least one workgroup per WG tokens)
    let n = w * WG + lane;
    if wid.x == 0u && n < step.tokens {
        var h = vec4<u32>(NO_ADAPTER, 0u, 0u, 0u);
        // the last word: the token at position n of the host's order, for the products' blocks
        // (matmul_lora.wgsl's block_tokens)
        var s = vec4<u32>(0u, 0u, 0u, groups[groups[0].y + n / 4u][n % 4u]);
        let info = row_info[n / step.width];
        if n % step.width < info.n_new && info.lora != NO_ADAPTER {
            let m = array<vec2<u32>, 3>(target_meta(info.lora, 0u), target_meta(info.lora, 1u), target_meta(info.lora, 2u));
            h = vec4<u32>(info.lora, m[0].x, m[1].x, m[2].x);
            s = vec4<u32>(m[0].y, m[1].y, m[2].y, s.w);
        }
        for (var i = 0u; i < 4u; i++) {
            ax[n * AX_STRIDE + i] = h[i];
            ax[n * AX_STRIDE + 4u + i] = s[i];
        }
    }
    if lane == 0u {
        // group w, if the step has one
        var g = vec4<u32>(NO_ADAPTER, 0u, 0u, 0u);
        var ranks = vec4<u32>(0u);
        var tokens = vec4<u32>(0u);
        if w < groups[0].x {
            g = groups[1u + 2u * w];
            tokens = groups[2u + 2u * w];
            ranks = vec4<u32>(target_meta(g.x, 0u).x, target_meta(g.x, 1u).x, target_meta(g.x, 2u).x, 0u);
        }
        group = array<vec4<u32>, 3>(g, ranks, tokens);
    }
    // one value for the whole workgroup, as its barriers need (WGSL's uniformity rules, which
    // Chromium enforces: a rank read from storage would make them non-uniform)
    let grp = workgroupUniformLoad(&group);  // one barrier
    let g = grp[0];
    if g.x == NO_ADAPTER { return; }
    let h = grp[1];
    let tokens = grp[2];
    let count = g.y;
    // the group's tokens' rows of x, those past its count repeating its first (computed, not written)
    let t = select(vec4<u32>(tokens.x), tokens, vec4<u32>(0u, 1u, 2u, 3u) < vec4<u32>(count));
    let rows = t * (X_STRIDE / 4u);
    var inv = vec4<f32>(1.0);
    if NORM { inv = inv_rms(rows, lane); }
    let base = g.x * SLOT_FLOATS;
    let total = h.x + h.y + h.z;
    if SLICES == 1u {
        // a lane per four rows of A, each input vec4 of the four tokens loaded (and normed) once
        // for the four: lavapipe loads storage lane by lane, even at one address for all lanes.
        // The grid's workgroups along x take turns at the fours (a CPU adapter runs workgroups on
        // its threads: at one row, the host gives the group a workgroup per thread)
        for (var p = (lane * nwg.x + wid.x) * 4u; p < total; p += nwg.x * WG * 4u) {
            let q = min(vec4<u32>(p) + vec4<u32>(0u, 1u, 2u, 3u), vec4<u32>(total - 1u));
            let a = vec4<u32>(row_start(base, h, q.x), row_start(base, h, q.y), row_start(base, h, q.z),
                row_start(base, h, q.w));
            var acc0 = mat4x4<f32>();
            var acc1 = mat4x4<f32>();
            var acc2 = mat4x4<f32>();
            var acc3 = mat4x4<f32>();
            for (var k4 = 0u; k4 < K / 4u; k4++) {
                let xs = inputs4(rows, k4, inv);
                acc0 = fma4(ab4(a.x + 4u * k4), xs, acc0);
                acc1 = fma4(ab4(a.y + 4u * k4), xs, acc1);
                acc2 = fma4(ab4(a.z + 4u * k4), xs, acc2);
                acc3 = fma4(ab4(a.w + 4u * k4), xs, acc3);
            }
            store_row(h, p, t, count, acc0);
            if p + 1u < total { store_row(h, p + 1u, t, count, acc1); }
            if p + 2u < total { store_row(h, p + 2u, t, count, acc2); }
            if p + 3u < total { store_row(h, p + 3u, t, count, acc3); }
        }
        return;
    }
    // rows of A (target, rank) a pass of the grid row takes: WG / SLICES a workgroup
    let per_wg = WG / SLICES;
    let slice = lane % SLICES;
    // a lane per (row of A, slice of the inputs): it sums its slice (inputs slice, slice + SLICES,
    // ... in vec4s, in order) against each token's (normed) x; a token's x has one address for
    // all lanes of a slice. Every lane runs every pass (the slices meet through barriers).
    for (var p0 = wid.x * per_wg; p0 < total; p0 += nwg.x * per_wg) {
        let p = p0 + lane / SLICES;
        let live = p < total;
        var acc = mat4x4<f32>();
        if live {
            let a0 = row_start(base, h, p);
            for (var k4 = slice; k4 < K / 4u; k4 += SLICES) {
                acc = fma4(ab4(a0 + 4u * k4), inputs4(rows, k4, inv), acc);
            }
        }
        // the slices' sums of each row, added in a fixed tree (strides SLICES / 2 .. 1)
        slice_sums[lane] = acc;
        for (var stride = SLICES / 2u; stride > 0u; stride /= 2u) {
            workgroupBarrier();
            if slice < stride {
                slice_sums[lane] += slice_sums[lane + stride];
            }
        }
        workgroupBarrier();
        let sums = slice_sums[lane];
        workgroupBarrier();  // the next pass writes slice_sums again
        if live && slice == 0u { store_row(h, p, t, count, sums); }
    }
}

// The first value in `ab` of row p of the group's A (targets' rows one after another, each
// target's `h[i]` ranks; slot base `base`).
fn row_start(base: u32, h: vec4<u32>, p: u32) -> u32 {
    let i = select(0u, 1u, p >= h.x) + select(0u, 1u, p >= h.x + h.y);
    let j = p - select(0u, h.x, i > 0u) - select(0u, h.y, i > 1u);
    return base + (i * MAX_RANK + j) * K;
}

// acc's columns (the group's four tokens) plus a times each token's inputs xs.
fn fma4(a: vec4<f32>, xs: mat4x4<f32>, acc: mat4x4<f32>) -> mat4x4<f32> {
    return mat4x4<f32>(fma(a, xs[0], acc[0]), fma(a, xs[1], acc[1]), fma(a, xs[2], acc[2]), fma(a, xs[3], acc[3]));
}

// Row p's `A x` of the group's `count` tokens t (their vec4 sums, added as (x + y) + (z + w)).
fn store_row(h: vec4<u32>, p: u32, t: vec4<u32>, count: u32, acc: mat4x4<f32>) {
    let i = select(0u, 1u, p >= h.x) + select(0u, 1u, p >= h.x + h.y);
    let j = p - select(0u, h.x, i > 0u) - select(0u, h.y, i > 1u);
    let at = 8u + i * MAX_RANK + j;
    ax[t.x * AX_STRIDE + at] = bitcast<u32>((acc[0].x + acc[0].y) + (acc[0].z + acc[0].w));
    if count > 1u { ax[t.y * AX_STRIDE + at] = bitcast<u32>((acc[1].x + acc[1].y) + (acc[1].z + acc[1].w)); }
    if count > 2u { ax[t.z * AX_STRIDE + at] = bitcast<u32>((acc[2].x + acc[2].y) + (acc[2].z + acc[2].w)); }
    if count > 3u { ax[t.w * AX_STRIDE + at] = bitcast<u32>((acc[3].x + acc[3].y) + (acc[3].z + acc[3].w)); }
}
