#!/usr/bin/env bash
# torch tensors in and out of the Python package (python/tests_torch). Not in CI: it needs torch,
# whose PyPI wheel brings about 5.5 GB of CUDA libraries; this uses the venv that
# scripts/fixtures/make.sh makes (torch 2.15 + numpy), installing the wheel into it.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${KVDECODE_FIXTURES_VENV:-$HOME/.cache/kvdecode/fixtures-venv}
[ -x "$venv/bin/python" ] || { echo "no venv with torch at $venv: run scripts/fixtures/make.sh first" >&2; exit 1; }
"$venv/bin/python" -c 'import pytest' 2>/dev/null || "$venv/bin/pip" install --quiet pytest==9.2.0
"$venv/bin/pip" install --quiet --no-deps --force-reinstall ./python
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
echo "== torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)')"
"$venv/bin/python" -m pytest -q python/tests_torch "$@"
