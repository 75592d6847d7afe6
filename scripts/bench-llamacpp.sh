#!/usr/bin/env bash
# kvdecode side by side with llama.cpp on the same adapter, in one run, on SmolLM2-135M-Instruct
# Q4_1: greedy decode at 1 row, prefill of 128 tokens, aggregate decode at 16 rows (llama.cpp:
# llama-bench and llama-batched-bench -npp 32 -ntg 16 -npl 16). Prints one markdown table with the
# ratios (and the raw JSON of both sides under $out).
#
# llama.cpp is built from the llama-cpp-python source distribution on PyPI (pinned, sha256
# checked), CPU and Vulkan backends, into ~/.cache/kvdecode/llamacpp by scripts/llamacpp-build.sh
# (which says how it gets round Debian 12's snags). llama-bench needs GGML_VK_VISIBLE_DEVICES=0 to
# accept lavapipe.
#
# Not in CI: the Vulkan backend alone takes a long while to build on 2 cores. Needs root for the
# Debian packages (cmake build-essential libvulkan-dev glslc spirv-headers) when they are missing.
#
# For a machine that can build nothing (a GPU box without network or toolchains), three variables
# take what was built elsewhere: LLAMACPP_BIN=folder with vulkan/ and cpu/ (each a build's bin/
# folder), KVDECODE_BIN=the kvdecode binary, MODEL=the GGUF file. PROMPT, GEN, REPS and BATCH (128,
# 32, 3, 16) size the runs; gpu-bench.sh's dry run shrinks them to fit a CPU adapter in its minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
out=${1:-${KVDECODE_CACHE:-$HOME/.cache/kvdecode}/llamacpp/results}
mkdir -p "$out"

if [ -z "${LLAMACPP_BIN:-}" ]; then
  echo "building llama.cpp (CPU, then Vulkan) ..."
  cpu_bin=$(bash scripts/llamacpp-build.sh cpu "llama-bench llama-batched-bench")
  vulkan_bin=$(bash scripts/llamacpp-build.sh vulkan "llama-bench llama-batched-bench" -DGGML_VULKAN=ON)
else
  vulkan_bin=$LLAMACPP_BIN/vulkan
  cpu_bin=$LLAMACPP_BIN/cpu
fi
if [ -z "${MODEL:-}" ]; then
  bash scripts/fetch-smollm2.sh >/dev/null
  model=$root/models/SmolLM2-135M-Instruct.Q4_1.gguf
else
  model=$MODEL
fi
if [ -z "${KVDECODE_BIN:-}" ]; then
  cargo build --quiet --release -p kvdecode-cli
  kv=$root/target/release/kvdecode
else
  kv=$KVDECODE_BIN
fi

prompt=${PROMPT:-128} gen=${GEN:-32} reps=${REPS:-3} batch=${BATCH:-16}
export GGML_VK_VISIBLE_DEVICES=0
# Mesa's Vulkan WSI complains without a runtime dir; give it a private one
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
chmod 700 "$XDG_RUNTIME_DIR"
echo "llama.cpp Vulkan: llama-bench ..."
LD_LIBRARY_PATH="$vulkan_bin" "$vulkan_bin/llama-bench" -m "$model" -ngl 99 -p "$prompt" -n "$gen" -r "$reps" -o json >"$out/llamacpp-vulkan.json"
echo "llama.cpp Vulkan: llama-batched-bench ..."
LD_LIBRARY_PATH="$vulkan_bin" "$vulkan_bin/llama-batched-bench" -m "$model" -ngl 99 -c 2048 -b 2048 -ub 512 -npp 32 -ntg "$(( gen / 2 ))" -npl "$batch" \
  >"$out/llamacpp-vulkan-batched.txt" 2>&1
echo "llama.cpp CPU: llama-bench ..."
LD_LIBRARY_PATH="$cpu_bin" "$cpu_bin/llama-bench" -m "$model" -p "$prompt" -n "$gen" -r "$reps" -o json >"$out/llamacpp-cpu.json"
echo "kvdecode ..."
"$kv" bench --model "$model" --rows 1 --ctx "$prompt" --steps "$gen" --kv f32 --tables throughput --json >"$out/kvdecode-1.txt"
"$kv" bench --model "$model" --rows "$batch" --ctx 32 --steps "$(( gen / 2 ))" --kv f32 --tables throughput --json >"$out/kvdecode-batched.txt"
# the opt-in integer-dot products (llama.cpp-like error), same runs
KVDECODE_MATMUL=int-dot "$kv" bench --model "$model" --rows 1 --ctx "$prompt" --steps "$gen" --kv f32 --tables throughput --json \
  >"$out/kvdecode-int-dot-1.txt"
KVDECODE_MATMUL=int-dot "$kv" bench --model "$model" --rows "$batch" --ctx 32 --steps "$(( gen / 2 ))" --kv f32 --tables throughput --json \
  >"$out/kvdecode-int-dot-batched.txt"

python3 - "$out" "$(basename "$model")" "$prompt" "$gen" "$batch" <<'PY'
import json, re, sys
out = sys.argv[1]
prompt, gen, batch = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])

def llama_bench(path):
    tests = json.load(open(path))
    pp = next(t["avg_ts"] for t in tests if t["n_prompt"] == prompt and t["n_gen"] == 0)
    tg = next(t["avg_ts"] for t in tests if t["n_gen"] == gen and t["n_prompt"] == 0)
    return pp, tg, tests[0].get("backends", "")

def batched(path):
    # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    for line in open(path):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0] == "32" and cells[2] == str(batch):
            return float(cells[7])
    raise SystemExit(f"no -npl {batch} row in {path}")

def kvdecode(path):
    figures = json.loads(open(path).read().strip().splitlines()[-1])
    return dict(figures["throughput"][0], matmul=figures["matmul"]), figures["adapter"]

vk_pp, vk_tg, _ = llama_bench(f"{out}/llamacpp-vulkan.json")
vk_batched = batched(f"{out}/llamacpp-vulkan-batched.txt")
cpu_pp, cpu_tg, _ = llama_bench(f"{out}/llamacpp-cpu.json")
one, adapter = kvdecode(f"{out}/kvdecode-1.txt")
batched_kv, _ = kvdecode(f"{out}/kvdecode-batched.txt")
int_one, _ = kvdecode(f"{out}/kvdecode-int-dot-1.txt")
int_batched, _ = kvdecode(f"{out}/kvdecode-int-dot-batched.txt")
print(f"\n{sys.argv[2]} on {adapter} (kvdecode: f32 K/V, {one['attention']} attention; "
      f"default products: {one['matmul']})\n")
print("| measure | llama.cpp Vulkan | kvdecode | kvdecode / llama.cpp Vulkan | kvdecode int-dot | int-dot / llama.cpp Vulkan | llama.cpp CPU (same cores) |")
print("|---|---:|---:|---:|---:|---:|---:|")
rows = [
    ("decode, 1 row (tok/s)", vk_tg, one["decode_tok_s"], int_one["decode_tok_s"], f"{cpu_tg:.1f}"),
    (f"prefill of {prompt} tokens (tok/s)", vk_pp, one["prefill_tok_s"], int_one["prefill_tok_s"], f"{cpu_pp:.1f}"),
    (f"decode, {batch} rows, aggregate (tok/s)", vk_batched, batched_kv["decode_tok_s"], int_batched["decode_tok_s"], ""),
]
for what, llama, kv, kv_int, cpu in rows:
    print(f"| {what} | {llama:.2f} | {kv:.2f} | {kv / llama:.2f}x | {kv_int:.2f} | {kv_int / llama:.2f}x | {cpu} |")
PY
