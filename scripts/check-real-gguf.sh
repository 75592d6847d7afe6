#!/usr/bin/env bash
# A real llama-quantize file: SmolLM2-135M-Instruct requantized to Q4_K_M (from the packaged Q4_1
# file, --allow-requantize) by llama.cpp's own llama-quantize, then the same chat prompt answered
# greedily by llama.cpp (CPU backend, f32 K/V) and by kvdecode (f32 K/V), token for token.
#
#   scripts/check-real-gguf.sh [TYPE] [TOKENS]    # default Q4_K_M 48
#
# Prints both answers and where (if anywhere) the two greedy
# continuations first differ. llama.cpp's CPU backend quantizes activations to 8 bits in these
# products and kvdecode keeps them f32, so a late divergence at a near-tie is possible; the
# script reports it rather than failing on it. Not in CI (builds llama.cpp).
set -euo pipefail
cd "$(dirname "$0")/.."
ty=${1:-Q4_K_M}
n=${2:-48}
bash scripts/fetch-smollm2.sh >/dev/null
cpu=$(bash scripts/llamacpp-build.sh cpu "llama-quantize")
src=$(dirname "$(dirname "$cpu")")/llama_cpp_python-0.3.36/vendor/llama.cpp
g++ -O2 -std=c++17 -I"$src/include" -I"$src/ggml/include" scripts/fixtures/llamacpp_logits.cpp -L"$cpu" -lllama \
  -lggml -lggml-base -Wl,-rpath,'$ORIGIN' -o "$cpu/llamacpp_logits"
model=models/SmolLM2-135M-Instruct.$ty.gguf
[ -s "$model" ] || "$cpu/llama-quantize" --allow-requantize models/SmolLM2-135M-Instruct.Q4_1.gguf "$model" "$ty" >/dev/null 2>&1
cargo build --quiet --release -p kvdecode-cli
kv=target/release/kvdecode
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
chmod 700 "$XDG_RUNTIME_DIR"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# SmolLM2's chat template (ChatML with its default system prompt), one user turn
prompt=$'<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France, and what is it known for?<|im_end|>\n<|im_start|>assistant\n'
"$kv" tokenize --model "$model" "$prompt" >"$tmp/prompt.json"
python3 - "$tmp" "$n" <<'PY'
import json, struct, sys
tmp, n = sys.argv[1], int(sys.argv[2])
ids = json.load(open(f"{tmp}/prompt.json"))
open(f"{tmp}/prompt.i32", "wb").write(struct.pack(f"<{len(ids)}i", *ids))
open(f"{tmp}/req.jsonl", "w").write(json.dumps({"tokens": ids, "max_tokens": n}) + "\n")
PY
"$cpu/llamacpp_logits" "$model" "$tmp/prompt.i32" "$tmp/llama.i32" 0 "$n" 2>/dev/null
"$kv" generate --model "$model" --prompts "$tmp/req.jsonl" --kv f32 --weights f32 --rows 1 2>/dev/null >"$tmp/kv.jsonl"
echo "kvdecode chat (greedy):"
"$kv" chat --model "$model" --temperature 0 --kv f32 --weights f32 --max-tokens "$n" \
  "What is the capital of France, and what is it known for?" 2>/dev/null
python3 - "$tmp" "$model" "$cpu" <<'PY'
import array, json, struct, subprocess, sys
tmp, model, cpu = sys.argv[1:4]
data = open(f"{tmp}/llama.i32", "rb").read()
llama = list(struct.unpack(f"<{len(data) // 4}i", data))
ours = json.loads(open(f"{tmp}/kv.jsonl").read().strip().splitlines()[0])["tokens"]
first = next((i for i, (a, b) in enumerate(zip(llama, ours)) if a != b), None)
print(f"\n{model}: llama.cpp greedy {llama}\nkvdecode greedy  {ours}")
if first is None:
    print(f"the {min(len(llama), len(ours))} greedy tokens are the same")
else:
    print(f"the greedy continuations agree for {first} tokens, then differ ({llama[first]} vs {ours[first]})")
    # llama.cpp's own logits of the two tokens there: how near a tie it was
    prompt = json.load(open(f"{tmp}/prompt.json")) + llama[:first]
    open(f"{tmp}/at.i32", "wb").write(struct.pack(f"<{len(prompt)}i", *prompt))
    subprocess.run([f"{cpu}/llamacpp_logits", model, f"{tmp}/at.i32", f"{tmp}/at.f32", "0"], check=True,
                   stderr=subprocess.DEVNULL)
    logits = array.array("f", open(f"{tmp}/at.f32", "rb").read())
    row = logits[len(logits) - len(logits) // len(prompt):]
    a, b = row[llama[first]], row[ours[first]]
    print(f"llama.cpp's logits there: {a:.4f} for its token, {b:.4f} for kvdecode's (gap {a - b:.4f})")
PY
