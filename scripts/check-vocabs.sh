#!/usr/bin/env bash
# kvdecode's tokenizer against llama.cpp's own tokenizer tests: every models/ggml-vocab-*.gguf of
# the pinned llama.cpp source (scripts/llamacpp-build.sh fetches it) whose tokenizer kvdecode
# reads, each .inp text against its .out ids (llama.cpp tokenizes them without BOS, so a BOS the
# vocabulary asks for is dropped before comparing). Prints one line per vocabulary and the first
# mismatches. Not in CI (the vocabularies are megabytes each; tests/tokenizers.rs runs Phi-3's).
set -euo pipefail
cd "$(dirname "$0")/.."
cpu=$(bash scripts/llamacpp-build.sh cpu "llama-quantize")
models=$(dirname "$(dirname "$cpu")")/llama_cpp_python-0.3.36/vendor/llama.cpp/models
cargo build --quiet --release -p kvdecode-cli
python3 - target/release/kvdecode "$models" "${*:-llama-spm phi-3 llama-bpe qwen2 gpt-2}" <<'PY'
import json, subprocess, sys
kv, models, names = sys.argv[1], sys.argv[2], sys.argv[3].split()
for name in names:
    vocab = f"{models}/ggml-vocab-{name}.gguf"
    texts = open(vocab + ".inp", encoding="utf-8").read().split("\n__ggml_vocab_test__\n")
    wants = open(vocab + ".out", encoding="utf-8").read().split("\n")
    fails = []
    for text, want in zip(texts, wants):
        want = [int(x) for x in want.split()]
        r = subprocess.run([kv, "tokenize", "--model", vocab, text], capture_output=True, text=True)
        if r.returncode != 0:
            fails.append(f"{text[:30]!r}: {r.stderr.strip()[-160:]}")
            continue
        got = json.loads(r.stdout)
        if got[:1] != want[:1] and len(got) == len(want) + 1:
            got = got[1:]  # the vocabulary's BOS
        if got != want:
            fails.append(f"{text[:30]!r}: {got[:10]} vs llama.cpp {want[:10]}")
    print(f"ggml-vocab-{name}: {len(texts) - len(fails)} of {len(texts)} texts tokenize as llama.cpp does")
    for f in fails[:3]:
        print("   ", f)
PY
