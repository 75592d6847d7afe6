#!/usr/bin/env bash
# The Python package as a user gets it: `pip install ./python` (maturin builds the abi3 wheel in
# release; KVDECODE_PROFILE=dev builds all three with the dev profile, scripts/cargo-profile.sh)
# into a venv, then pytest against the crate's reference, the Rust API (the `logits` example and
# `kvdecode generate`) and SmolLM2. Run by .ci/run after scripts/test-openai.sh, whose build of
# the command this reuses.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${KVDECODE_PYTHON_VENV:-$HOME/.cache/kvdecode/python-venv}
bash scripts/install.sh python wheel
. scripts/cargo-profile.sh
cargo build --profile "$profile" -p kvdecode-cli
cargo build --profile "$profile" --example logits
export KVDECODE_CLI=$PWD/target/$profile_dir/kvdecode KVDECODE_LOGITS_BIN=$PWD/target/$profile_dir/examples/logits
# --no-deps --force-reinstall: rebuild from this tree every time, leave numpy as it is; maturin
# takes the profile from MATURIN_PEP517_ARGS
MATURIN_PEP517_ARGS="--profile $profile" "$venv/bin/pip" install --quiet --no-deps --force-reinstall ./python
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
# a local Ray cluster for the example, without the usage-stats prompt and token-auth notice
export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled
echo "== pytest ($("$venv/bin/python" -c 'import kvdecode; print(kvdecode.device())'))"
"$venv/bin/python" -m pytest -q python/tests "$@"
