// Mat-mat form of matmul.wgsl (appended to it): for steps of many tokens (prefill, large
// batches), a workgroup computes a tile of TILE_N tokens x 32 weight rows. Each chunk of 32 input
// features of the tile's tokens and rows is staged once in workgroup memory (the weights
// dequantized there), and every thread takes a 4 x 4 register block (4 tokens, 4 rows) from it, so
// a weight is read from memory once per TILE_N tokens instead of once per 4.
// Each (token, row) sum runs over k4 in order with dot_fma, the values `dots` reads (w4, input4):
// the portable kernel's bits, whatever the tile, so a step may take either kernel and a row's
// results still never depend on the batch or the chunking (`tiled` in variants.rs).
// Gated MLP_ACT: the 32 rows are 16 outputs' gate rows and their up rows; a thread takes 2 outputs
// and their partners. NORM: the tile's tokens' norms are summed as rmsnorm.wgsl does (64 lanes,
// its tree), all tokens at once.

const TILE_N: u32 = 32u;       // tokens per tile: 8 threads x 4
const TILE_ROWS: u32 = 32u;    // weight rows per tile: 8 threads x 4
const TILE_K4: u32 = 8u;       // vec4s of input features per staged chunk
// A chunk of the tile's inputs (token t's vec4 i at t * TILE_K4 + i) and of its weight rows
// (row j's at j * TILE_K4 + i): 4 KiB each.
var<workgroup> tile_x: array<vec4<f32>, 256>;   // [TILE_N, TILE_K4]
var<workgroup> tile_w: array<vec4<f32>, 256>;   // [TILE_ROWS, TILE_K4]
// NORM: rmsnorm.wgsl's lanes' sums of squares per token (lane l, token t at l * TILE_N + t), then
// the tree's; then 1 / rms of token t at t. 8 KiB.
var<workgroup> tile_sq: array<f32, 2048>;       // [NORM_LANES, TILE_N]

// Weight row of staged row j (0 .. 31) of the tile starting at output o0, clamped in range.
fn tile_row(o0: u32, j: u32) -> u32 {
    if GATED {
        // rows 0..15: gate rows of outputs o0 .. o0 + 15; 16..31: their up rows
        let o = min(o0 + j % 16u, O_ROWS - 1u);
        return select(o, O_ROWS + o, j >= 16u);
    }
    return min(o0 + j, O_ROWS - 1u);
}

@compute @workgroup_size(64)
fn main_tiled(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lane: u32,
) {
    let n_total = select(step.tokens, step.rows, PER_ROW);
    let outs_per_tile = select(TILE_ROWS, TILE_ROWS / 2u, GATED);
    let o0 = wid.x * outs_per_tile;
    let n0 = wid.y * TILE_N;
    if n0 >= n_total { return; }  // the whole workgroup
    let stride4 = X_STRIDE / 4u;
    if NORM {
        // lane l sums elements l, l + 64, ... of every token of the tile (rmsnorm.wgsl's lanes)
        for (var t = 0u; t < TILE_N; t++) {
            let base = min(n0 + t, n_total - 1u) * stride4;
            var ss = 0.0;
            for (var d = lane; d < K; d += NORM_LANES) {
                let v = x[base + d / 4u][d % 4u];
                ss = fma(v, v, ss);
            }
            tile_sq[lane * TILE_N + t] = ss;
        }
        for (var stride = NORM_LANES / 2u; stride > 0u; stride /= 2u) {
            workgroupBarrier();
            if lane < stride {
                for (var t = 0u; t < TILE_N; t++) {
                    tile_sq[lane * TILE_N + t] += tile_sq[(lane + stride) * TILE_N + t];
                }
            }
        }
        workgroupBarrier();
        if lane < TILE_N { tile_sq[lane] = inverseSqrt(tile_sq[lane] / f32(K) + EPS); }
        // (read after the first chunk's barrier below)
    }
    // this thread's register block: tokens tn * 4 .. + 3, staged rows given by its row slots
    let tn = lane / 8u;
    let tr = lane % 8u;
    // staged rows of the block: 4 neighbours, or (gated) 2 outputs and their 2 up rows
    var slots = vec4<u32>(tr * 4u) + vec4<u32>(0u, 1u, 2u, 3u);
    if GATED { slots = vec4<u32>(tr * 2u, tr * 2u + 1u, 16u + tr * 2u, 17u + tr * 2u); }
    var a0 = vec4<f32>(0.0);  // staged row slots.x, tokens tn * 4 .. + 3
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    for (var k0 = 0u; k0 < K / 4u; k0 += TILE_K4) {
        let len = min(TILE_K4, K / 4u - k0);
        workgroupBarrier();  // the previous chunk has been read (and the norms written)
        // entry e: vec4 i of token t and of staged row t (TILE_N = TILE_ROWS: one loop stages both)
        for (var e = lane; e < TILE_N * TILE_K4; e += 64u) {
            let i = e % TILE_K4;
            if i < len {
                let t = e / TILE_K4;
                var inv = 1.0;
                if NORM { inv = tile_sq[t]; }
                tile_x[e] = input4(min(n0 + t, n_total - 1u) * stride4, k0 + i, inv);
                tile_w[e] = w4(tile_row(o0, t), k0 + i);
            }
        }
        workgroupBarrier();
        for (var i = 0u; i < len; i++) {
            let xs = mat4x4<f32>(tile_x[(tn * 4u) * TILE_K4 + i], tile_x[(tn * 4u + 1u) * TILE_K4 + i],
                tile_x[(tn * 4u + 2u) * TILE_K4 + i], tile_x[(tn * 4u + 3u) * TILE_K4 + i]);
            a0 = dots4(xs, tile_w[slots.x * TILE_K4 + i], a0);
            a1 = dots4(xs, tile_w[slots.y * TILE_K4 + i], a1);
            a2 = dots4(xs, tile_w[slots.z * TILE_K4 + i], a2);
            a3 = dots4(xs, tile_w[slots.w * TILE_K4 + i], a3);
        }
    }
    let nb = n0 + tn * 4u;
    if nb >= n_total { return; }
    let tokens = min(4u, n_total - nb);
    if GATED {
        let o = o0 + tr * 2u;
        if o < O_ROWS { store_out(o, nb, n_total, a0, a2, tokens); }
        if o + 1u < O_ROWS { store_out(o + 1u, nb, n_total, a1, a3, tokens); }
        return;
    }
    let o = o0 + tr * 4u;
    if o < O_ROWS { store_out(o, nb, n_total, a0, vec4<f32>(0.0), tokens); }
    if o + 1u < O_ROWS { store_out(o + 1u, nb, n_total, a1, vec4<f32>(0.0), tokens); }
    if o + 2u < O_ROWS { store_out(o + 2u, nb, n_total, a2, vec4<f32>(0.0), tokens); }
    if o + 3u < O_ROWS { store_out(o + 3u, nb, n_total, a3, vec4<f32>(0.0), tokens); }
}
