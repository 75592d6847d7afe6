// Prepended to every kernel by `src/gpu/shaders.rs` (the one mechanism for shared WGSL code).
// Only types, functions and tree_sum's workgroup memory live here: bindings and override
// constants belong to each kernel.

// Written once per chunk: the shape of the right-padded chunk being appended.
struct Step {
    rows: u32,    // R: rows in this chunk (the sub-batch), row r is chunk row, not cache row
    width: u32,   // C: token slots per row (right-padded)
    tokens: u32,  // R * C: token index n = r * C + j
    _pad: u32,
}

// Kernels dispatched once per group of tokens (the split attention, whose scratch holds one
// group): the first token of this dispatch's group.
struct TokenGroup {
    token0: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

// One per chunk row; written by the host from its CPU mirror of the lengths.
struct RowInfo {
    cache_row: u32,  // the cache row this chunk row reads and writes
    n_new: u32,      // real tokens of this row in this chunk (j < n_new is real, the rest is padding)
    pos0: u32,       // lens[cache_row] before this chunk: token j is stored at slot pos0 + j
    rope_pos0: u32,  // RoPE rotates token j by position rope_pos0 + j (pos0 plus skipped padding)
    global_from: u32,  // global K/V is written from this position on (below: a prompt-cache replay
                       // recomputing local rings over blocks the pool already holds)
    lora: u32,         // the LoRA adapter slot the row decodes with (NO_ADAPTER: the base model)
    next_id: u32,      // sample.wgsl's SCORE: the token after this chunk's last (NO_TOKEN: none)
    _pad2: u32,
}

// tree_sum's lanes' values, then its tree's sums (a module's entry points hold it only if they
// call tree_sum; naga takes no pointer to workgroup memory as an argument, hence one array here).
var<workgroup> tree_sums: array<vec4<f32>, 64>;

// The sum of every lane's `v` over a workgroup's first `lanes` lanes (a power of 2, at most 64),
// in one fixed tree (strides lanes / 2 .. 1: rmsnorm.wgsl's, four values at once), returned to
// every lane. Every lane calls it (barriers); the last barrier lets a later call overwrite
// tree_sums once all have read the sum.
fn tree_sum(v: vec4<f32>, lane: u32, lanes: u32) -> vec4<f32> {
    tree_sums[lane] = v;
    for (var stride = lanes / 2u; stride > 0u; stride /= 2u) {
        workgroupBarrier();
        if lane < stride { tree_sums[lane] += tree_sums[lane + stride]; }
    }
    workgroupBarrier();
    let sum = tree_sums[0];
    workgroupBarrier();
    return sum;
}

// RowInfo.lora of a row on the base model.
const NO_ADAPTER: u32 = 0xffffffffu;

// LoRA values i .. i + 3 (i a multiple of 4) of an adapter buffer read as vec4<u32>s (src/gpu/lora.rs),
// from the word `lora_word(i, half)` that holds them: f32 bits, or with `half` two halves a u32
// (EngineOptions::lora_dtype; unpacked with unpack2x16float, no shader-f16 needed).
fn lora_word(i: u32, half: bool) -> u32 {
    return i / select(4u, 8u, half);
}

fn lora_values4(w: vec4<u32>, i: u32, half: bool) -> vec4<f32> {
    if half {
        let pair = select(w.xy, w.zw, (i / 4u) % 2u == 1u);
        return vec4<f32>(unpack2x16float(pair.x), unpack2x16float(pair.y));
    }
    return bitcast<vec4<f32>>(w);
}

// LoRA value i alone (B rows of a rank not a multiple of 4), from the word lora_word(i, half).
fn lora_value(w: vec4<u32>, i: u32, half: bool) -> f32 {
    if half {
        return unpack2x16float(w[(i / 2u) % 4u])[i % 2u];
    }
    return bitcast<f32>(w[i % 4u]);
}

// Global K/V lives in pools of blocks, `[blocks, 2, kv_heads, block_len, head_dim]` per shard (a
// block's keys, then its values); a row's block table (`[rows, max_blocks]`, block indices within
// the shard) says which block holds its positions `b * block_len ..`. The element index of the key
// of (kv head kh, position pos) in `block` (its value: `kv_heads * block_len * head_dim` further):
fn block_elem(block: u32, kv_heads: u32, block_len: u32, head_dim: u32, kh: u32, pos: u32) -> u32 {
    return ((block * 2u * kv_heads + kh) * block_len + pos % block_len) * head_dim;
}

// 16-bit values are stored two per u32 word, the first in the low half (portable: no `shader-f16`
// needed). K/V storage formats (`KV_FORMAT`) use the weight codes below: 0 f32 bits, 1 f16 pairs,
// 5 bf16 pairs.

// bf16 bits of x, rounded to nearest even (as PyTorch's `.to(torch.bfloat16)`; x is finite).
fn bf16_bits(x: f32) -> u32 {
    let u = bitcast<u32>(x);
    return (u + 0x7fffu + ((u >> 16u) & 1u)) >> 16u;
}

// f16 bits of x, rounded to nearest even (as `half::f16::from_f32` and PyTorch), in integer
// arithmetic. Not `pack2x16float`: a compiler may fold `unpack2x16float(pack2x16float(k))` within
// one shader into k itself. On an NVIDIA H200 it did, for 199,986 of 200,000 random values, so a
// key read fresh from the chunk kept its f32 bits while the same key read back from the ring had
// been rounded, and a row's logits depended on its chunking (by 3e-4). Integer bits cannot be
// folded, and their rounding is ours rather than the driver's.
fn f16_bits(x: f32) -> u32 {
    let u = bitcast<u32>(x);
    let sign = (u >> 16u) & 0x8000u;
    let a = u & 0x7fffffffu;
    if a > 0x7f800000u { return sign | 0x7e00u; }  // NaN
    if a >= 0x477ff000u { return sign | 0x7c00u; }  // 65520 and above round to infinity
    if a >= 0x38800000u {
        // normal: rebias the exponent (127 -> 15), round the 13 dropped bits to nearest even
        let r = a - 0x38000000u;
        return sign | ((r + 0xfffu + ((r >> 13u) & 1u)) >> 13u);
    }
    // subnormal: m * 2^-24 with m = mant * 2^(e - 126), e the biased f32 exponent
    let e = a >> 23u;
    if e < 102u { return sign; }  // below 2^-25: rounds to zero
    let mant = (a & 0x7fffffu) | 0x800000u;
    let shift = 126u - e;  // 14 ..= 24
    let m = mant >> shift;
    let rem = mant & ((1u << shift) - 1u);
    let half = 1u << (shift - 1u);
    return sign | (m + select(0u, 1u, rem > half || (rem == half && (m & 1u) == 1u)));
}

// Two values packed into one word in a 16-bit format (1 f16, 5 bf16), each rounded to nearest even.
fn pack2(fmt: u32, v: vec2<f32>) -> u32 {
    if fmt == 5u {
        return bf16_bits(v.x) | (bf16_bits(v.y) << 16u);
    }
    return f16_bits(v.x) | (f16_bits(v.y) << 16u);
}

// v rounded to what storage in `fmt` keeps (0: unchanged).
fn round_to(fmt: u32, v: vec4<f32>) -> vec4<f32> {
    if fmt == 0u {
        return v;
    }
    return half4(fmt, pack2(fmt, v.xy), pack2(fmt, v.zw));
}

// Exactness on compilers that fuse: a multiply feeding an add may become one fused multiply-add
// or stay two rounded operations, and a GPU's compiler chooses per code instance (each inlined copy,
// each pipeline's constants). One value computed in two places (a key read from the ring or fresh
// from the chunk, a token alone in a mat-vec or in a block of 4, a cache shard's pipeline) could then
// differ in its last bit. So every multiply-add in a reduction is an explicit `fma`, which leaves
// the compiler no choice, and scores are scaled by scaling the query once (no multiply feeding the
// softmax's subtractions).

// acc + a . b, one fused step per component in x, y, z, w order.
fn dot_fma(a: vec4<f32>, b: vec4<f32>, acc: f32) -> f32 {
    return fma(a.w, b.w, fma(a.z, b.z, fma(a.y, b.y, fma(a.x, b.x, acc))));
}

// One step of an online softmax over scores in position order: folding score s into the running
// max m gives (the new max, the factor that rescales what was summed under the old max: exactly 1
// when the max stays, s's weight). The serial and split-head attention walks share it.
fn softmax_fold(s: f32, m: f32) -> vec3<f32> {
    let nm = max(s, m);
    return vec3<f32>(nm, select(1.0, exp(m - s), s > m), exp(s - nm));
}

// tanh that stays finite for large arguments on every backend.
fn safe_tanh(x: f32) -> f32 {
    return tanh(clamp(x, -15.0, 15.0));
}

// Gemma 2's attention-logit softcap on a (scaled) score: cap * tanh(score / cap); cap 0 is none.
fn softcap_score(cap: f32, score: f32) -> f32 {
    if cap > 0.0 { return cap * safe_tanh(score / cap); }
    return score;
}

// The MLP activation between the up and down projections, for one feature: `act` 0 relu(g)^2 (the
// seed's TinyAgent; `u` unused), 1 silu(g) * u (SwiGLU), 2 gelu_tanh(g) * u (Gemma), 3 gpt-oss's
// clamped SwiGLU. One expression for mlp_act.wgsl and the product that fuses it, so both give the
// same bits.
fn mlp_act(act: u32, g: f32, u: f32) -> f32 {
    if act == 0u {
        let v = max(g, 0.0);
        return v * v;
    }
    if act == 3u {
        // gpt-oss's clamped SwiGLU (model/config.rs SWIGLU_LIMIT 7, SWIGLU_ALPHA 1.702)
        let gc = min(g, 7.0);
        return (clamp(u, -7.0, 7.0) + 1.0) * (gc / (1.0 + exp(-1.702 * gc)));
    }
    var a: f32;
    if act == 1u {
        a = g / (1.0 + exp(-g));
    } else {
        a = 0.5 * g * (1.0 + safe_tanh(0.7978845608028654 * fma(0.044715 * g * g, g, g)));  // fma: see dot_fma
    }
    return a * u;
}

// Four 16-bit weights from two words: f16 pairs (W_FORMAT 1) or bf16 pairs (5, a shift each).
fn half4(fmt: u32, a: u32, b: u32) -> vec4<f32> {
    if fmt == 5u {
        return bitcast<vec4<f32>>(vec4<u32>(a << 16u, a & 0xffff0000u, b << 16u, b & 0xffff0000u));
    }
    return vec4<f32>(unpack2x16float(a), unpack2x16float(b));
}

// Weight formats (`W_FORMAT`): 0 f32 bits, 1 f16 pairs, 5 bf16 pairs, 2 Q8_0, 3 Q4_0, 4 Q4_1,
// 6 Q4_K, 7 Q6_K, 8 Q5_0, 9 Q5_1, 10 IQ4_NL, 11 Q5_K, 12 Q3_K, 13 Q2_K, 14 IQ4_XS, 15 MXFP4. Quantized
// rows are blocks padded to whole words (see
// src/model/quant.rs). Blocks of 32 weights: word 0 holds the f16 scale (Q4_1, Q5_1: scale | min
// << 16; MXFP4: its power-of-two scale as f32 bits, block_dm), then Q8_0 has 8 words of i8 and
// Q4_0/Q4_1/IQ4_NL/MXFP4 4 words of nibbles (weights 0..15 in
// the low nibbles of bytes 0..15, weights 16..31 in the high nibbles); Q5_0/Q5_1 have a word of
// fifth bits (bit j for weight j) before their nibbles. Blocks of 256 (K-quants) are llama.cpp's,
// word-aligned.
fn block_words(fmt: u32) -> u32 {
    switch fmt {
        case 2u: { return 9u; }
        case 6u: { return 36u; }
        case 7u: { return 53u; }
        case 8u, 9u: { return 6u; }
        case 11u: { return 44u; }
        case 12u: { return 28u; }
        case 13u: { return 21u; }
        case 14u: { return 34u; }
        default: { return 5u; }
    }
}

// The formats in blocks of 256 (K-quants and IQ4_XS): Q4_K, Q6_K, Q5_K, Q3_K, Q2_K, IQ4_XS.
fn is_kquant(fmt: u32) -> bool {
    return fmt == 6u || fmt == 7u || (fmt >= 11u && fmt <= 14u);
}

// The blocks of 32 that dequant4 does not take: Q5_0, Q5_1, IQ4_NL, MXFP4 (dequant_ext).
fn is_ext32(fmt: u32) -> bool {
    return (fmt >= 8u && fmt <= 10u) || fmt == 15u;
}

// A block of 32's scale (and min) from its head word: f16 halves, or MXFP4's f32 bits.
fn block_dm(fmt: u32, head: u32) -> vec2<f32> {
    if fmt == 15u { return vec2<f32>(bitcast<f32>(head), 0.0); }
    return unpack2x16float(head);
}

// Weights per block.
fn block_len(fmt: u32) -> u32 {
    return select(32u, 256u, is_kquant(fmt));
}

// Word (block base, vec4 index within the block) of weights 4 k4 .. 4 k4 + 3 of row `row` of a
// quantized matrix with `cols` columns.
fn quant_at(fmt: u32, row: u32, k4: u32, cols: u32) -> vec2<u32> {
    let per = block_len(fmt) / 4u;
    return vec2<u32>((row * (cols / block_len(fmt)) + k4 / per) * block_words(fmt), k4 % per);
}

// A block of 256 is read as its head (up to 5 words: the scales, which serve the whole block)
// and, for weights 4g .. 4g + 3, one or two data words, so a loop over a block loads its head
// once. Head slots (word indices in the block; unused slots repeat word 0):
//   Q4_K, Q5_K: d and dmin, the three words of 6-bit scales and mins
//   Q6_K: d, the four words of i8 sub-block scales
//   Q3_K: d, the two words of the scales' low nibbles, the word of their high bits
//   Q2_K: d and dmin, the four words of scale and min nibbles
//   IQ4_XS: d and the scales' high bits, their low nibbles
fn kquant_head_word(fmt: u32, i: u32) -> u32 {
    switch fmt {
        case 7u: { return select(47u + i, 52u, i == 0u); }
        case 12u: { return select(select(23u + i, 0u, i > 3u), 27u, i == 0u); }
        case 13u: { return select(i - 1u, 20u, i == 0u); }
        case 14u: { return select(0u, i, i < 2u); }
        default: { return select(0u, i, i < 4u); }
    }
}

// Head slots (each kernel loads them from its own buffer: kq_head in matmul.wgsl, embed.wgsl).
const KQ_HEAD: u32 = 5u;

// Data words per 4 weights: 2 for Q6_K, Q5_K and Q3_K, else 1.
fn kquant_data_words(fmt: u32) -> u32 {
    return select(1u, 2u, fmt == 7u || fmt == 11u || fmt == 12u);
}

// The data words of weights 4g .. 4g + 3 (slot 1 unused, word 0, where one word holds them):
//   Q4_K: the nibbles; Q5_K: the nibbles, the fifth bits; Q6_K: the low 4 bits, the high 2 bits;
//   Q3_K: the low 2 bits, the high-bit mask; Q2_K: the 2 bits; IQ4_XS: the indices.
// Weight 4g + c of Q3_K and Q2_K is weight l = 4 (g % 8) + c of part j = (g % 32) / 8 of half
// n = g / 32: bits 2j of byte 32n + l of the low bits (Q3_K's high bit: bit 4n + j of mask byte
// l), scale n * 8 + 2j + l / 16.
fn kquant_data_word(fmt: u32, g: u32, i: u32) -> u32 {
    let lw = g % 8u;
    switch fmt {
        case 7u: {
            let grp = (g % 32u) / 8u;
            return select((g / 32u) * 16u + (grp & 1u) * 8u + lw, 32u + (g / 32u) * 8u + lw, i == 1u);
        }
        case 11u: { return select(12u + (g / 16u) * 8u + lw, 4u + lw, i == 1u); }
        case 12u: { return select(8u + (g / 32u) * 8u + lw, lw, i == 1u); }
        case 13u: { return select(4u + (g / 32u) * 8u + lw, 0u, i == 1u); }
        case 14u: { return select(2u + (g / 8u) * 4u + g % 4u, 0u, i == 1u); }
        default: { return select(4u + (g / 16u) * 8u + lw, 0u, i == 1u); }
    }
}

// Word i of a, b, c, d.
fn pick4(a: u32, b: u32, c: u32, d: u32, i: u32) -> u32 {
    return select(select(a, b, i == 1u), select(c, d, i == 3u), i >= 2u);
}

// Weights 4g .. 4g + 3 of a block of 256 from its head slots h and data words q.
fn dequant_kq(fmt: u32, h: array<u32, KQ_HEAD>, q: vec2<u32>, g: u32) -> vec4<f32> {
    let shifts = vec4<u32>(0u, 8u, 16u, 24u);
    if fmt == 12u || fmt == 13u {
        let n = g / 32u;
        let j = (g % 32u) / 8u;
        let k = n * 8u + 2u * j + (g % 8u) / 4u;
        let low = (vec4<u32>(q.x) >> (shifts + 2u * j)) & vec4<u32>(3u);
        if fmt == 13u {
            // Q2_K: scale and min nibbles of byte k of the scales
            let dm = unpack2x16float(h[0]);
            let s = (pick4(h[1], h[2], h[3], h[4], k / 4u) >> (8u * (k % 4u))) & 0xffu;
            return fma(vec4<f32>(dm.x * f32(s & 15u)), vec4<f32>(low), vec4<f32>(-(dm.y * f32(s >> 4u))));
        }
        // Q3_K: minus 4 where the mask bit is clear; the 6-bit scale (low nibble of byte k % 8,
        // high bits at 2 (k / 4) of byte 8 + k % 4) minus 32
        let high = (vec4<u32>(q.y) >> (shifts + 4u * n + j)) & vec4<u32>(1u);
        let qv = vec4<i32>(low) - vec4<i32>(4) * (vec4<i32>(1) - vec4<i32>(high));
        let lows = select(h[1], h[2], k % 8u >= 4u);
        let sc = ((lows >> (8u * (k % 4u) + 4u * (k / 8u))) & 15u) | (((h[3] >> (8u * (k % 4u) + 2u * (k / 4u))) & 3u) << 4u);
        return vec4<f32>(unpack2x16float(h[0]).x * f32(i32(sc) - 32)) * vec4<f32>(qv);
    }
    if fmt == 14u {
        // IQ4_XS: block ib = g / 8 of 32, its 6-bit scale minus 32, then as IQ4_NL
        let ib = g / 8u;
        let ls = ((h[1] >> (4u * ib)) & 15u) | (((h[0] >> (16u + 2u * ib)) & 3u) << 4u);
        let nib = (vec4<u32>(q.x) >> (shifts + select(0u, 4u, g % 8u >= 4u))) & vec4<u32>(15u);
        return unpack2x16float(h[0]).x * f32(i32(ls) - 32) * iq4nl_values(nib);
    }
    if fmt == 6u || fmt == 11u {
        let dm = unpack2x16float(h[0]);
        let chunk = g / 16u;
        let hi = (g % 16u) >= 8u;
        let j = 2u * chunk + select(0u, 1u, hi);
        // sub-block j's 6-bit scale and min from the 12 scale bytes (slots 1..3), as llama.cpp packs them
        var sc: u32;
        var mn: u32;
        if j < 4u {
            sc = (h[1] >> (8u * j)) & 63u;  // byte j
            mn = (h[2] >> (8u * j)) & 63u;  // byte j + 4
        } else {
            let lo = (h[3] >> (8u * (j - 4u))) & 0xffu;        // byte j + 4
            let top_s = (h[1] >> (8u * (j - 4u) + 6u)) & 3u;   // byte j - 4, top bits
            let top_m = (h[2] >> (8u * (j - 4u) + 6u)) & 3u;   // byte j, top bits
            sc = (lo & 15u) | (top_s << 4u);
            mn = (lo >> 4u) | (top_m << 4u);
        }
        var qi = (vec4<u32>(q.x) >> (shifts + select(0u, 4u, hi))) & vec4<u32>(15u);
        if fmt == 11u {
            // Q5_K: sub-block j's fifth bits are bit j of each qh byte
            qi |= ((vec4<u32>(q.y) >> (shifts + j)) & vec4<u32>(1u)) << vec4<u32>(4u);
        }
        return fma(vec4<f32>(dm.x * f32(sc)), vec4<f32>(qi), vec4<f32>(-(dm.y * f32(mn))));
    }
    // Q6_K: 6-bit q - 32 times the i8 scale of its sub-block of 16
    let d = unpack2x16float(h[0]).x;
    let grp = (g % 32u) / 8u;
    let l = (g % 8u) * 4u;
    let low = (vec4<u32>(q.x) >> (shifts + (grp >> 1u) * 4u)) & vec4<u32>(15u);
    let high = (vec4<u32>(q.y) >> (shifts + 2u * grp)) & vec4<u32>(3u);
    let qv = vec4<i32>(low | (high << vec4<u32>(4u))) - vec4<i32>(32);
    let bi = (g / 32u) * 8u + l / 16u + 2u * grp;
    let word = pick4(h[1], h[2], h[3], h[4], bi / 4u);
    let scale = f32(bitcast<i32>(word << (24u - 8u * (bi % 4u))) >> 24u);
    return vec4<f32>(d * scale) * vec4<f32>(qv);
}

// Weights 4g .. 4g + 3 of a block of 32 from its head word and the word holding them.
fn dequant4(fmt: u32, head: u32, word: u32, g: u32) -> vec4<f32> {
    return dequant4_dm(fmt, unpack2x16float(head), word, g);
}

// dequant4 from the head's scale (and min) already unpacked: dm = unpack2x16float(head), for
// loops that take a block's weights 4 at a time and unpack its head once.
fn dequant4_dm(fmt: u32, dm: vec2<f32>, word: u32, g: u32) -> vec4<f32> {
    if fmt == 2u {
        let q = vec4<i32>(bitcast<i32>(word << 24u), bitcast<i32>(word << 16u), bitcast<i32>(word << 8u), bitcast<i32>(word)) >> vec4<u32>(24u);
        return dm.x * vec4<f32>(q);
    }
    let sh = select(0u, 4u, g >= 4u);
    let q = vec4<f32>((vec4<u32>(word) >> (vec4<u32>(0u, 8u, 16u, 24u) + sh)) & vec4<u32>(15u));
    if fmt == 3u {
        return dm.x * (q - 8.0);
    }
    return fma(vec4<f32>(dm.x), q, vec4<f32>(dm.y));
}

// Index of the word holding weights 4g .. 4g + 3 within a block of 32.
fn quant_word(fmt: u32, g: u32) -> u32 {
    if fmt == 8u || fmt == 9u { return 2u + g % 4u; }
    return select(1u + g % 4u, 1u + g, fmt == 2u);
}

// IQ4_NL's 16 values (llama.cpp's kvalues_iq4nl), as i8 packed four to a word: a nibble picks
// its word by two selects and its byte by a shift (no array in private memory, which lavapipe
// would copy per call).
fn iq4nl_values(n: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(iq4nl_values_i(n));
}

// iq4nl_values as integers (the integer-dot products take them as int8).
fn iq4nl_values_i(n: vec4<u32>) -> vec4<i32> {
    return nibble_table(n, vec4<u32>(0xbfad9881u, 0xf6eaddcfu, 0x26190d01u, 0x71594535u));
}

// MXFP4's 16 E2M1 values doubled (llama.cpp's kvalues_mxfp4: 0 1 2 3 4 6 8 12, then negated).
fn mxfp4_values(n: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(nibble_table(n, vec4<u32>(0x03020100u, 0x0c080604u, 0xfdfeff00u, 0xf4f8fafcu)));
}

// Entry n of a table of 16 i8 packed four to a word in `words` (entries 4i .. 4i + 3 in word i).
fn nibble_table(n: vec4<u32>, words: vec4<u32>) -> vec4<i32> {
    let b2 = (n & vec4<u32>(4u)) != vec4<u32>(0u);
    let b3 = (n & vec4<u32>(8u)) != vec4<u32>(0u);
    let low = select(vec4<u32>(words.x), vec4<u32>(words.y), b2);
    let high = select(vec4<u32>(words.z), vec4<u32>(words.w), b2);
    let word = select(low, high, b3);
    return bitcast<vec4<i32>>(word << (vec4<u32>(24u) - 8u * (n & vec4<u32>(3u)))) >> vec4<u32>(24u);
}

// Weights 4g .. 4g + 3 of a Q5_0 (8), Q5_1 (9) or IQ4_NL (10) block from its head's scale (and
// min), its fifth bits (word 1 of a Q5 block; unused for IQ4_NL) and the word holding their
// nibbles.
fn dequant_ext(fmt: u32, dm: vec2<f32>, qh: u32, word: u32, g: u32) -> vec4<f32> {
    let sh = select(0u, 4u, g >= 4u);
    let nib = (vec4<u32>(word) >> (vec4<u32>(0u, 8u, 16u, 24u) + sh)) & vec4<u32>(15u);
    if fmt == 10u {
        return dm.x * iq4nl_values(nib);
    }
    if fmt == 15u {
        return dm.x * mxfp4_values(nib);
    }
    // weight 4g + c has bit 4g + c of qh
    let hi = (vec4<u32>(qh) >> (vec4<u32>(0u, 1u, 2u, 3u) + 4u * g)) & vec4<u32>(1u);
    let q = vec4<f32>(nib | (hi << vec4<u32>(4u)));
    // Q5_0: (q - 16) d as one fma (16 d is exact, so the bits are those of (q - 16) * d)
    let m = select(dm.y, -16.0 * dm.x, fmt == 8u);
    return fma(q, vec4<f32>(dm.x), vec4<f32>(m));
}

// Blocks of 32 of any kind (dequant4 or dequant_ext).
fn is_block32(fmt: u32) -> bool {
    return (fmt >= 2u && fmt <= 4u) || is_ext32(fmt);
}

// Activations quantized for the integer-dot products (quantize.wgsl -> matmul_int.wgsl), per
// block of 32 features: the scale d (f32 bits), d * sum(q) (f32 bits), then q as 8 words of 4
// int8, feature 4i + j in byte j of word i (llama.cpp's q8_1 layout, in words).
const Q8_BLOCK_WORDS: u32 = 10u;

// One block of 32 features quantized: q = round(v / d), d = max |v| / 127 (llama.cpp's q8_1).
fn q8_block(v: array<vec4<f32>, 8>) -> array<u32, 10> {
    var amax = 0.0;
    for (var j = 0u; j < 8u; j++) {
        let a = abs(v[j]);
        amax = max(amax, max(max(a.x, a.y), max(a.z, a.w)));
    }
    let d = amax / 127.0;
    let inv = select(0.0, 1.0 / d, d > 0.0);
    var out: array<u32, 10>;
    var sum = 0i;
    for (var j = 0u; j < 8u; j++) {
        let q = clamp(vec4<i32>(round(v[j] * inv)), vec4<i32>(-127), vec4<i32>(127));
        sum += q.x + q.y + q.z + q.w;
        out[2u + j] = pack4xI8(q);
    }
    out[0] = bitcast<u32>(d);
    out[1] = bitcast<u32>(d * f32(sum));
    return out;
}
