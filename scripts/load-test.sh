#!/usr/bin/env bash
# The full load run: `kvdecode serve` on this machine's adapter and `kvdecode bench-serve` against
# it (1,000 requests over 64 connections by default: streaming, non-streaming, cancelled midway,
# malformed; every answer checked against the same request alone; the server's RSS before and
# after). Prints the table docs/SERVING.md carries.
#   scripts/load-test.sh [REQUESTS] [CONCURRENCY] [ROWS] [MODEL] [MAX_TOKENS]
#   FULL=1 scripts/load-test.sh 10000 64     the whole run of #37: besides the load, 8 clients that
#                                            send headers a byte a second (cut at a 5 s deadline),
#                                            1,000 requests with a 4 KiB stop string, the served
#                                            weights pushed again halfway, RSS growth at most 50 MiB
# MODEL defaults to the tiny random ChatML model of the fuzz seeds (the server's machinery under
# load, not the GPU's speed); give models/SmolLM2-135M-Instruct.Q4_1.gguf for a real model.
set -euo pipefail
cd "$(dirname "$0")/.."
requests=${1:-1000}
concurrency=${2:-64}
rows=${3:-16}
model=${4:-fuzz/seeds/gguf/llama-f32-chatml.gguf}
max_tokens=${5:-16}
case $model in models/SmolLM2*) bash scripts/fetch-smollm2.sh >/dev/null ;; esac
. scripts/cargo-profile.sh
cargo build --profile "$profile" -p kvdecode-cli
cli=target/$profile_dir/kvdecode
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
log=$(mktemp)
extra=()
bench=()
if [ -n "${FULL:-}" ]; then
  extra=(--admin-key load-test-admin --weights-dir "$(dirname "$model")" --header-timeout 5)
  bench=(--slow-clients 8 --long-stops 1000 --push-weights "$(basename "$model")" --admin-key load-test-admin
    --max-rss-growth-mib 50)
fi
"$cli" serve --model "$model" --port 0 --rows "$rows" --max-len 256 --queue 1024 "${extra[@]}" 2>"$log" &
server=$!
trap 'kill $server 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 1 600); do
  port=$(sed -n 's|.*http://127.0.0.1:\([0-9]*\).*|\1|p' "$log")
  [ -n "$port" ] && break
  sleep 0.1
done
[ -n "${port:-}" ] || { cat "$log"; exit 1; }
head -1 "$log"
"$cli" bench-serve --url "http://127.0.0.1:$port" --requests "$requests" \
  --concurrency "$concurrency" --max-tokens "$max_tokens" --server-pid "$server" --json "${bench[@]}"
