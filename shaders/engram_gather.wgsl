// Engram lookup: for each real token, the n-gram addresses (FNV-1a over compressed ids, seeded per
// head; a position before 0 holds token id 0, so its compressed id is cid_map[0], as in the seed)
// and the gathered table rows e_t. The ids of earlier
// positions come from the cache's token history (written at the end of every chunk), the ids of
// this chunk from the chunk itself: addresses are right across chunk boundaries, sub-batches and
// resets (a reset row has length 0, so nothing before the chunk is read).

override HEADS: u32;        // hash heads per order
override N_ORDERS: u32;     // number of n-gram orders
override TABLE_ROWS: u32;   // rows of each table
override DIM: u32;          // width of a table row (multiple of 4)
override MAX_LEN: u32;      // history row length - 1
override WG: u32 = 64u;

@group(0) @binding(0) var<uniform> step: Step;
@group(0) @binding(1) var<storage, read> rows: array<RowInfo>;          // [R]
@group(0) @binding(2) var<storage, read> ids: array<u32>;               // [R * C]
@group(0) @binding(3) var<storage, read> history: array<u32>;           // [rows, MAX_LEN + 1]
@group(0) @binding(4) var<storage, read> cid_map: array<u32>;           // [vocab]
@group(0) @binding(5) var<storage, read> orders: array<u32>;            // [N_ORDERS]
@group(0) @binding(6) var<storage, read> tables: array<vec4<f32>>;      // [N_ORDERS * HEADS, TABLE_ROWS, DIM]
@group(0) @binding(7) var<storage, read_write> e_out: array<vec4<f32>>; // [R * C, N_ORDERS * HEADS * DIM]

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let idx = gid.x + gid.y * nwg.x * WG;  // 2D grids for more than 65535 workgroups
    let d4n = DIM / 4u;
    let per_token = N_ORDERS * HEADS * d4n;
    let n = idx / per_token;
    let k = (idx % per_token) / d4n;   // table index: order-major, then head
    let d4 = idx % d4n;
    if n >= step.tokens { return; }
    let r = n / step.width;
    let jt = n % step.width;
    let info = rows[r];
    if jt >= info.n_new { return; }
    let pos = i32(info.pos0 + jt);
    let order = i32(orders[k / HEADS]);
    var h = 0x811C9DC5u + (k % HEADS) * 0x9E3779B9u;
    for (var q = pos - order + 1; q <= pos; q++) {
        var c = cid_map[0];  // before the row's start: token id 0
        if q >= i32(info.pos0) {
            c = cid_map[ids[r * step.width + u32(q) - info.pos0]];
        } else if q >= 0 {
            c = cid_map[history[info.cache_row * (MAX_LEN + 1u) + u32(q)]];
        }
        h = (h ^ c) * 0x01000193u;
    }
    let addr = h % TABLE_ROWS;
    e_out[n * per_token + k * d4n + d4] = tables[(k * TABLE_ROWS + addr) * d4n + d4];
}
