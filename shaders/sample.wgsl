// Sampling, one workgroup per chunk row: argmax of logits (greedy, temperature 0) or of
// logits / T + Gumbel noise (exactly a draw from softmax(logits / T)). The noise is a hash of
// (seed, counter, token id), so a row's draw depends only on its own seed and counter: the same
// seed gives the same tokens whatever else shares the batch. Ties go to the lowest id, like argmax.
// Rows with no new tokens in this chunk keep their previous id.

struct Sampler {
    temperature: f32,  // <= 0: greedy
    seed: u32,
    counter: u32,      // the position the sampled token will take
    _pad: u32,
}

override V: u32;           // vocabulary size
const WG: u32 = 256u;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<storage, read> rows: array<RowInfo>;      // [R]
@group(0) @binding(2) var<storage, read> samplers: array<Sampler>;  // [R]
@group(0) @binding(3) var<storage, read> logits: array<f32>;        // [R, V]
@group(0) @binding(4) var<storage, read_write> out_ids: array<u32>; // [R]

var<workgroup> best_v: array<f32, WG>;
var<workgroup> best_i: array<u32, WG>;

fn pcg(v: u32) -> u32 {
    let s = v * 747796405u + 2891336453u;
    let w = ((s >> ((s >> 28u) + 4u)) ^ s) * 277803737u;
    return (w >> 22u) ^ w;
}

// uniform in (0, 1) from 24 hashed bits
fn uniform01(seed: u32, counter: u32, id: u32) -> f32 {
    let h = pcg(pcg(pcg(seed) ^ counter) ^ id);
    return (f32(h >> 8u) + 0.5) / 16777216.0;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let r = wid.x;
    let t = lid.x;
    let s = samplers[r];
    var bv = -3.4e38;
    var bi = 0xffffffffu;
    for (var i = t; i < V; i += WG) {
        var v = logits[r * V + i];
        if s.temperature > 0.0 {
            v = v / s.temperature - log(-log(uniform01(s.seed, s.counter, i)));
        }
        if v > bv { bv = v; bi = i; }
    }
    best_v[t] = bv;
    best_i[t] = bi;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if t < stride {
            let ov = best_v[t + stride];
            let oi = best_i[t + stride];
            if ov > best_v[t] || (ov == best_v[t] && oi < best_i[t]) {
                best_v[t] = ov;
                best_i[t] = oi;
            }
        }
        workgroupBarrier();
    }
    if t == 0u && r < step.rows && rows[r].n_new > 0u {
        out_ids[r] = best_i[0];
    }
}
