// RMS norm over rows of length D: out = x * rsqrt(mean(x^2) + EPS) [* weight].
// A Gemma-style `1 + w` weight is folded into `weight` at upload, so the kernel knows one form.
// GATHER_LAST: output row r reads input token r * C + n_new - 1 (the final norm before the LM head);
// rows with n_new == 0 are left untouched, so they keep the value of the chunk that last had tokens.

override D: u32;
override EPS: f32;
override HAS_WEIGHT: bool = false;
override ACCUMULATE: bool = false;   // out += norm(x): Gemma's post-norms feeding the residual
override GATHER_LAST: bool = false;
override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<storage, read> rows: array<RowInfo>;       // [R]
@group(0) @binding(2) var<storage, read> x: array<f32>;              // [R * C, D]
@group(0) @binding(3) var<storage, read> weight: array<f32>;         // [D] (unused without HAS_WEIGHT)
@group(0) @binding(4) var<storage, read_write> out: array<f32>;      // [R * C, D], or [R, D] with GATHER_LAST

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = gid.x + gid.y * nwg.x * WG;  // 2D grids for more than 65535 workgroups
    let o = idx;
    var src = o;
    if GATHER_LAST {
        if o >= step.rows { return; }
        let info = rows[o];
        if info.n_new == 0u { return; }
        src = o * step.width + info.n_new - 1u;
    } else if o >= step.tokens {
        return;
    }
    var ss = 0.0;
    for (var d = 0u; d < D; d++) {
        let v = x[src * D + d];
        ss = fma(v, v, ss);  // explicit fma: see dot_fma in common.wgsl
    }
    let inv = inverseSqrt(ss / f32(D) + EPS);
    for (var d = 0u; d < D; d++) {
        var v = x[src * D + d] * inv;
        var scale = 1.0;
        if HAS_WEIGHT { scale = weight[d]; }
        if ACCUMULATE {
            v = fma(v, scale, out[o * D + d]);
        } else {
            v *= scale;
        }
        out[o * D + d] = v;
    }
}
