// Per-head RMS norm (qk-norm, optional) then RoPE at each token's own position, in place.
// Token n = r * C + j of the chunk is rotated by position rows[r].rope_pos0 + j (its slot, plus any
// positions the row skipped as padding; at most max_len - 1, checked on the host). RoPE is the half-split
// (`rotate_half`) layout: pairs (i, i + D/2) rotate by angle pos * theta^(-2i/D), read from a table
// computed on the host in f64 (GPU sin/cos of large arguments is not accurate on every backend).
// Keys are rotated once, here, before they are stored: they are never rotated again.

override HEADS: u32;               // heads rotated per token (n_heads for q, n_kv_heads for k)
override D: u32;                   // head_dim (even)
override STRIDE: u32;              // floats per token row of t (q: H*D; fused kv: 2*Hk*D, k first)
override NORM: bool = false;       // qk-norm before RoPE
override HAS_WEIGHT: bool = false; // qk-norm has a weight [D]
override EPS: f32 = 1e-6;
override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<storage, read> rows: array<RowInfo>;   // [R]
@group(0) @binding(2) var<storage, read_write> t: array<f32>;    // [R * C, STRIDE]
@group(0) @binding(3) var<storage, read> weight: array<f32>;     // [D] (unused without HAS_WEIGHT)
@group(0) @binding(4) var<storage, read> rope: array<vec2<f32>>; // [max_len, D/2] (cos, sin)

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = gid.x + gid.y * nwg.x * WG;  // 2D grids for more than 65535 workgroups
    let n = idx / HEADS;
    let h = idx % HEADS;
    if n >= step.tokens { return; }
    let r = n / step.width;
    let j = n % step.width;
    let info = rows[r];
    if j >= info.n_new { return; }  // padding: its value is never read as a real key or query
    let pos = info.rope_pos0 + j;
    let base = n * STRIDE + h * D;
    var inv = 1.0;
    if NORM {
        var ss = 0.0;
        for (var d = 0u; d < D; d++) { let v = t[base + d]; ss = fma(v, v, ss); }
        inv = inverseSqrt(ss / f32(D) + EPS);
    }
    let half = D / 2u;
    for (var i = 0u; i < half; i++) {
        var a = t[base + i] * inv;
        var b = t[base + i + half] * inv;
        if NORM && HAS_WEIGHT {
            a *= weight[i];
            b *= weight[i + half];
        }
        let cs = rope[pos * half + i];
        // explicit fma: see dot_fma in common.wgsl
        t[base + i] = fma(a, cs.x, -(b * cs.y));
        t[base + i + half] = fma(b, cs.x, a * cs.y);
    }
}
