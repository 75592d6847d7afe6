#!/usr/bin/env bash
# Build the browser page (examples/web) and, with --serve, serve it on http://localhost:8000.
#   scripts/web-build.sh --serve
# Needs: rustup target wasm32-unknown-unknown, wasm-bindgen-cli matching the workspace's Cargo.lock
# (installed if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
rustup target add wasm32-unknown-unknown >/dev/null 2>&1 || true
want=$(grep -A1 '^name = "wasm-bindgen"$' Cargo.lock 2>/dev/null | sed -n 's/version = "\(.*\)"/\1/p')
want=${want:-0.2.130}
if [ "$(wasm-bindgen --version 2>/dev/null | cut -d' ' -f2)" != "$want" ]; then
  cargo install wasm-bindgen-cli --version "$want"
fi
(cd examples/web && cargo build --release --lib)
wasm-bindgen --target web --no-typescript --out-dir examples/web/pkg \
  target/wasm32-unknown-unknown/release/kvdecode_web.wasm
echo "built examples/web/pkg"
if [ "${1:-}" = "--serve" ]; then
  echo "serving http://localhost:8000 (Chromium: --enable-unsafe-webgpu)"
  exec python3 -m http.server 8000 --bind 127.0.0.1 --directory examples/web
fi
