"""PEFT adapter folders for SmolLM2-135M-Instruct (30 blocks, hidden 576, 9 heads over 3 KV heads
of 64), as scripts/test-openai.sh serves them: rank 4 on q_proj and v_proj (PEFT's default
targets for a Llama), lora_alpha 8, seeded normal values. Standard library only (the openai venv
has no numpy): the safetensors file is its 8-byte header length, JSON header and raw f32 bytes.

    python make_lora_adapters.py OUT_DIR NAME...      # OUT_DIR/NAME, seeded by NAME's position
"""
import json
import os
import random
import struct
import sys

LAYERS, HIDDEN, KV = 30, 576, 3 * 64
RANK = 4
OUT = {"q_proj": HIDDEN, "v_proj": KV}


def write(path, seed):
    rng = random.Random(seed)
    header, data = {}, bytearray()
    for layer in range(LAYERS):
        for proj, rows in OUT.items():
            for half, shape in (("A", [RANK, HIDDEN]), ("B", [rows, RANK])):
                n = shape[0] * shape[1]
                name = f"base_model.model.model.layers.{layer}.self_attn.{proj}.lora_{half}.weight"
                header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [len(data), len(data) + 4 * n]}
                data += struct.pack(f"<{n}f", *(rng.gauss(0.0, 0.08) for _ in range(n)))
    os.makedirs(path, exist_ok=True)
    head = json.dumps(header).encode()
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head + bytes(data))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK,
                   "target_modules": list(OUT), "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}, f)


if __name__ == "__main__":
    for i, name in enumerate(sys.argv[2:]):
        write(os.path.join(sys.argv[1], name), seed=i + 1)
