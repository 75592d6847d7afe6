#!/usr/bin/env bash
# kvdecode's bench on whatever adapter this machine has, written as one markdown file, each run
# bounded so the whole fits a lent GPU's few minutes: the occupancy table of a decode step (every
# dispatch's workgroups and longest serial loop, computed); synthetic models of real shapes in Q4_1
# blocks (SmolLM2-135M's, a ~1B Llama, a Qwen3-MoE), throughput and GPU time per kernel at 1/16/64
# rows, a long context, the attention variants at 512 positions, the mixture of experts against
# its dense twin; then the exactness suites, when their binaries are given. Synthetic weights run
# at the speed of real ones and need no model file.
#
#   scripts/gpu-bench.sh [kvdecode binary] [output.md] [test binaries folder]
#
# On a lent machine without build tools (as on 2026-12-04, docs/BENCHMARKS.md#nvidia-h200): build
# here (`cargo build --release -p kvdecode-cli`, and `cargo test --no-run` for the test binaries),
# strip and xz the binaries into an ignored folder that travels, unpack them there, and carry the
# Vulkan loader's Debian packages if the machine has none. A test binary looks for its fixtures
# at the path it was built at: link that path to the checkout there. Each command's own limit
# (LIMIT, seconds, default 90) bounds a run that would take too long on a slow adapter.
#
# LLAMACPP_BIN (llama.cpp's built bin/ folders, vulkan/ and cpu/) and MODEL (SmolLM2-135M-Instruct
# Q4_1, or its header grown back with scripts/gguf-skeleton.py) add llama.cpp's Vulkan backend
# beside kvdecode on the same card (scripts/bench-llamacpp.sh, its own LIMIT). QUICK=1 is the dry
# run of the same list at a CPU adapter's sizes (contexts of 16, 2 steps, 1 and 4 rows, the mixture
# and llama.cpp's runs as short, no 1B shape), to time
# the script and see every table come out; TOTAL (seconds, default 480) is the whole run's bound.
set -uo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/kvdecode}
out=${2:-gpu-bench.md}
tests=${3:-}
limit=${LIMIT:-90}
total=${TOTAL:-480}
t_start=$(date +%s)
if [ "${QUICK:-0}" = 1 ]; then
  rows=1,4 rows_1b= moe_rows=1 ctx=16 long=64 steps=2 few=2 moe_ctx=16
  occupancy=(--occupancy-models synthetic:smollm2 --occupancy-ctx 64,256)
  llamacpp_sizes=(PROMPT=16 GEN=4 REPS=1 BATCH=4)
else
  rows=1,16,64 rows_1b=1,16 moe_rows=1,16,64 ctx=512 long=4096 steps=16 few=4 moe_ctx=128 occupancy=()
  llamacpp_sizes=()
fi
if [ ! -x "$bin" ]; then
  cargo build --quiet --release -p kvdecode-cli || exit 1
fi
run() {
  echo
  echo "### \`$*\`"
  echo
  local t0=$(date +%s)
  local left=$(( total - (t0 - t_start) ))
  if [ "$left" -le 5 ]; then
    echo "(skipped: the whole run's ${total} s are spent)"
    return
  fi
  local bound=$(( left < limit ? left : limit ))
  timeout "$bound" "$@"
  local rc=$?
  local why="the ${limit} s limit"
  [ "$bound" -lt "$limit" ] && why="the whole run's ${total} s"
  echo
  echo "(exit $rc, $(( $(date +%s) - t0 )) s$([ $rc = 124 ] && echo ": stopped at $why"))"
}
{
  echo "# kvdecode bench ($(date -u +%Y-%m-%d), $("$bin" --version 2>/dev/null || echo kvdecode))"
  # computed, nothing timed: the dispatches of a decode step as this adapter's kernels launch them
  run "$bin" bench --tables occupancy --occupancy-on adapter "${occupancy[@]}"
  run "$bin" bench --model synthetic:smollm2 --rows "$rows" --ctx "$ctx" --steps "$steps" --kv f16 --tables throughput,profile
  run "$bin" bench --model synthetic:smollm2 --rows 1 --ctx "$long" --steps "$steps" --kv f16 --tables throughput,profile
  # (QUICK leaves the 1B shape out: drawing its random weights alone takes a CPU a minute or two)
  [ -n "$rows_1b" ] && run "$bin" bench --model synthetic:1b --rows "$rows_1b" --ctx "$ctx" --steps "$steps" --kv f16 --tables throughput,profile
  run "$bin" bench --model synthetic:smollm2 --kv f16 --tables attention --attention-ctx "$ctx" --attention-rows 1 --steps "$few"
  run "$bin" bench --model synthetic:qwen3-moe --tables moe --moe-rows "$moe_rows" --moe-ctx "$moe_ctx" --steps "$few"
  if [ -n "${LLAMACPP_BIN:-}" ]; then
    run env "${llamacpp_sizes[@]}" KVDECODE_BIN="$bin" MODEL="${MODEL:?MODEL: the SmolLM2 Q4_1 GGUF for llama.cpp}" bash scripts/bench-llamacpp.sh
  fi
  if [ -n "$tests" ]; then
    for t in attention_variants half_kv guards parity rollback_fork batching hf_shapes fixtures; do
      [ -x "$tests/$t" ] && run "$tests/$t"
    done
  fi
  echo
  echo "(whole run: $(( $(date +%s) - t_start )) s)"
} 2>&1 | tee "$out"
echo "written: $out"
