"""SmolLM2-135M-Instruct (Q4_1 GGUF, fetched by scripts/fetch-smollm2.sh): a rollout loop written
in the seed's calling pattern gives the same tokens as the Rust API (`kvdecode generate`, the
continuous-batching scheduler) with the same seeds, though the two batch and chunk differently."""

import json
import os
import subprocess
from pathlib import Path

import numpy as np

import kvdecode

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf"
CLI = Path(os.environ.get("KVDECODE_CLI", ROOT / "target/release/kvdecode"))


def test_seed_loop_equals_rust_generate(tmp_path):
    assert MODEL.exists(), f"{MODEL} is missing: bash scripts/fetch-smollm2.sh"
    assert CLI.exists(), f"{CLI} is missing: cargo build --release -p kvdecode-cli"
    model = kvdecode.load(MODEL)
    tok = model.tokenizer
    questions = ["What is 2+2?", "Name a colour.", "Say hello in French."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True) for q in questions]
    temps, seeds, max_new = [0.0, 0.8, 1.0], [0, 17, 99], 12
    samplers = [kvdecode.Sampler(t, seed=s) for t, s in zip(temps, seeds)]

    # the seed's loop: right-padded prefill of every row, then one token per row per step
    engine = kvdecode.Engine(model, rows=len(prompts), max_len=256)
    ids = np.zeros((len(prompts), max(map(len, prompts))), dtype=np.int64)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    nxt, logprobs = engine.append_sample(ids, [len(p) for p in prompts], sampler=samplers)
    assert all(lp is not None and lp <= 0 for lp in logprobs)
    out = [[t] for t in nxt]
    for _ in range(max_new - 1):
        nxt, _ = engine.append_sample(np.array([[o[-1]] for o in out]), sampler=samplers)
        for o, t in zip(out, nxt):
            o.append(t)
    assert engine.lens == [len(p) + max_new - 1 for p in prompts]

    # the Rust API through the command: 2 rows (so the batches differ), prefill chunks of 5 tokens
    reqs = tmp_path / "requests.jsonl"
    reqs.write_text("".join(json.dumps({"tokens": p, "max_tokens": max_new, "temperature": t, "seed": s}) + "\n"
                            for p, t, s in zip(prompts, temps, seeds)))
    run = subprocess.run([str(CLI), "generate", "--model", str(MODEL), "--prompts", str(reqs), "--rows", "2",
                          "--prefill-chunk", "5", "--max-len", "256"], check=True, capture_output=True, text=True)
    rust = sorted((json.loads(line) for line in run.stdout.splitlines()), key=lambda c: c["id"])
    for i, c in enumerate(rust):
        print(f"request {i}: {tok.decode(c['tokens'])!r}")
    assert [c["tokens"] for c in rust] == out
