#!/usr/bin/env bash
# kvdecode's bench on whatever adapter this machine has, written as one markdown file: the demo
# model, then synthetic models of real shapes in Q4_1 blocks (SmolLM2-135M's dimensions, and a
# ~1B Llama shape), at 1/16/64 rows and contexts 512 and 4096: throughput, GPU time per kernel
# class, and the attention variants side by side. Synthetic weights run at the speed of the real
# ones, and need no model file: a machine that can fetch nothing runs this with the binary alone.
#
#   scripts/gpu-bench.sh [kvdecode binary] [output.md]
# ROWS, CTX and STEPS override the sizes (the full set takes hours on lavapipe: it is for GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/kvdecode}
out=${2:-gpu-bench.md}
rows=${ROWS:-1,16,64}
ctx=${CTX:-512,4096}
steps=${STEPS:-16}
if [ ! -x "$bin" ]; then
  cargo build --quiet --release -p kvdecode-cli
fi
{
  echo "# kvdecode bench ($(date -u +%Y-%m-%d), $("$bin" --version 2>/dev/null || echo kvdecode))"
  for model in demo synthetic:smollm2 synthetic:1b; do
    echo
    echo "## $model"
    echo
    "$bin" bench --model "$model" --rows "$rows" --ctx "$ctx" --steps "$steps" --kv f16 \
      --tables throughput,profile,attention --attention-ctx "$ctx" --attention-rows 1
  done
} | tee "$out"
echo "written: $out"
