#!/usr/bin/env bash
# The browser tests, installing what is missing (Debian's chromium, chromium-driver and
# firefox-esr, the wasm-bindgen-cli matching the workspace's Cargo.lock, playwright-core and
# puppeteer-core):
#   1. the engine's parity tests inside headless Chromium (wasm-bindgen-test, WebGPU on SwiftShader);
#   2. the page end to end in Chromium (playwright-core): load, decode 20 greedy tokens, compare
#      with the native engine's tokens for the same model and prompt, save a screenshot;
#      then again with the GPU device destroyed after 5 tokens: the page must build a new session;
#   3. the same page test in Firefox ESR (WebGPU on lavapipe, driven over WebDriver BiDi);
#   4. SmolLM2-135M-Instruct (models/, scripts/fetch-smollm2.sh) picked from disk in the page,
#      asked "What is the capital of France?" greedily: the answer must name Paris;
#   5. two conversations answering at once in the page equal each answering alone, and a second
#      turn keeps the first on its row;
#   6. a picked GGUF is kept in the browser's storage (OPFS) and loads from there after a reload;
#   7. Phi-3 (fused tensors, partial rotary, LongRoPE) from the GGUF file llama.cpp's converter made
#      of its tiny fixture model: 20 greedy tokens in the page equal the native engine's.
# Exits non-zero if any fails.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
bash scripts/install.sh apt
bash scripts/install.sh cargo
bash scripts/install.sh web
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
# each step's seconds, printed as the next begins, so CI's browsers stage reads step by step
step_start=$SECONDS
step() {
  echo "   ($((SECONDS - step_start)) s)"
  step_start=$SECONDS
  echo "== $1"
}

step "1. parity tests in headless Chromium (wasm-bindgen-test)"
# in release, as the page is built: one build of the wasm crates serves both (a dev build of the
# page loads SmolLM2 too slowly for test 4: over 300 s in Chromium here)
(cd examples/web && CHROMEDRIVER=$(command -v chromedriver) WASM_BINDGEN_TEST_TIMEOUT=600 cargo test --release)

step "2. the page end to end (playwright-core)"
bash scripts/web-build.sh
. scripts/cargo-profile.sh
cargo build --profile "$profile" -p kvdecode-cli
echo '{"tokens": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": 20}' > "${TMPDIR:-/tmp}/kvdecode-e2e.jsonl"
# the page decodes with f16 weights and f16 K/V and the portable kernels: the native run too
expected=$(KVDECODE_PORTABLE=1 "target/$profile_dir/kvdecode" generate --model demo --prompts "${TMPDIR:-/tmp}/kvdecode-e2e.jsonl" --rows 1 --kv f16 --weights f16 \
  | python3 -c 'import json,sys; print(json.dumps(json.loads(sys.stdin.readline())["tokens"]))')
echo "native engine (lavapipe): $expected"
(cd examples/web && EXPECTED="$expected" node e2e.mjs "$root/examples/web/screenshot.png")

step "2b. the GPU device lost mid-answer: the page builds a new session and answers the same (Chromium)"
(cd examples/web && EXPECTED="$expected" LOSE=5 node e2e.mjs "${TMPDIR:-/tmp}/kvdecode-device-lost.png")

step "3. the page end to end in Firefox ESR (puppeteer-core, WebDriver BiDi)"
(cd examples/web && EXPECTED="$expected" BROWSER_KIND=firefox node e2e.mjs "$root/examples/web/screenshot-firefox.png")
step "4. SmolLM2 chosen from disk, chatting in the page (Chromium)"
bash scripts/fetch-smollm2.sh >/dev/null
(cd examples/web && GGUF="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf" EXPECT_TEXT=Paris node e2e.mjs "$root/examples/web/screenshot-smollm2.png")
step "5. two conversations at once equal each alone, and a second turn keeps the first (Chromium)"
(cd examples/web && TWO=1 node e2e.mjs "$root/examples/web/screenshot-two.png")
step "6. a picked GGUF is kept in the browser's storage and loads from it after a reload (Chromium)"
(cd examples/web && STORE_GGUF="$root/fuzz/seeds/gguf/llama-f32-chatml.gguf" node e2e.mjs "${TMPDIR:-/tmp}/kvdecode-stored.png")
step "7. Phi-3 from a GGUF file in the page: its greedy tokens equal the native engine's (Chromium)"
# the page holds min(2048, the trained context) positions per row: 512 here, which also picks
# LongRoPE's long factors (past the original 128) in both
phi3=tests/fixtures/llamacpp/families/phi3.gguf
expected=$(KVDECODE_PORTABLE=1 "target/$profile_dir/kvdecode" generate --model "$phi3" --prompts "${TMPDIR:-/tmp}/kvdecode-e2e.jsonl" --rows 1 --kv f16 --weights f16 --max-len 512 \
  | python3 -c 'import json,sys; print(json.dumps(json.loads(sys.stdin.readline())["tokens"]))')
echo "native engine (lavapipe): $expected"
(cd examples/web && AUTO_GGUF="$root/$phi3" EXPECTED="$expected" node e2e.mjs "${TMPDIR:-/tmp}/kvdecode-phi3.png")
echo "   ($((SECONDS - step_start)) s)"
echo "web tests: 7 passed, 0 failed in $SECONDS s"
