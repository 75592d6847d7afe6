"""Cut a GGUF to its header (metadata + tensor infos) and, elsewhere, grow it back with random
weights of the same types and shapes: the file then loads in llama.cpp and kvdecode alike and runs
at the real model's speed, while only its header (a few MB) has to travel.

  python3 scripts/gguf-skeleton.py cut  model.gguf skeleton.bin
  python3 scripts/gguf-skeleton.py grow skeleton.bin model.gguf     (needs numpy; seeded, so every
  machine grows the same weights)
"""
import struct, sys

SIZES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34), 12: (256, 144), 14: (256, 210)}


def parse(buf):
    pos = 0

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from("<" + fmt, buf, pos)
        pos += struct.calcsize("<" + fmt)
        return v[0]

    def string():
        nonlocal pos
        n = take("Q")
        s = bytes(buf[pos:pos + n]).decode("utf-8", "replace")
        pos += n
        return s

    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def value(t):
        if t in scalar:
            return take(scalar[t])
        if t == 8:
            return string()
        if t == 9:
            it, n = take("I"), take("Q")
            return [value(it) for _ in range(n)]
        raise SystemExit(f"unknown GGUF value type {t}")

    assert bytes(buf[:4]) == b"GGUF"
    pos = 4
    take("I")
    n_tensors, n_kv = take("Q"), take("Q")
    align = 32
    for _ in range(n_kv):
        k = string()
        v = value(take("I"))
        if k == "general.alignment":
            align = v
    tensors = []
    for _ in range(n_tensors):
        name = string()
        dims = [take("Q") for _ in range(take("I"))]
        ty, off = take("I"), take("Q")
        tensors.append((name, dims, ty, off))
    start = (pos + align - 1) // align * align
    return start, tensors


def nbytes(dims, ty):
    n = 1
    for d in dims:
        n *= d
    per, size = SIZES[ty]
    return n // per * size


if sys.argv[1] == "cut":
    buf = open(sys.argv[2], "rb").read()
    start, tensors = parse(buf)
    total = max(off + nbytes(d, t) for _, d, t, off in tensors)
    open(sys.argv[3], "wb").write(buf[:start])
    print(f"header {start} bytes, {len(tensors)} tensors, data {total} bytes, types {sorted({t for *_, t, _ in tensors})}")
else:
    import numpy as np

    head = open(sys.argv[2], "rb").read()
    start, tensors = parse(head)
    rng = np.random.default_rng(0)
    total = max(off + nbytes(d, t) for _, d, t, off in tensors)
    data = np.zeros(total, np.uint8)
    for name, dims, ty, off in tensors:
        n = nbytes(dims, ty)
        count = n // SIZES[ty][1]
        if ty == 0:  # norms: near 1
            v = (1 + 0.05 * rng.standard_normal(count)).astype("<f4")
        elif ty == 1:
            v = (0.02 * rng.standard_normal(count)).astype("<f2")
        elif ty in (2, 3, 8):  # 32-blocks: f16 scale (and min), then quants
            per = SIZES[ty][1]
            v = rng.integers(0, 256, size=(count, per), dtype=np.uint8)
            d = (0.002 + 0.004 * rng.random(count)).astype("<f2")
            v[:, 0:2] = d.view(np.uint8).reshape(count, 2)
            if ty == 3:
                m = (-8 * d.astype(np.float32)).astype("<f2")
                v[:, 2:4] = m.view(np.uint8).reshape(count, 2)
        elif ty in (12, 14):  # 256-blocks: random quants and scales, f16 super-block scales
            v = rng.integers(0, 256, size=(count, SIZES[ty][1]), dtype=np.uint8)
            d = (0.0005 + 0.001 * rng.random((count, 2))).astype("<f2")
            at = 0 if ty == 12 else 208  # Q4_K: d, dmin first; Q6_K: d last
            width = 4 if ty == 12 else 2
            v[:, at:at + width] = d.view(np.uint8).reshape(count, 4)[:, :width]
        else:
            raise SystemExit(f"{name}: type {ty} not filled by this script")
        data[off:off + n] = np.frombuffer(v.tobytes(), np.uint8)
    with open(sys.argv[3], "wb") as f:
        f.write(head)
        f.write(data.tobytes())
    print(f"wrote {start + total} bytes")
