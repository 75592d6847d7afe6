// End of a chunk: record what the chunk stored, after every layer has read the old state.
//   tokens history: id of token j at position pos0 + j (padding: scratch position max_len)
//   lpos: ring slot p % RING now holds position p, for the last RING real tokens of the row
//   lens: lens[row] = pos0 + n_new (the GPU copy of the CPU mirror)

override MAX_LEN: u32;
override RING: u32 = 1u;        // ring slots (lpos has RING + 1 entries per row)
override HAS_RING: bool = false;
override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<storage, read> rows: array<RowInfo>;        // [R]
@group(0) @binding(2) var<storage, read> ids: array<u32>;             // [R * C]
@group(0) @binding(3) var<storage, read_write> history: array<u32>;   // [rows, max_len + 1]
@group(0) @binding(4) var<storage, read_write> lpos: array<i32>;      // [rows, RING + 1]
@group(0) @binding(5) var<storage, read_write> lens: array<u32>;      // [rows]

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = gid.x + gid.y * nwg.x * WG;  // 2D grids for more than 65535 workgroups
    let n = idx;
    if n >= step.tokens { return; }
    let r = n / step.width;
    let j = n % step.width;
    let info = rows[r];
    let new_len = info.pos0 + info.n_new;
    if j == 0u && info.n_new > 0u { lens[info.cache_row] = new_len; }
    if j >= info.n_new {
        history[info.cache_row * (MAX_LEN + 1u) + MAX_LEN] = ids[n];
        return;
    }
    let pos = info.pos0 + j;
    history[info.cache_row * (MAX_LEN + 1u) + pos] = ids[n];
    if HAS_RING && pos + RING >= new_len {
        lpos[info.cache_row * (RING + 1u) + pos % RING] = i32(pos);
    }
}
