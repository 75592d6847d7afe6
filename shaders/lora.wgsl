// LoRA adapters applied unmerged: for each token whose row names an adapter slot,
//   y[n, Y_OFFSET + o] += scale_t * B_t[o] . (A_t x[n])
// for the outputs o of this dispatch's targets, after the base product wrote y (one input and one
// output buffer: q, k and v of a block into `qkv`; k and v into the local K/V; o; gate and up;
// down). The base weights are never touched, and a row without an adapter is not written, so its
// bits are the base model's.
//
// A workgroup is one token and a tile of outputs. It first computes the token's A x for every
// target of the dispatch into workgroup memory (a lane per (target, rank) entry, each a serial sum
// over the input in order), then each lane sums OUTS_PER_LANE outputs over the rank in order.
// Nothing depends on the step's other tokens or on the grid: a row's bits are the same in any
// batch, with any adapters beside it, in any chunking.

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
override MAX_RANK: u32;       // ranks each slot holds room for (at most 256)
override SLOT_FLOATS: u32;    // floats per adapter slot in `ab`
override META0: u32;          // meta entry of (this layer, slot 0, the group's first target)
override OUTS_PER_LANE: u32 = 4u;
override WG: u32 = 64u;

const NO_ADAPTER: u32 = 0xffffffffu;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<storage, read> row_info: array<RowInfo>;   // [R]
@group(0) @binding(2) var<storage, read> x: array<f32>;              // [R * C, X_STRIDE]
@group(0) @binding(3) var<storage, read_write> y: array<f32>;        // [R * C, Y_STRIDE]
// per slot: A [GROUP_TARGETS, MAX_RANK, K], then B [the group's rows, MAX_RANK]
@group(0) @binding(4) var<storage, read> ab: array<f32>;             // [slots, SLOT_FLOATS]
@group(0) @binding(5) var<storage, read> lora_meta: array<vec2<u32>>;     // [layers, slots, 7]: rank, scale bits

// A x of each target: [TARGETS, MAX_RANK] (3 targets of rank 256 at most)
var<workgroup> ax: array<f32, 768>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let n = wid.y + wid.z * 65535u;
    let r = n / step.width;
    // the whole workgroup leaves together: padding, and rows on the base model
    if r >= step.rows || n % step.width >= row_info[r].n_new { return; }
    let slot = row_info[r].lora;
    if slot == NO_ADAPTER { return; }
    let base = slot * SLOT_FLOATS;
    let entry = META0 + slot * 7u + T_FIRST;
    let x0 = n * X_STRIDE;
    for (var e = lane; e < TARGETS * MAX_RANK; e += WG) {
        let i = e / MAX_RANK;
        let j = e % MAX_RANK;
        if j < lora_meta[entry + i].x {
            let a0 = base + ((T_FIRST + i) * MAX_RANK + j) * K;
            var acc = 0.0;
            for (var k = 0u; k < K; k++) {
                acc = fma(ab[a0 + k], x[x0 + k], acc);
            }
            ax[e] = acc;
        }
    }
    workgroupBarrier();
    for (var t = 0u; t < OUTS_PER_LANE; t++) {
        let o = (wid.x * OUTS_PER_LANE + t) * WG + lane;  // neighbouring lanes, neighbouring outputs
        if o >= OUTS { break; }
        var i = 0u;
        if o >= ROWS_FIRST { i = 1u + (o - ROWS_FIRST) / ROWS_REST; }
        let m = lora_meta[entry + i];
        if m.x == 0u { continue; }  // this adapter leaves the target alone
        let b0 = base + GROUP_TARGETS * MAX_RANK * K + (B_ROW0 + o) * MAX_RANK;
        var acc = 0.0;
        for (var j = 0u; j < m.x; j++) {
            acc = fma(ab[b0 + j], ax[i * MAX_RANK + j], acc);
        }
        let at = n * Y_STRIDE + Y_OFFSET + o;
        y[at] = fma(bitcast<f32>(m.y), acc, y[at]);  // fma: see dot_fma in common.wgsl
    }
}
