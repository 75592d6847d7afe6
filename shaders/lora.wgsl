// LoRA adapters applied unmerged: for each token whose row names an adapter slot,
//   y[n, Y_OFFSET + o] += scale_t * B_t[o] . (A_t x[n])
// for the outputs o of this dispatch's targets, after the base product wrote y (one input and one
// output buffer: q, k and v of a block into `qkv`; k and v into the local K/V; o; gate and up;
// down). The base weights are never touched, and a row without an adapter is not written, so its
// bits are the base model's.
//
// A workgroup is one token and a tile of outputs. It first computes the token's A x for every
// target of the dispatch into workgroup memory, 8 ranks at a time: each lane sums the inputs
// k = lane, lane + WG, ... in order (neighbouring lanes read neighbouring values), then one lane
// per rank adds the WG lanes' sums in lane order. Then each lane sums OUTS_PER_LANE outputs over
// the rank in order (B as PEFT stores it, an output's rank values side by side: a trainer's push
// is written as it comes). Every sum has a fixed order that depends on nothing but the shapes: a
// row's bits are the same in any batch, with any adapters beside it, in any chunking.

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

const NO_ADAPTER: u32 = 0xffffffffu;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<storage, read> row_info: array<RowInfo>;   // [R]
@group(0) @binding(2) var<storage, read> x: array<f32>;              // [R * C, X_STRIDE]
@group(0) @binding(3) var<storage, read_write> y: array<f32>;        // [R * C, Y_STRIDE]
// per slot: A [GROUP_TARGETS, MAX_RANK, K], then per target room for B [its rows, MAX_RANK],
// holding [its rows, rank] at the module's own rank
@group(0) @binding(4) var<storage, read> ab: array<f32>;             // [slots, SLOT_FLOATS]
@group(0) @binding(5) var<storage, read> lora_meta: array<vec2<u32>>;     // [layers, slots, 7]: rank, scale bits

// A whole number of them fits MAX_RANK, so every lane runs the same fixed loop (its sums stay in
// registers) and reads only a slot's own rows; sums past the adapter's rank are dropped.
const RANKS_AT_ONCE: u32 = 8u;

// A x of each target: [TARGETS, MAX_RANK] (3 targets of rank 256 at most)
var<workgroup> ax: array<f32, 768>;
// each lane's sums for RANKS_AT_ONCE ranks: [RANKS_AT_ONCE, WG] (WG at most 64)
var<workgroup> partial: array<f32, 512>;
// the token's slot and its targets' ranks, read by one lane for the whole workgroup
var<workgroup> head: vec4<u32>;

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
            var acc = array<f32, RANKS_AT_ONCE>();
            for (var k = lane; k < K; k += WG) {
                let v = x[x0 + k];
                for (var c = 0u; c < RANKS_AT_ONCE; c++) {
                    acc[c] = fma(ab[a0 + c * K + k], v, acc[c]);
                }
            }
            for (var c = 0u; c < RANKS_AT_ONCE; c++) {
                partial[c * WG + lane] = acc[c];
            }
            workgroupBarrier();
            if lane < count {
                var sum = 0.0;
                for (var l = 0u; l < WG; l++) {
                    sum += partial[lane * WG + l];
                }
                ax[i * MAX_RANK + j0 + lane] = sum;
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
        for (var j = 0u; j < m.x; j++) {
            acc = fma(ab[b0 + j], ax[i * MAX_RANK + j], acc);
        }
        let at = n * Y_STRIDE + Y_OFFSET + o;
        y[at] = fma(bitcast<f32>(m.y), acc, y[at]);  // fma: see dot_fma in common.wgsl
    }
}
