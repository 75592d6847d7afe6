#!/usr/bin/env bash
# The GRPO example (python/examples/grpo.py) as CI runs it: 40 steps with --check (the reward
# rises, and with f32 weights and K/V the engine's log-probabilities are within 1e-5 mean and
# 1e-3 max of the trainer's), then 3 steps on 2 Ray actors (their episodes must equal one
# engine's), then 40 steps of two rank-8 LoRA experiments on one engine with --check (each
# experiment's reward rises, the mismatch stays within the same bounds, a sync moves at most 5% of
# the model's bytes). It needs torch and PEFT: PyPI's torch wheel brings its CUDA libraries (about
# 5.8 GB installed), so the venv is kept in ~/.cache/kvdecode/grpo-venv and made once per machine.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${KVDECODE_GRPO_VENV:-$HOME/.cache/kvdecode/grpo-venv}
bash scripts/install.sh python grpo
. scripts/cargo-profile.sh
MATURIN_PEP517_ARGS="--profile $profile" "$venv/bin/pip" install --quiet --no-deps --force-reinstall ./python
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "== GRPO: 40 steps, the reward must rise, the f32 mismatch stay within bounds"
"$venv/bin/python" python/examples/grpo.py --steps 40 --check --plot "$out/grpo.png"
echo "== GRPO on 2 Ray actors: their episodes equal one engine's"
"$venv/bin/python" python/examples/grpo.py --steps 3 --ray 2 --plot ""
echo "== GRPO with LoRA: two rank-8 adapters on one engine, rows mixed; only the adapters pushed"
"$venv/bin/python" python/examples/grpo.py --lora 8 --experiments 2 --prompts 8 --steps 40 --check --plot ""
echo "GRPO example passed"
