// LoRA adapters applied unmerged: for each token whose row names an adapter slot,
//   y[n, Y_OFFSET + o] += scale_t * B_t[o] . (A_t x[n])
// for the outputs o of this dispatch's targets, after the base product wrote y (one input and one
// output buffer: q, k and v of a block into `qkv`; k and v into the local K/V; o; gate and up;
// down). The base weights are never touched, and a row without an adapter is not written, so its
// bits are the base model's.
//
// A workgroup is one token and a tile of outputs. It first computes the token's A x for every
// target of the dispatch into workgroup memory, a lane per (target, rank): the lane sums its row
// of A against x over every input, four at a time in order (every input width is a multiple of
// 4), the four sums added last as (x + y) + (z + w). Then, target by target, each lane sums its
// outputs of the target over the rank in order (B as PEFT stores it, an output's rank values side
// by side: a trainer's push is written as it comes; four at a time where the module's rank is a
// multiple of 4). Every sum has a fixed order that depends on nothing but the shapes and the
// module's rank: a row's bits are the same in any batch, with any adapters beside it, in any
// chunking.
//
// Why this shape: a CPU adapter (lavapipe) gathers a lane's loads one by one, and a GPU coalesces
// 16-byte loads, so values are read four at a time (A, B and x); what the whole workgroup reads
// (x in the A sums; a target's rank, scale and A x in the B sums) has one address for all lanes;
// and no lane waits on another's partial sums (an earlier form split the inputs over the lanes and
// summed their 64 partials through workgroup memory, with two barriers per 8 ranks: lavapipe spent
// a quarter more time in this kernel). With AB_HALF the values are halves
// (EngineOptions::lora_dtype): the same sums of the rounded values.

override K: u32;              // input features
override X_STRIDE: u32;       // floats per token row of x
override Y_STRIDE: u32;       // floats per token row of y
override Y_OFFSET: u32;       // y column of this dispatch's first output
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
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;        // [R * C, X_STRIDE / 4]
@group(0) @binding(3) var<storage, read_write> y: array<f32>;        // [R * C, Y_STRIDE]
// per slot: A [GROUP_TARGETS, MAX_RANK, K], then per target room for B [its rows, MAX_RANK],
// holding [its rows, rank] at the module's own rank
// as u32s: f32 bits, or two halves each (AB_HALF). SLOT_FLOATS and MAX_RANK are multiples of 8
// and K of 4, so every slot and A row starts on a whole vec4 of values, and so does every B row
// of a rank a multiple of 4.
@group(0) @binding(4) var<storage, read> ab: array<vec4<u32>>;       // [slots, SLOT_FLOATS / 4 or / 8]
@group(0) @binding(5) var<storage, read> lora_meta: array<vec2<u32>>;     // [layers, slots, 7]: rank, scale bits

// A x of each target: [TARGETS, MAX_RANK] (3 targets of rank 256 at most), as vec4s of ranks
var<workgroup> ax: array<vec4<f32>, 192>;
// the token's slot and its targets' ranks, then their scales' bits, read by one lane for the
// whole workgroup
var<workgroup> head: vec4<u32>;
var<workgroup> scales: vec4<u32>;

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
        var s = vec4<u32>(0u);
        let info = row_info[r];
        if n % step.width < info.n_new && info.lora != NO_ADAPTER {
            let e = META0 + info.lora * 7u + T_FIRST;
            // targets past the dispatch's have rank 0
            let last = TARGETS - 1u;
            let m = array<vec2<u32>, 3>(lora_meta[e], lora_meta[e + min(1u, last)], lora_meta[e + min(2u, last)]);
            h = vec4<u32>(info.lora, m[0].x, select(0u, m[1].x, TARGETS > 1u), select(0u, m[2].x, TARGETS > 2u));
            s = vec4<u32>(m[0].y, m[1].y, m[2].y, 0u);
        }
        head = h;
        scales = s;
    }
    // one value for the whole workgroup, as its barriers need (WGSL's uniformity rules, which
    // Chromium enforces: a rank read from storage would make them non-uniform): padding and rows
    // on the base model leave together
    let h = workgroupUniformLoad(&head);
    let scale_bits = workgroupUniformLoad(&scales);
    let slot = h.x;
    if slot == NO_ADAPTER { return; }
    let base = slot * SLOT_FLOATS;
    let x0 = n * (X_STRIDE / 4u);
    // A x, a lane per (target, rank): each sums its row of A against the token's x over every
    // input, four at a time in order; x's address is the workgroup's, so all lanes share its load
    for (var p = lane; p < h.y + h.z + h.w; p += WG) {
        var i = 0u;
        var j = p;
        if j >= h.y {
            i = 1u;
            j -= h.y;
            if j >= h.z {
                i = 2u;
                j -= h.z;
            }
        }
        let a0 = base + ((T_FIRST + i) * MAX_RANK + j) * K;
        var acc = vec4<f32>(0.0);
        for (var k4 = 0u; k4 < K / 4u; k4++) {
            acc = fma(ab4(a0 + 4u * k4), x[x0 + k4], acc);
        }
        let at = i * MAX_RANK + j;
        ax[at / 4u][at % 4u] = (acc.x + acc.y) + (acc.z + acc.w);
    }
    workgroupBarrier();
    // B, target by target: its rank, scale and `A x` are the workgroup's (one load each, not one
    // a lane), and each lane sums the outputs of its own that the target has
    let a_floats = GROUP_TARGETS * MAX_RANK * K;
    for (var i = 0u; i < TARGETS; i++) {
        let rank = h[i + 1u];
        if rank == 0u { continue; }  // this adapter leaves the target alone
        let scale = bitcast<f32>(scale_bits[i]);
        let rows = target_rows(i);
        let b_target = base + a_floats + (B_ROW0 + rows.y) * MAX_RANK;
        let ax0 = i * (MAX_RANK / 4u);
        for (var t = 0u; t < OUTS_PER_LANE; t++) {
            let o = (wid.x * OUTS_PER_LANE + t) * WG + lane;  // neighbouring lanes, neighbouring outputs
            if o >= rows.y + rows.x { break; }
            if o < rows.y { continue; }
            let b0 = b_target + (o - rows.y) * rank;
            var acc = 0.0;
            if rank % 4u == 0u {
                var acc4 = vec4<f32>(0.0);
                for (var j4 = 0u; j4 < rank / 4u; j4++) {
                    acc4 = fma(ab4(b0 + 4u * j4), ax[ax0 + j4], acc4);
                }
                acc = (acc4.x + acc4.y) + (acc4.z + acc4.w);
            } else {
                for (var j = 0u; j < rank; j++) {
                    let at = i * MAX_RANK + j;
                    acc = fma(ab1(b0 + j), ax[at / 4u][at % 4u], acc);
                }
            }
            let at = n * Y_STRIDE + Y_OFFSET + o;
            y[at] = fma(scale, acc, y[at]);  // fma: see dot_fma in common.wgsl
        }
    }
}
