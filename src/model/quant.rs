//! Block-quantized weight formats (llama.cpp's): dequantization on the CPU (the reference, and
//! rows that are not whole blocks) and the word-aligned repacking the GPU reads.
//!
//! GPU formats (`W_FORMAT` in the shaders): every kind stays quantized in GPU memory, each block
//! padded to whole u32 words: Q8_0 9 words (scale, 32 x i8), Q4_0 5 words (scale, 16 bytes of
//! nibbles), Q4_1 5 words (scale and min, 16 bytes of nibbles), Q4_K 36 words (its 144 bytes as
//! they are), Q6_K 53 words (its 208 bytes of quants and scales, then the f16 scale in a word),
//! Q5_K 44 words, Q3_K 28 words (its 108 bytes of masks, quants and scales, then the f16 scale in
//! a word), Q2_K 21 words and IQ4_XS 34 words (their bytes as they are), MXFP4 5 words (its
//! E8M0 scale as the f32 bits of the factor it stands for, 16 bytes of nibbles).

use crate::error::{Error, Result};

/// A quantized tensor type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantKind {
    /// 32 x i8 with an f16 scale (34 bytes per 32 weights).
    Q8_0,
    /// 32 x 4-bit with an f16 scale, offset 8 (18 bytes).
    Q4_0,
    /// 32 x 4-bit with f16 scale and min (20 bytes).
    Q4_1,
    /// 256-weight super-blocks of 4-bit with 6-bit scales and mins (144 bytes).
    Q4K,
    /// 256-weight super-blocks of 6-bit with 8-bit scales (210 bytes).
    Q6K,
    /// 32 x 5-bit with an f16 scale, offset 16: the fifth bits in a word of their own (22 bytes).
    Q5_0,
    /// 32 x 5-bit with f16 scale and min (24 bytes).
    Q5_1,
    /// 32 x 4-bit indices into llama.cpp's non-linear table of 16 values, an f16 scale (18 bytes).
    IQ4NL,
    /// 256-weight super-blocks of 5-bit with 6-bit scales and mins (176 bytes): Q4_K plus the
    /// fifth bits.
    Q5K,
    /// 256-weight super-blocks of 3-bit (2 low bits and a high-bit mask) with 6-bit signed
    /// scales per 16 (110 bytes).
    Q3K,
    /// 256-weight super-blocks of 2-bit with 4-bit scales and mins per 16 (84 bytes).
    Q2K,
    /// 256-weight super-blocks of IQ4_NL's table indices with 6-bit scales per 32 (136 bytes).
    IQ4XS,
    /// 32 x 4-bit E2M1 values (OCP microscaling, gpt-oss's experts) with a power-of-two E8M0
    /// scale (17 bytes).
    MXFP4,
}

/// MXFP4's 16 E2M1 values doubled (llama.cpp's `kvalues_mxfp4`; the scale is halved to match).
pub const MXFP4_VALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// MXFP4's E8M0 scale byte as the factor of [`MXFP4_VALUES`]: `2^(e - 128)` (llama.cpp's
/// `GGML_E8M0_TO_FP32_HALF`, subnormal for e < 2).
pub fn mxfp4_scale(e: u8) -> f32 {
    f32::from_bits(if e < 2 { 0x0020_0000 << e } else { (e as u32 - 1) << 23 })
}

/// IQ4_NL's (and IQ4_XS's) 16 values, as llama.cpp's `kvalues_iq4nl`.
pub const IQ4NL_VALUES: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

impl QuantKind {
    /// Every block format, in GGUF type order.
    pub const ALL: [QuantKind; 13] = [
        QuantKind::Q4_0,
        QuantKind::Q4_1,
        QuantKind::Q5_0,
        QuantKind::Q5_1,
        QuantKind::Q8_0,
        QuantKind::Q2K,
        QuantKind::Q3K,
        QuantKind::Q4K,
        QuantKind::Q5K,
        QuantKind::Q6K,
        QuantKind::IQ4NL,
        QuantKind::IQ4XS,
        QuantKind::MXFP4,
    ];

    /// ggml's type id (GGUF's tensor type).
    pub fn ggml_type(self) -> u32 {
        match self {
            QuantKind::Q4_0 => 2,
            QuantKind::Q4_1 => 3,
            QuantKind::Q5_0 => 6,
            QuantKind::Q5_1 => 7,
            QuantKind::Q8_0 => 8,
            QuantKind::Q2K => 10,
            QuantKind::Q3K => 11,
            QuantKind::Q4K => 12,
            QuantKind::Q5K => 13,
            QuantKind::Q6K => 14,
            QuantKind::IQ4NL => 20,
            QuantKind::IQ4XS => 23,
            QuantKind::MXFP4 => 39,
        }
    }

    /// Weights per block.
    pub fn block_len(self) -> usize {
        match self {
            QuantKind::Q4K | QuantKind::Q5K | QuantKind::Q6K | QuantKind::Q3K | QuantKind::Q2K | QuantKind::IQ4XS => {
                256
            }
            _ => 32,
        }
    }

    /// Bytes per block on disk.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantKind::Q8_0 => 34,
            QuantKind::Q4_0 => 18,
            QuantKind::Q4_1 => 20,
            QuantKind::Q4K => 144,
            QuantKind::Q6K => 210,
            QuantKind::Q5_0 => 22,
            QuantKind::Q5_1 => 24,
            QuantKind::IQ4NL => 18,
            QuantKind::Q5K => 176,
            QuantKind::Q3K => 110,
            QuantKind::Q2K => 84,
            QuantKind::IQ4XS => 136,
            QuantKind::MXFP4 => 17,
        }
    }

    /// u32 words per repacked block on the GPU.
    pub(crate) fn gpu_block_words(self) -> usize {
        match self {
            QuantKind::Q8_0 => 9,
            QuantKind::Q4_0 | QuantKind::Q4_1 | QuantKind::IQ4NL | QuantKind::MXFP4 => 5,
            QuantKind::Q5_0 | QuantKind::Q5_1 => 6,
            QuantKind::Q4K => 36,
            QuantKind::Q5K => 44,
            QuantKind::Q6K => 53,
            QuantKind::Q3K => 28,
            QuantKind::Q2K => 21,
            QuantKind::IQ4XS => 34,
        }
    }
}

/// Raw quantized blocks of a `[rows, cols]` matrix, row-major (each row is `cols / block_len`
/// whole blocks).
#[derive(Clone, Debug, PartialEq)]
pub struct QuantData {
    /// The block format.
    pub kind: QuantKind,
    /// The blocks, as on disk.
    pub bytes: Vec<u8>,
}

fn f16(b: &[u8]) -> f32 {
    half::f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// Dequantize `n` weights of `kind` from `bytes` (which must hold exactly `n / block_len` blocks).
pub fn dequantize(kind: QuantKind, bytes: &[u8], n: usize) -> Result<Vec<f32>> {
    let bl = kind.block_len();
    if !n.is_multiple_of(bl) || bytes.len() != n / bl * kind.block_bytes() {
        return Err(Error::Weights(format!(
            "{kind:?}: {} bytes do not hold {n} weights in blocks of {bl}",
            bytes.len()
        )));
    }
    let mut out = Vec::with_capacity(n);
    for b in bytes.chunks_exact(kind.block_bytes()) {
        match kind {
            QuantKind::Q8_0 => {
                let d = f16(b);
                out.extend(b[2..34].iter().map(|&q| d * (q as i8) as f32));
            }
            QuantKind::Q4_0 => {
                let d = f16(b);
                let qs = &b[2..18];
                out.extend(qs.iter().map(|&q| d * ((q & 0xF) as f32 - 8.0)));
                out.extend(qs.iter().map(|&q| d * ((q >> 4) as f32 - 8.0)));
            }
            QuantKind::Q4_1 => {
                let (d, m) = (f16(b), f16(&b[2..]));
                let qs = &b[4..20];
                out.extend(qs.iter().map(|&q| d * (q & 0xF) as f32 + m));
                out.extend(qs.iter().map(|&q| d * (q >> 4) as f32 + m));
            }
            QuantKind::Q5_0 | QuantKind::Q5_1 => {
                // weight j: its nibble (byte j % 16, low half for j < 16) and bit j of qh
                let (d, m, at) = match kind {
                    QuantKind::Q5_0 => (f16(b), 0.0, 2),
                    _ => (f16(b), f16(&b[2..]), 4),
                };
                let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
                let qs = &b[at + 4..at + 20];
                let q = |j: usize| {
                    let nib = if j < 16 { qs[j] & 0xF } else { qs[j - 16] >> 4 } as u32;
                    (nib | (((qh >> j) & 1) << 4)) as i32
                };
                match kind {
                    QuantKind::Q5_0 => out.extend((0..32).map(|j| (q(j) - 16) as f32 * d)),
                    _ => out.extend((0..32).map(|j| q(j) as f32 * d + m)),
                }
            }
            QuantKind::IQ4NL => {
                let d = f16(b);
                let qs = &b[2..18];
                out.extend(qs.iter().map(|&q| d * IQ4NL_VALUES[(q & 0xF) as usize] as f32));
                out.extend(qs.iter().map(|&q| d * IQ4NL_VALUES[(q >> 4) as usize] as f32));
            }
            QuantKind::MXFP4 => {
                let d = mxfp4_scale(b[0]);
                let qs = &b[1..17];
                out.extend(qs.iter().map(|&q| d * MXFP4_VALUES[(q & 0xF) as usize] as f32));
                out.extend(qs.iter().map(|&q| d * MXFP4_VALUES[(q >> 4) as usize] as f32));
            }
            QuantKind::Q4K | QuantKind::Q5K => {
                let (d, dmin) = (f16(b), f16(&b[2..]));
                let scales = &b[4..16];
                // Q5_K: the fifth bits (bit 2 chunk of qh[l] for weight l of a chunk's first
                // 32, bit 2 chunk + 1 for its second 32), then the nibbles
                let (qh, qs) = match kind {
                    QuantKind::Q5K => (&b[16..48], &b[48..176]),
                    _ => (&[0u8; 32][..], &b[16..144]),
                };
                let scale_min = |j: usize| -> (f32, f32) {
                    if j < 4 {
                        ((scales[j] & 63) as f32, (scales[j + 4] & 63) as f32)
                    } else {
                        (
                            ((scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4)) as f32,
                            ((scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)) as f32,
                        )
                    }
                };
                for chunk in 0..4 {
                    let q = &qs[chunk * 32..chunk * 32 + 32];
                    let (s1, m1) = scale_min(2 * chunk);
                    let (s2, m2) = scale_min(2 * chunk + 1);
                    let fifth = |l: usize, bit: usize| ((qh[l] >> bit) & 1) << 4;
                    out.extend(
                        q.iter()
                            .enumerate()
                            .map(|(l, &x)| d * s1 * ((x & 0xF) | fifth(l, 2 * chunk)) as f32 - dmin * m1),
                    );
                    out.extend(
                        q.iter()
                            .enumerate()
                            .map(|(l, &x)| d * s2 * ((x >> 4) | fifth(l, 2 * chunk + 1)) as f32 - dmin * m2),
                    );
                }
            }
            QuantKind::Q6K => {
                let ql = &b[0..128];
                let qh = &b[128..192];
                let sc = &b[192..208];
                let d = f16(&b[208..]);
                for half in 0..2 {
                    let (ql, qh, sc) = (&ql[half * 64..], &qh[half * 32..], &sc[half * 8..]);
                    let mut y = [0f32; 128];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                        y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                        y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                        y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
                    }
                    out.extend_from_slice(&y);
                }
            }
            QuantKind::Q3K => {
                // weight i: n = i / 128, j = i % 128 / 32, l = i % 32: 2 bits at 2j of qs[32n + l],
                // minus 4 unless bit 4n + j of hmask[l] is set; scale (i / 16) - 32
                let (hmask, qs, sc) = (&b[0..32], &b[32..96], &b[96..108]);
                let d = f16(&b[108..]);
                for i in 0..256 {
                    let (n, j, l) = (i / 128, i % 128 / 32, i % 32);
                    let k = i / 16;
                    let low = if k < 8 { sc[k] & 0xF } else { sc[k - 8] >> 4 };
                    let scale = (low | (((sc[8 + k % 4] >> (2 * (k / 4))) & 3) << 4)) as i32 - 32;
                    let q =
                        ((qs[32 * n + l] >> (2 * j)) & 3) as i32 - if hmask[l] >> (4 * n + j) & 1 == 1 { 0 } else { 4 };
                    out.push(d * scale as f32 * q as f32);
                }
            }
            QuantKind::Q2K => {
                // weight i: 2 bits at 2j of qs[32n + l] (n, j, l as Q3_K), scale and min nibbles of
                // scales[i / 16]
                let (sc, qs) = (&b[0..16], &b[16..80]);
                let (d, dmin) = (f16(&b[80..]), f16(&b[82..]));
                for i in 0..256 {
                    let (n, j, l) = (i / 128, i % 128 / 32, i % 32);
                    let s = sc[i / 16];
                    let (dl, ml) = (d * (s & 0xF) as f32, dmin * (s >> 4) as f32);
                    out.push(dl * ((qs[32 * n + l] >> (2 * j)) & 3) as f32 - ml);
                }
            }
            QuantKind::IQ4XS => {
                // 8 blocks of 32 as IQ4_NL's, each with a 6-bit scale (low 4 bits in scales_l,
                // high 2 in scales_h) minus 32
                let d = f16(b);
                let scales_h = u16::from_le_bytes([b[2], b[3]]);
                let (scales_l, qs) = (&b[4..8], &b[8..136]);
                for ib in 0..8 {
                    let ls = ((scales_l[ib / 2] >> (4 * (ib % 2))) & 0xF) as i32
                        | ((((scales_h >> (2 * ib)) & 3) as i32) << 4);
                    let dl = d * (ls - 32) as f32;
                    let q = &qs[16 * ib..16 * ib + 16];
                    out.extend(q.iter().map(|&v| dl * IQ4NL_VALUES[(v & 0xF) as usize] as f32));
                    out.extend(q.iter().map(|&v| dl * IQ4NL_VALUES[(v >> 4) as usize] as f32));
                }
            }
        }
    }
    Ok(out)
}

/// Repack blocks into whole u32 words for the GPU (see the module docs).
pub(crate) fn repack_for_gpu(kind: QuantKind, bytes: &[u8]) -> Vec<u32> {
    let bb = kind.block_bytes();
    let mut out = Vec::with_capacity(bytes.len() / bb * kind.gpu_block_words());
    let words = |b: &[u8], out: &mut Vec<u32>| {
        out.extend(b.chunks_exact(4).map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]])));
    };
    for b in bytes.chunks_exact(bb) {
        match kind {
            QuantKind::Q8_0 | QuantKind::Q4_0 | QuantKind::IQ4NL | QuantKind::Q5_0 => {
                out.push(u16::from_le_bytes([b[0], b[1]]) as u32);
                words(&b[2..], &mut out);
            }
            QuantKind::Q4_1 | QuantKind::Q5_1 | QuantKind::Q4K | QuantKind::Q5K => words(b, &mut out),
            QuantKind::Q6K => {
                words(&b[..208], &mut out);
                out.push(u16::from_le_bytes([b[208], b[209]]) as u32);
            }
            QuantKind::Q3K => {
                words(&b[..108], &mut out);
                out.push(u16::from_le_bytes([b[108], b[109]]) as u32);
            }
            QuantKind::Q2K | QuantKind::IQ4XS => words(b, &mut out),
            // the scale as the f32 it stands for, then the nibbles as IQ4_NL's
            QuantKind::MXFP4 => {
                out.push(mxfp4_scale(b[0]).to_bits());
                words(&b[1..], &mut out);
            }
        }
    }
    out
}

/// Quantize f32 weights (whole blocks) to `kind`: Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 the way
/// llama.cpp's reference quantizers do; the K-quants (Q2_K to Q6_K) with plain per-sub-block
/// ranges and IQ4_NL / IQ4_XS with the scale that maps the largest magnitude to the table's end
/// and the nearest entry for each weight (valid blocks, not llama.cpp's error-minimizing
/// searches); MXFP4 as llama.cpp's reference quantizer. Used to make quantized
/// test models and by weight updates of quantized engines.
pub fn quantize(kind: QuantKind, x: &[f32]) -> Result<Vec<u8>> {
    if !x.len().is_multiple_of(kind.block_len()) {
        return Err(Error::Weights(format!("quantize {kind:?}: {} weights", x.len())));
    }
    let mut out = Vec::new();
    let h = |v: f32| half::f16::from_f32(v).to_le_bytes();
    match kind {
        QuantKind::Q4K => {
            x.chunks_exact(256).for_each(|b| quantize_q4_k(b, 15, &mut out));
            return Ok(out);
        }
        QuantKind::Q5K => {
            x.chunks_exact(256).for_each(|b| quantize_q4_k(b, 31, &mut out));
            return Ok(out);
        }
        QuantKind::Q6K => {
            x.chunks_exact(256).for_each(|b| quantize_q6_k(b, &mut out));
            return Ok(out);
        }
        QuantKind::Q3K => {
            x.chunks_exact(256).for_each(|b| quantize_q3_k(b, &mut out));
            return Ok(out);
        }
        QuantKind::Q2K => {
            x.chunks_exact(256).for_each(|b| quantize_q2_k(b, &mut out));
            return Ok(out);
        }
        QuantKind::IQ4XS => {
            x.chunks_exact(256).for_each(|b| quantize_iq4_xs(b, &mut out));
            return Ok(out);
        }
        _ => {}
    }
    for blk in x.chunks_exact(32) {
        match kind {
            QuantKind::Q8_0 => {
                let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&h(d));
                out.extend(blk.iter().map(|v| (v * id).round() as i8 as u8));
            }
            QuantKind::Q4_0 => {
                let mx = blk.iter().fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
                let d = mx / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&h(d));
                let q = |v: f32| ((v * id + 8.5) as i32).clamp(0, 15) as u8;
                out.extend((0..16).map(|j| q(blk[j]) | (q(blk[j + 16]) << 4)));
            }
            QuantKind::Q4_1 => {
                let mn = blk.iter().copied().fold(f32::INFINITY, f32::min);
                let mx = blk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (mx - mn) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&h(d));
                out.extend_from_slice(&h(mn));
                let q = |v: f32| (((v - mn) * id + 0.5) as i32).clamp(0, 15) as u8;
                out.extend((0..16).map(|j| q(blk[j]) | (q(blk[j + 16]) << 4)));
            }
            QuantKind::Q5_0 => {
                let mx = blk.iter().fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
                let d = mx / -16.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                let q: Vec<u32> = blk.iter().map(|v| ((v * id + 16.5) as i8).min(31) as u32).collect();
                out.extend_from_slice(&h(d));
                q5_bits(&q, &mut out);
            }
            QuantKind::Q5_1 => {
                let mn = blk.iter().copied().fold(f32::INFINITY, f32::min);
                let mx = blk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = (mx - mn) / 31.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                let q: Vec<u32> = blk.iter().map(|v| ((((v - mn) * id + 0.5) as u8).min(31)) as u32).collect();
                out.extend_from_slice(&h(d));
                out.extend_from_slice(&h(mn));
                q5_bits(&q, &mut out);
            }
            QuantKind::IQ4NL => {
                let mx = blk.iter().fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a });
                let d = f16_round(mx / -127.0);
                out.extend_from_slice(&h(d));
                out.extend((0..16).map(|j| iq4_nearest(blk[j], d) | (iq4_nearest(blk[j + 16], d) << 4)));
            }
            QuantKind::MXFP4 => {
                // llama.cpp's quantize_row_mxfp4_ref: the largest magnitude's power of two, 4 below
                // the table's end of 12, and the nearest entry (the first of equals) for each weight
                let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
                let e = if amax > 0.0 { (amax.log2().floor() - 2.0 + 127.0).clamp(0.0, 255.0) as u8 } else { 0 };
                let d = mxfp4_scale(e);
                let nearest = |v: f32| {
                    (0..16u8).fold(0u8, |best, i| {
                        let err = |i: u8| (MXFP4_VALUES[i as usize] as f32 * d - v).abs();
                        if err(i) < err(best) {
                            i
                        } else {
                            best
                        }
                    })
                };
                out.push(e);
                out.extend((0..16).map(|j| nearest(blk[j]) | (nearest(blk[j + 16]) << 4)));
            }
            QuantKind::Q4K | QuantKind::Q5K | QuantKind::Q6K | QuantKind::Q3K | QuantKind::Q2K | QuantKind::IQ4XS => {
                unreachable!("256-weight blocks are handled above")
            }
        }
    }
    Ok(out)
}

/// The index of IQ4_NL's table entry nearest to `v / d`.
fn iq4_nearest(v: f32, d: f32) -> u8 {
    let t = if d != 0.0 { v / d } else { 0.0 };
    (0..16u8)
        .min_by(|&a, &b| {
            let (ea, eb) = ((IQ4NL_VALUES[a as usize] as f32 - t).abs(), (IQ4NL_VALUES[b as usize] as f32 - t).abs());
            ea.total_cmp(&eb)
        })
        .unwrap_or(0)
}

/// A Q5 block's fifth bits (a little-endian word, bit j for weight j) and nibbles (weights j and
/// j + 16 in byte j).
fn q5_bits(q: &[u32], out: &mut Vec<u8>) {
    let qh = (0..32).fold(0u32, |acc, j| acc | (((q[j] >> 4) & 1) << j));
    out.extend_from_slice(&qh.to_le_bytes());
    out.extend((0..16).map(|j| ((q[j] & 0xF) | ((q[j + 16] & 0xF) << 4)) as u8));
}

fn f16_round(v: f32) -> f32 {
    half::f16::from_f32(v).to_f32()
}

/// One Q4_K (`levels` 15) or Q5_K (31) block: 8 sub-blocks of 32, each `x = d * sc * q - dmin * m`
/// with 6-bit sc, m.
fn quantize_q4_k(x: &[f32], levels: u8, out: &mut Vec<u8>) {
    let mut scale = [0f32; 8];
    let mut min = [0f32; 8];
    for (j, sb) in x.chunks_exact(32).enumerate() {
        let lo = sb.iter().copied().fold(0f32, f32::min);
        let hi = sb.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        scale[j] = (hi - lo) / levels as f32;
        min[j] = -lo;
    }
    let d = f16_round(scale.iter().copied().fold(0f32, f32::max) / 63.0);
    let dmin = f16_round(min.iter().copied().fold(0f32, f32::max) / 63.0);
    let six = |v: f32, unit: f32| if unit > 0.0 { (v / unit).round().clamp(0.0, 63.0) as u8 } else { 0 };
    let sc: Vec<u8> = scale.iter().map(|&s| six(s, d)).collect();
    let m: Vec<u8> = min.iter().map(|&v| six(v, dmin)).collect();
    let mut scales = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            scales[j] = sc[j];
            scales[j + 4] = m[j];
        } else {
            scales[j + 4] = (sc[j] & 0xF) | ((m[j] & 0xF) << 4);
            scales[j - 4] |= (sc[j] >> 4) << 6;
            scales[j] |= (m[j] >> 4) << 6;
        }
    }
    let q: Vec<u8> = x
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let (step, offset) = (d * sc[i / 32] as f32, dmin * m[i / 32] as f32);
            if step > 0.0 {
                ((v + offset) / step).round().clamp(0.0, levels as f32) as u8
            } else {
                0
            }
        })
        .collect();
    out.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
    out.extend_from_slice(&half::f16::from_f32(dmin).to_le_bytes());
    out.extend_from_slice(&scales);
    if levels > 15 {
        // Q5_K's fifth bits: weight l of chunk c's first 32 in bit 2c of byte l, its second 32 in 2c + 1
        out.extend((0..32).map(|l| {
            (0..4).fold(0u8, |acc, c| {
                acc | ((q[c * 64 + l] >> 4) << (2 * c)) | ((q[c * 64 + 32 + l] >> 4) << (2 * c + 1))
            })
        }));
    }
    for chunk in 0..4 {
        out.extend((0..32).map(|l| (q[chunk * 64 + l] & 0xF) | ((q[chunk * 64 + 32 + l] & 0xF) << 4)));
    }
}

/// One Q6_K block: 16 sub-blocks of 16, each `x = d * sc * (q - 32)` with i8 sc and 6-bit q.
fn quantize_q6_k(x: &[f32], out: &mut Vec<u8>) {
    let scale: Vec<f32> = x.chunks_exact(16).map(|sb| sb.iter().fold(0f32, |a, v| a.max(v.abs())) / 31.0).collect();
    let d = f16_round(scale.iter().copied().fold(0f32, f32::max) / 127.0);
    let sc: Vec<i8> =
        scale.iter().map(|&s| if d > 0.0 { (s / d).round().clamp(-128.0, 127.0) as i8 } else { 0 }).collect();
    let q: Vec<u8> = x
        .iter()
        .enumerate()
        .map(|(i, &v)| {
            let step = d * sc[i / 16] as f32;
            let k = if step != 0.0 { (v / step).round().clamp(-32.0, 31.0) } else { 0.0 };
            (k as i32 + 32) as u8
        })
        .collect();
    let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
    for half in 0..2 {
        let q = &q[half * 128..];
        for l in 0..32 {
            let (q1, q2, q3, q4) = (q[l], q[l + 32], q[l + 64], q[l + 96]);
            ql[half * 64 + l] = (q1 & 0xF) | ((q3 & 0xF) << 4);
            ql[half * 64 + l + 32] = (q2 & 0xF) | ((q4 & 0xF) << 4);
            qh[half * 32 + l] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
        }
    }
    out.extend_from_slice(&ql);
    out.extend_from_slice(&qh);
    out.extend(sc.iter().map(|&s| s as u8));
    out.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
}

/// One Q3_K block: 16 sub-blocks of 16, each `x = d * sc * q` with q in -4..=3 (stored plus 4:
/// its low 2 bits in qs, its third bit in hmask) and a 6-bit signed sc (stored plus 32).
fn quantize_q3_k(x: &[f32], out: &mut Vec<u8>) {
    // the signed scale that maps each sub-block's largest magnitude to -4 (as Q4_0 maps it to -8)
    let scale: Vec<f32> = x
        .chunks_exact(16)
        .map(|sb| sb.iter().fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a }) / -4.0)
        .collect();
    let d = f16_round(scale.iter().fold(0f32, |a, s| a.max(s.abs())) / 31.0);
    let sc: Vec<i32> =
        scale.iter().map(|&s| if d > 0.0 { (s / d).round().clamp(-32.0, 31.0) as i32 } else { 0 }).collect();
    let (mut hmask, mut qs, mut scales) = ([0u8; 32], [0u8; 64], [0u8; 12]);
    for (i, &v) in x.iter().enumerate() {
        let step = d * sc[i / 16] as f32;
        let q = if step != 0.0 { (v / step).round().clamp(-4.0, 3.0) as i32 } else { 0 } + 4;
        let (n, j, l) = (i / 128, i % 128 / 32, i % 32);
        qs[32 * n + l] |= ((q & 3) as u8) << (2 * j);
        hmask[l] |= ((q >> 2) as u8) << (4 * n + j);
    }
    for (k, &s) in sc.iter().enumerate() {
        let v = (s + 32) as u8;
        scales[k % 8] |= (v & 0xF) << (4 * (k / 8));
        scales[8 + k % 4] |= (v >> 4) << (2 * (k / 4));
    }
    out.extend_from_slice(&hmask);
    out.extend_from_slice(&qs);
    out.extend_from_slice(&scales);
    out.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
}

/// One Q2_K block: 16 sub-blocks of 16, each `x = d * sc * q - dmin * m` with 4-bit sc, m and
/// 2-bit q.
fn quantize_q2_k(x: &[f32], out: &mut Vec<u8>) {
    let mut scale = [0f32; 16];
    let mut min = [0f32; 16];
    for (j, sb) in x.chunks_exact(16).enumerate() {
        let lo = sb.iter().copied().fold(0f32, f32::min);
        let hi = sb.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        scale[j] = (hi - lo) / 3.0;
        min[j] = -lo;
    }
    let d = f16_round(scale.iter().copied().fold(0f32, f32::max) / 15.0);
    let dmin = f16_round(min.iter().copied().fold(0f32, f32::max) / 15.0);
    let four = |v: f32, unit: f32| if unit > 0.0 { (v / unit).round().clamp(0.0, 15.0) as u8 } else { 0 };
    let sc: Vec<u8> = scale.iter().map(|&s| four(s, d)).collect();
    let m: Vec<u8> = min.iter().map(|&v| four(v, dmin)).collect();
    let mut qs = [0u8; 64];
    for (i, &v) in x.iter().enumerate() {
        let (step, offset) = (d * sc[i / 16] as f32, dmin * m[i / 16] as f32);
        let q = if step > 0.0 { ((v + offset) / step).round().clamp(0.0, 3.0) as u8 } else { 0 };
        qs[32 * (i / 128) + i % 32] |= q << (2 * (i % 128 / 32));
    }
    out.extend((0..16).map(|k| sc[k] | (m[k] << 4)));
    out.extend_from_slice(&qs);
    out.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
    out.extend_from_slice(&half::f16::from_f32(dmin).to_le_bytes());
}

/// One IQ4_XS block: 8 blocks of 32 of IQ4_NL's table indices, each scaled by `d * (ls - 32)`
/// with a 6-bit ls.
fn quantize_iq4_xs(x: &[f32], out: &mut Vec<u8>) {
    let scale: Vec<f32> = x
        .chunks_exact(32)
        .map(|b| b.iter().fold(0f32, |a, &v| if v.abs() > a.abs() { v } else { a }) / -127.0)
        .collect();
    let d = f16_round(scale.iter().fold(0f32, |a, s| a.max(s.abs())) / 31.0);
    let ls: Vec<i32> =
        scale.iter().map(|&s| if d > 0.0 { (s / d).round().clamp(-32.0, 31.0) as i32 } else { 0 } + 32).collect();
    let scales_h = (0..8).fold(0u16, |acc, ib| acc | ((((ls[ib] >> 4) & 3) as u16) << (2 * ib)));
    out.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
    out.extend_from_slice(&scales_h.to_le_bytes());
    out.extend((0..4).map(|k| (ls[2 * k] & 0xF) as u8 | (((ls[2 * k + 1] & 0xF) as u8) << 4)));
    for (ib, b) in x.chunks_exact(32).enumerate() {
        let dl = d * (ls[ib] - 32) as f32;
        out.extend((0..16).map(|j| iq4_nearest(b[j], dl) | (iq4_nearest(b[j + 16], dl) << 4)));
    }
}
