// Embedding gather: x[n, :] = table[ids[n], :] * EMBED_SCALE for the ids that fall in this table part.
// The table may be split into parts by vocabulary rows (WebGPU's 128 MiB binding limit).

override D: u32;                 // d_model (multiple of 4)
override PART_START: u32 = 0u;   // first vocabulary row of this part
override PART_ROWS: u32;         // vocabulary rows in this part
override W_FORMAT: u32 = 0u;     // 0 f32, 1 f16 pairs, 5 bf16 pairs, 2 Q8_0, 3 Q4_0, 4 Q4_1, 6 Q4_K, 7 Q6_K, 8 Q5_0, 9 Q5_1, 10 IQ4_NL, 11 Q5_K, 12 Q3_K, 13 Q2_K, 14 IQ4_XS, 15 MXFP4 (common.wgsl)
override EMBED_SCALE: f32 = 1.0;
override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<storage, read> ids: array<u32>;            // [R * C]
@group(0) @binding(2) var<storage, read> table: array<u32>;          // [PART_ROWS, D] in W_FORMAT
@group(0) @binding(3) var<storage, read_write> x: array<vec4<f32>>;  // [R * C, D]

fn table4(row: u32, d4: u32) -> vec4<f32> {
    if is_ext32(W_FORMAT) {
        let at = quant_at(W_FORMAT, row, d4, D);
        return dequant_ext(W_FORMAT, block_dm(W_FORMAT, table[at.x]), table[at.x + 1u], table[at.x + quant_word(W_FORMAT, at.y)], at.y);
    }
    if is_kquant(W_FORMAT) {
        let at = quant_at(W_FORMAT, row, d4, D);
        var h: array<u32, KQ_HEAD>;
        for (var i = 0u; i < KQ_HEAD; i++) { h[i] = table[at.x + kquant_head_word(W_FORMAT, i)]; }
        let q = vec2<u32>(table[at.x + kquant_data_word(W_FORMAT, at.y, 0u)], table[at.x + kquant_data_word(W_FORMAT, at.y, 1u)]);
        return dequant_kq(W_FORMAT, h, q, at.y);
    }
    if W_FORMAT >= 2u && W_FORMAT <= 4u {
        let at = quant_at(W_FORMAT, row, d4, D);
        return dequant4(W_FORMAT, table[at.x], table[at.x + quant_word(W_FORMAT, at.y)], at.y);
    }
    if W_FORMAT == 1u || W_FORMAT == 5u {
        let w = (row * D) / 2u + d4 * 2u;
        return half4(W_FORMAT, table[w], table[w + 1u]);
    }
    let w = row * D + d4 * 4u;
    return bitcast<vec4<f32>>(vec4<u32>(table[w], table[w + 1u], table[w + 2u], table[w + 3u]));
}

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = gid.x + gid.y * nwg.x * WG;  // 2D grids for more than 65535 workgroups
    let d4n = D / 4u;
    let n = idx / d4n;
    let d4 = idx % d4n;
    if n >= step.tokens { return; }
    let id = ids[n];
    if id < PART_START || id >= PART_START + PART_ROWS { return; }
    x[n * d4n + d4] = table4(id - PART_START, d4) * EMBED_SCALE;
}
