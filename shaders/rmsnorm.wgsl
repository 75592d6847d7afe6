// RMS norm over rows of length D: out = x * rsqrt(mean(x^2) + EPS) [* weight].
// A Gemma-style `1 + w` weight is folded into `weight` at upload, so the kernel knows one form.
// GATHER_LAST: output row r reads input token r * C + n_new - 1 (the final norm before the LM head);
// rows with n_new == 0 are left untouched, so they keep the value of the chunk that last had tokens.

override D: u32;
override EPS: f32;
override HAS_WEIGHT: bool = false;
override ACCUMULATE: bool = false;   // out += norm(x): Gemma's post-norms feeding the residual
override GATHER_LAST: bool = false;
override QUANTIZE: bool = false;     // also write the output quantized for the integer-dot products (D % 32 == 0)
// Lanes per row (one workgroup normalizes one row): 64, and 256 for the final norm before the LM
// head, which at one row is the step's only workgroup (its two forms, a row's last token and every
// token, take the same lanes: the same bits).
override WG: u32 = 64u;
const MAX_WG: u32 = 256u;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<storage, read> rows: array<RowInfo>;       // [R]
@group(0) @binding(2) var<storage, read> x: array<f32>;              // [R * C, D]
@group(0) @binding(3) var<storage, read> weight: array<f32>;         // [D] (unused without HAS_WEIGHT)
@group(0) @binding(4) var<storage, read_write> out: array<f32>;      // [R * C, D], or [R, D] with GATHER_LAST
@group(0) @binding(5) var<storage, read_write> xq: array<u32>;       // [R * C or R, D / 32, Q8_BLOCK_WORDS] with QUANTIZE

var<workgroup> lane_sums: array<f32, MAX_WG>;  // [WG] each lane's sum of squares, then the tree's sums

// Workgroup o: token o (row o with GATHER_LAST). Lane i sums squares of elements i, i + WG, ...,
// then a fixed tree adds the lanes: one order whatever else is in the step. (One thread walking a
// row alone is latency-bound on a GPU: on an H200 the kernels other than products and attention,
// the norms the most numerous, took 8.7 ms of a 15.4 ms SmolLM2 step.)
@compute @workgroup_size(WG)
fn main(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_index) lane: u32,
) {
    let o = wid.x + wid.y * nwg.x;  // 2D grids for more than 65535 workgroups
    var src = o;
    var valid = o < select(step.tokens, step.rows, GATHER_LAST);
    if GATHER_LAST && valid {
        let info = rows[o];
        valid = info.n_new > 0u;  // rows without tokens keep the value of their last chunk
        src = o * step.width + info.n_new - 1u;
    }
    var ss = 0.0;
    if valid {
        for (var d = lane; d < D; d += WG) {
            let v = x[src * D + d];
            ss = fma(v, v, ss);  // explicit fma: see dot_fma in common.wgsl
        }
    }
    lane_sums[lane] = ss;
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        workgroupBarrier();
        if lane < stride { lane_sums[lane] += lane_sums[lane + stride]; }
    }
    workgroupBarrier();
    if !valid { return; }
    let inv = inverseSqrt(lane_sums[0] / f32(D) + EPS);
    for (var d = lane; d < D; d += WG) {
        var v = x[src * D + d] * inv;
        if ACCUMULATE {
            v = fma(v, weight_at(d), out[o * D + d]);
        } else {
            v *= weight_at(d);
        }
        out[o * D + d] = v;
    }
    // QUANTIZE: lane i takes blocks i, i + WG, ... of the output, recomputed as just written
    // (the same operations, so the same bits as quantize.wgsl reading `out`)
    if QUANTIZE && !ACCUMULATE {
        for (var kb = lane; kb < D / 32u; kb += WG) {
            var v: array<vec4<f32>, 8>;
            for (var j = 0u; j < 8u; j++) {
                let d = kb * 32u + j * 4u;
                let xs = vec4<f32>(x[src * D + d], x[src * D + d + 1u], x[src * D + d + 2u], x[src * D + d + 3u]);
                v[j] = xs * inv * vec4<f32>(weight_at(d), weight_at(d + 1u), weight_at(d + 2u), weight_at(d + 3u));
            }
            let q = q8_block(v);
            for (var j = 0u; j < Q8_BLOCK_WORDS; j++) { xq[(o * (D / 32u) + kb) * Q8_BLOCK_WORDS + j] = q[j]; }
        }
    }
}

// The norm's weight of feature d (1 without one: a multiply by 1 is exact).
fn weight_at(d: u32) -> f32 {
    if HAS_WEIGHT { return weight[d]; }
    return 1.0;
}
