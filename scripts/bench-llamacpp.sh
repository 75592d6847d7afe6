#!/usr/bin/env bash
# kvdecode side by side with llama.cpp on the same adapter, in one run, on SmolLM2-135M-Instruct
# Q4_1: greedy decode at 1 row, prefill of 128 tokens, aggregate decode at 16 rows (llama.cpp:
# llama-bench and llama-batched-bench -npp 32 -ntg 16 -npl 16). Prints one markdown table with the
# ratios (and the raw JSON of both sides under $out).
#
# llama.cpp is built from the llama-cpp-python source distribution on PyPI (pinned, sha256
# checked), CPU and Vulkan backends, into ~/.cache/kvdecode/llamacpp. Two snags on this Debian 12
# machine are handled here: its Vulkan headers lack VK_EXT_layer_settings (used only by the
# validation-settings block of ggml-vulkan.cpp, which gets an #ifdef), and on CPUs with AMX, GCC
# 12 miscompiles the AMX kernels, so the CPU backend is built for AVX2/AVX-512 without AMX
# (GGML_NATIVE=OFF). llama-bench needs GGML_VK_VISIBLE_DEVICES=0 to accept lavapipe.
#
# Not in CI: the Vulkan backend alone takes a long while to build on 2 cores. Needs root for the
# Debian packages (cmake build-essential libvulkan-dev glslc spirv-headers) when they are missing.
#
# For a machine that can build nothing (a GPU box without network or toolchains), three variables
# take what was built elsewhere: LLAMACPP_BIN=folder with vulkan/ and cpu/ (each a build's bin/
# folder), KVDECODE_BIN=the kvdecode binary, MODEL=the GGUF file.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
version=0.3.36
sha=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
url=https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/llama_cpp_python-$version.tar.gz
cache=${KVDECODE_CACHE:-$HOME/.cache/kvdecode}/llamacpp
out=${1:-$cache/results}
jobs=${JOBS:-$(nproc)}
mkdir -p "$cache" "$out"

if [ -z "${LLAMACPP_BIN:-}" ]; then
  need=()
  command -v cmake >/dev/null || need+=(cmake)
  command -v g++ >/dev/null || need+=(build-essential)
  command -v glslc >/dev/null || need+=(glslc)
  [ -e /usr/include/vulkan/vulkan.h ] || need+=(libvulkan-dev)
  [ -d /usr/include/spirv ] || need+=(spirv-headers)
  if [ ${#need[@]} -gt 0 ]; then
    echo "installing ${need[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
  fi

  # the source: vendor/llama.cpp of the pinned llama-cpp-python sdist
  src=$cache/llama_cpp_python-$version/vendor/llama.cpp
  if [ ! -d "$src" ]; then
    tarball=$cache/llama_cpp_python-$version.tar.gz
    [ -s "$tarball" ] || curl -sSfL -o "$tarball" "$url"
    echo "$sha  $tarball" | sha256sum -c --quiet
    tar xzf "$tarball" -C "$cache"
  fi
  # Debian 12's Vulkan headers (1.3.239) lack VK_EXT_layer_settings: compile its block only where
  # the headers have it (it only configures the validation layer)
  python3 - "$src/ggml/src/ggml-vulkan/ggml-vulkan.cpp" <<'PY'
import sys
p = sys.argv[1]
s = open(p).read()
if "#ifdef VK_EXT_layer_settings" not in s:
    start = "    VkBool32 enable_best_practice = layer_settings;\n"
    end = "    vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, layers, extensions, &layer_setting_info);\n"
    assert s.count(start) == 1 and s.count(end) == 1, "ggml-vulkan.cpp changed: update the patch"
    s = s.replace(start, "#ifdef VK_EXT_layer_settings\n" + start)
    s = s.replace(end, end + "#else\n    vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, layers, extensions);\n#endif\n")
    open(p, "w").write(s)
PY

  build() {  # build dir, extra cmake flags...
    local dir=$1
    shift
    if [ ! -x "$dir/bin/llama-bench" ] || [ ! -x "$dir/bin/llama-batched-bench" ]; then
      cmake -S "$src" -B "$dir" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
        -DGGML_AVX512=ON "$@" >"$dir.cmake.log" 2>&1
      cmake --build "$dir" -j "$jobs" --target llama-bench llama-batched-bench >"$dir.build.log" 2>&1
    fi
  }
  echo "building llama.cpp (CPU) ..."
  build "$cache/build-cpu"
  echo "building llama.cpp (Vulkan) ..."
  build "$cache/build-vulkan" -DGGML_VULKAN=ON

  vulkan_bin=$cache/build-vulkan/bin
  cpu_bin=$cache/build-cpu/bin
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

export GGML_VK_VISIBLE_DEVICES=0
# Mesa's Vulkan WSI complains without a runtime dir; give it a private one
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
chmod 700 "$XDG_RUNTIME_DIR"
echo "llama.cpp Vulkan: llama-bench ..."
LD_LIBRARY_PATH="$vulkan_bin" "$vulkan_bin/llama-bench" -m "$model" -ngl 99 -p 128 -n 32 -r 3 -o json >"$out/llamacpp-vulkan.json"
echo "llama.cpp Vulkan: llama-batched-bench ..."
LD_LIBRARY_PATH="$vulkan_bin" "$vulkan_bin/llama-batched-bench" -m "$model" -ngl 99 -c 2048 -b 2048 -ub 512 -npp 32 -ntg 16 -npl 16 \
  >"$out/llamacpp-vulkan-batched.txt" 2>&1
echo "llama.cpp CPU: llama-bench ..."
LD_LIBRARY_PATH="$cpu_bin" "$cpu_bin/llama-bench" -m "$model" -p 128 -n 32 -r 3 -o json >"$out/llamacpp-cpu.json"
echo "kvdecode ..."
"$kv" bench --model "$model" --rows 1 --ctx 128 --steps 32 --kv f32 --tables throughput --json >"$out/kvdecode-1.txt"
"$kv" bench --model "$model" --rows 16 --ctx 32 --steps 16 --kv f32 --tables throughput --json >"$out/kvdecode-16.txt"
# the opt-in integer-dot products (llama.cpp-like error), same runs
KVDECODE_MATMUL=int-dot "$kv" bench --model "$model" --rows 1 --ctx 128 --steps 32 --kv f32 --tables throughput --json \
  >"$out/kvdecode-int-dot-1.txt"
KVDECODE_MATMUL=int-dot "$kv" bench --model "$model" --rows 16 --ctx 32 --steps 16 --kv f32 --tables throughput --json \
  >"$out/kvdecode-int-dot-16.txt"

python3 - "$out" "$(basename "$model")" <<'PY'
import json, re, sys
out = sys.argv[1]

def llama_bench(path):
    tests = json.load(open(path))
    pp = next(t["avg_ts"] for t in tests if t["n_prompt"] == 128 and t["n_gen"] == 0)
    tg = next(t["avg_ts"] for t in tests if t["n_gen"] == 32 and t["n_prompt"] == 0)
    return pp, tg, tests[0].get("backends", "")

def batched(path):
    # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    for line in open(path):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and cells[0] == "32" and cells[2] == "16":
            return float(cells[7])
    raise SystemExit(f"no -npl 16 row in {path}")

def kvdecode(path):
    figures = json.loads(open(path).read().strip().splitlines()[-1])
    return dict(figures["throughput"][0], matmul=figures["matmul"]), figures["adapter"]

vk_pp, vk_tg, _ = llama_bench(f"{out}/llamacpp-vulkan.json")
vk_batched = batched(f"{out}/llamacpp-vulkan-batched.txt")
cpu_pp, cpu_tg, _ = llama_bench(f"{out}/llamacpp-cpu.json")
one, adapter = kvdecode(f"{out}/kvdecode-1.txt")
sixteen, _ = kvdecode(f"{out}/kvdecode-16.txt")
int_one, _ = kvdecode(f"{out}/kvdecode-int-dot-1.txt")
int_sixteen, _ = kvdecode(f"{out}/kvdecode-int-dot-16.txt")
print(f"\n{sys.argv[2]} on {adapter} (kvdecode: f32 K/V, {one['attention']} attention; "
      f"default products: {one['matmul']})\n")
print("| measure | llama.cpp Vulkan | kvdecode | kvdecode / llama.cpp Vulkan | kvdecode int-dot | int-dot / llama.cpp Vulkan | llama.cpp CPU (same cores) |")
print("|---|---:|---:|---:|---:|---:|---:|")
rows = [
    ("decode, 1 row (tok/s)", vk_tg, one["decode_tok_s"], int_one["decode_tok_s"], f"{cpu_tg:.1f}"),
    ("prefill of 128 tokens (tok/s)", vk_pp, one["prefill_tok_s"], int_one["prefill_tok_s"], f"{cpu_pp:.1f}"),
    ("decode, 16 rows, aggregate (tok/s)", vk_batched, sixteen["decode_tok_s"], int_sixteen["decode_tok_s"], ""),
]
for what, llama, kv, kv_int, cpu in rows:
    print(f"| {what} | {llama:.2f} | {kv:.2f} | {kv / llama:.2f}x | {kv_int:.2f} | {kv_int / llama:.2f}x | {cpu} |")
PY
