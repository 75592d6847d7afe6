// Prepended to every kernel by `src/shaders.rs` (the one mechanism for shared WGSL code).
// Only types and functions live here: bindings and override constants belong to each kernel.

// Written once per chunk: the shape of the right-padded chunk being appended.
struct Step {
    rows: u32,    // R: rows in this chunk (the sub-batch), row r is chunk row, not cache row
    width: u32,   // C: token slots per row (right-padded)
    tokens: u32,  // R * C: token index n = r * C + j
    _pad: u32,
}

// One per chunk row; written by the host from its CPU mirror of the lengths.
struct RowInfo {
    cache_row: u32,  // the cache row this chunk row reads and writes
    n_new: u32,      // real tokens of this row in this chunk (j < n_new is real, the rest is padding)
    pos0: u32,       // lens[cache_row] before this chunk: token j sits at position pos0 + j
    _pad: u32,
}

// f16 values are stored two per u32 word (portable: no `shader-f16` needed).
fn round_to_f16(v: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(pack2x16float(v.xy)), unpack2x16float(pack2x16float(v.zw)));
}

// tanh that stays finite for large arguments on every backend.
fn safe_tanh(x: f32) -> f32 {
    return tanh(clamp(x, -15.0, 15.0));
}
