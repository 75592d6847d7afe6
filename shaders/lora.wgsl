// LoRA adapters applied unmerged: for each token whose row names an adapter slot,
//   y[n, Y_OFFSET + o] += scale_t * B_t[o] . (A_t x[n])
// for the outputs o of this dispatch's targets, after the base product wrote y (one input and one
// output buffer: q, k and v of a block into `qkv`; k and v into the local K/V; o; gate and up;
// down). The base weights are never touched, and a row without an adapter is not written, so its
// bits are the base model's.
//
// A workgroup is one token and a tile of outputs. It first computes the token's A x for every
// target of the dispatch into workgroup memory, 8 ranks at a time: each lane sums the inputs
// four at a time, k = 4 lane, 4 (lane + WG), ... in order (neighbouring lanes read neighbouring
// vec4s; every input width is a multiple of 4), its four sums added last as (x + y) + (z + w),
// then one lane per rank adds the WG lanes' sums in lane order. Then each lane sums OUTS_PER_LANE
// outputs over the rank in order (B as PEFT stores it, an output's rank values side by side: a
// trainer's push is written as it comes; four at a time where the module's rank is a multiple of
// 4). Every sum has a fixed order that depends on nothing but the shapes and the module's rank: a
// row's bits are the same in any batch, with any adapters beside it, in any chunking.
//
// The vec4 reads are why: a CPU adapter (lavapipe) gathers a lane's loads one by one, and a GPU
// coalesces 16-byte loads, so four values a load cost a third of the loads of one a load. With
// AB_HALF the values are halves (EngineOptions::lora_dtype): the same sums of the rounded values.

override K: u32;              // input features
override X_STRIDE: u32;       // floats per token row of x
override Y_STRIDE: u32;       // floats per token row of y
override Y_OFFSET: u32;       // y column of this dispatch's first output
override OUTS: u32;           // outputs of this dispatch: its targets' rows
override TARGETS: u32;        // targets of this dispatch (1 to 3)
override ROWS_FIRST: u32;     // rows of its first target
override ROWS_REST: u32 = 1u; // rows of each later target (k and v, gate and up are alike)
override T_FIRST: u32;        // the group's index of this dispatch's first target
override GROUP_TARGETS: u32;  // targets of the group (its A blocks come before its B rows)
override B_ROW0: u32;         // the group's B row of this dispatch's first output
override MAX_RANK: u32;       // ranks each slot holds room for (a multiple of 8, at most 256)
override SLOT_FLOATS: u32;    // floats per adapter slot in `ab`
override META0: u32;          // meta entry of (this layer, slot 0, the group's first target)
override OUTS_PER_LANE: u32 = 16u;
override WG: u32 = 64u;
override AB_HALF: bool = false;  // A and B as halves, two to a u32 (EngineOptions::lora_dtype)

const NO_ADAPTER: u32 = 0xffffffffu;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<storage, read> row_info: array<RowInfo>;   // [R]
@group(0) @binding(2) var<storage, read> x: array<f32>;              // [R * C, X_STRIDE]
@group(0) @binding(3) var<storage, read_write> y: array<f32>;        // [R * C, Y_STRIDE]
// per slot: A [GROUP_TARGETS, MAX_RANK, K], then per target room for B [its rows, MAX_RANK],
// holding [its rows, rank] at the module's own rank
// as u32s: f32 bits, or two halves each (AB_HALF). SLOT_FLOATS and MAX_RANK are multiples of 8
// and K of 4, so every slot and A row starts on a whole vec4 of values, and so does every B row
// of a rank a multiple of 4.
@group(0) @binding(4) var<storage, read> ab: array<vec4<u32>>;       // [slots, SLOT_FLOATS / 4 or / 8]
@group(0) @binding(5) var<storage, read> lora_meta: array<vec2<u32>>;     // [layers, slots, 7]: rank, scale bits

// A whole number of them fits MAX_RANK, so every lane runs the same fixed loop (its sums stay in
// registers) and reads only a slot's own rows; sums past the adapter's rank are dropped.
const RANKS_AT_ONCE: u32 = 8u;

// A x of each target: [TARGETS, MAX_RANK] (3 targets of rank 256 at most), as vec4s of ranks
var<workgroup> ax: array<vec4<f32>, 192>;
// each lane's sums for RANKS_AT_ONCE ranks: [RANKS_AT_ONCE, WG] (WG at most 64)
var<workgroup> partial: array<f32, 512>;
// the token's slot and its targets' ranks, read by one lane for the whole workgroup
var<workgroup> head: vec4<u32>;

// Values `i .. i + 4` of `ab` (i a multiple of 4).
fn ab4(i: u32) -> vec4<f32> {
    if AB_HALF {
        let w = ab[i / 8u];
        let pair = select(w.xy, w.zw, (i / 4u) % 2u == 1u);
        return vec4<f32>(unpack2x16float(pair.x), unpack2x16float(pair.y));
    }
    return bitcast<vec4<f32>>(ab[i / 4u]);
}

// Value `i` of `ab` (B rows of ranks not a multiple of 4).
fn ab1(i: u32) -> f32 {
    if AB_HALF {
        return unpack2x16float(ab[i / 8u][(i / 2u) % 4u])[i % 2u];
    }
    return bitcast<f32>(ab[i / 4u][i % 4u]);
}

// The rows of the dispatch's target i, and how many of its outputs come before them.
fn target_rows(i: u32) -> vec2<u32> {
    if i == 0u { return vec2<u32>(ROWS_FIRST, 0u); }
    return vec2<u32>(ROWS_REST, ROWS_FIRST + (i - 1u) * ROWS_REST);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let n = wid.y + wid.z * 65535u;
    let r = n / step.width;
    if r >= step.rows { return; }
    if lane == 0u {
        var h = vec4<u32>(NO_ADAPTER, 0u, 0u, 0u);
        let info = row_info[r];
        if n % step.width < info.n_new && info.lora != NO_ADAPTER {
            let e = META0 + info.lora * 7u + T_FIRST;
            let last = TARGETS - 1u;
            h = vec4<u32>(info.lora, lora_meta[e].x, lora_meta[e + min(1u, last)].x, lora_meta[e + min(2u, last)].x);
        }
        head = h;
    }
    // one value for the whole workgroup, as its barriers need (WGSL's uniformity rules, which
    // Chromium enforces: a rank read from storage would make them non-uniform): padding and rows
    // on the base model leave together
    let h = workgroupUniformLoad(&head);
    let slot = h.x;
    if slot == NO_ADAPTER { return; }
    let base = slot * SLOT_FLOATS;
    let entry = META0 + slot * 7u + T_FIRST;
    let x0 = n * X_STRIDE;
    for (var i = 0u; i < TARGETS; i++) {
        let rank = h[i + 1u];
        for (var j0 = 0u; j0 < rank; j0 += RANKS_AT_ONCE) {
            let a0 = base + ((T_FIRST + i) * MAX_RANK + j0) * K;
            let count = min(RANKS_AT_ONCE, rank - j0);
            // initialised here, explicitly: Chromium (Tint) zeroed an uninitialised one only once,
            // so the second group of ranks started from the first one's sums
            var acc = array<vec4<f32>, RANKS_AT_ONCE>();
            for (var k4 = lane; k4 < K / 4u; k4 += WG) {
                let k = 4u * k4;
                let v = vec4<f32>(x[x0 + k], x[x0 + k + 1u], x[x0 + k + 2u], x[x0 + k + 3u]);
                for (var c = 0u; c < RANKS_AT_ONCE; c++) {
                    acc[c] = fma(ab4(a0 + c * K + k), v, acc[c]);
                }
            }
            for (var c = 0u; c < RANKS_AT_ONCE; c++) {
                partial[c * WG + lane] = (acc[c].x + acc[c].y) + (acc[c].z + acc[c].w);
            }
            workgroupBarrier();
            if lane < count {
                var sum = 0.0;
                for (var l = 0u; l < WG; l++) {
                    sum += partial[lane * WG + l];
                }
                let at = i * MAX_RANK + j0 + lane;
                ax[at / 4u][at % 4u] = sum;
            }
            workgroupBarrier();
        }
    }
    let a_floats = GROUP_TARGETS * MAX_RANK * K;
    for (var t = 0u; t < OUTS_PER_LANE; t++) {
        let o = (wid.x * OUTS_PER_LANE + t) * WG + lane;  // neighbouring lanes, neighbouring outputs
        if o >= OUTS { break; }
        var i = 0u;
        if o >= ROWS_FIRST { i = 1u + (o - ROWS_FIRST) / ROWS_REST; }
        let m = lora_meta[entry + i];
        if m.x == 0u { continue; }  // this adapter leaves the target alone
        let rows = target_rows(i);
        let b0 = base + a_floats + (B_ROW0 + rows.y) * MAX_RANK + (o - rows.y) * m.x;
        var acc = 0.0;
        if m.x % 4u == 0u {
            var acc4 = vec4<f32>(0.0);
            for (var j4 = 0u; j4 < m.x / 4u; j4++) {
                acc4 = fma(ab4(b0 + 4u * j4), ax[i * (MAX_RANK / 4u) + j4], acc4);
            }
            acc = (acc4.x + acc4.y) + (acc4.z + acc4.w);
        } else {
            for (var j = 0u; j < m.x; j++) {
                let at = i * MAX_RANK + j;
                acc = fma(ab1(b0 + j), ax[at / 4u][at % 4u], acc);
            }
        }
        let at = n * Y_STRIDE + Y_OFFSET + o;
        y[at] = fma(bitcast<f32>(m.y), acc, y[at]);  // fma: see dot_fma in common.wgsl
    }
}
