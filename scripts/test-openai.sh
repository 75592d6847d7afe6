#!/usr/bin/env bash
# Real clients against `kvdecode serve`: the official `openai` Python package (pinned, in a venv)
# and curl (the SSE wire format, /metrics, /health), with SmolLM2-135M-Instruct on this
# machine's adapter. Run by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${KVDECODE_OPENAI_VENV:-$HOME/.cache/kvdecode/openai-venv}
bash scripts/install.sh python openai
. scripts/cargo-profile.sh
cargo build --profile "$profile" -p kvdecode-cli
cli=target/$profile_dir/kvdecode
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
log=$(mktemp)
tlog=$(mktemp)
llog=$(mktemp)
adapters=$(mktemp -d)
"$venv/bin/python" scripts/serve/make_lora_adapters.py "$adapters" a b c
"$cli" serve --model models/SmolLM2-135M-Instruct.Q4_1.gguf --port 0 --rows 4 --max-len 512 2>"$log" &
server=$!
# a tiny random model whose chat template takes tools (fuzz/seeds), for tool calls
"$cli" serve --model fuzz/seeds/gguf/llama-f32-tools.gguf --port 0 --rows 2 --max-len 1024 2>"$tlog" &
tserver=$!
# SmolLM2 with three LoRA adapters (scripts/serve/make_lora_adapters.py), 8 rows for 8 requests
"$cli" serve --model models/SmolLM2-135M-Instruct.Q4_1.gguf --port 0 --rows 8 --max-len 256 --max-loras 3 \
  --max-lora-rank 4 --lora "a=$adapters/a" --lora "b=$adapters/b" --lora "c=$adapters/c" 2>"$llog" &
lserver=$!
trap 'kill $server $tserver $lserver 2>/dev/null || true; rm -rf "$log" "$tlog" "$llog" "$adapters"' EXIT
wait_port() {
  for _ in $(seq 1 600); do
    p=$(sed -n 's|.*http://127.0.0.1:\([0-9]*\).*|\1|p' "$1")
    [ -n "$p" ] && { echo "$p"; return 0; }
    sleep 0.1
  done
  cat "$1" >&2
  return 1
}
port=$(wait_port "$log")
tport=$(wait_port "$tlog")
lport=$(wait_port "$llog")
url=http://127.0.0.1:$port
echo "== openai $("$venv/bin/python" -c 'import openai; print(openai.__version__)') against $url (:$tport for tools, :$lport for adapters)"
"$venv/bin/python" scripts/serve/openai_client_test.py "$url/v1" "http://127.0.0.1:$tport/v1" "http://127.0.0.1:$lport/v1"

echo "== curl: health, SSE wire format, metrics"
[ "$(curl -s "$url/health")" = '{"status":"ok"}' ] || { echo "health"; exit 1; }
sse=$(curl -s -N "$url/v1/chat/completions" -H 'Content-Type: application/json' \
  -d '{"messages":[{"role":"user","content":"Hi"}],"max_tokens":4,"temperature":0,"stream":true,"stream_options":{"include_usage":true}}')
echo "$sse" | head -3
# every non-empty line is an SSE data line; the last one is [DONE]; one chunk carries the usage
echo "$sse" | grep -v '^$' | grep -qv '^data: ' && { echo "a non-data line in the stream"; exit 1; }
[ "$(echo "$sse" | grep -v '^$' | tail -1)" = "data: [DONE]" ] || { echo "no [DONE] at the end"; exit 1; }
echo "$sse" | grep -qE '"usage":\{[^}]*"completion_tokens":[0-9]+' || { echo "no usage chunk"; exit 1; }
metrics=$(curl -s "$url/metrics")
for m in 'kvdecode_requests_total{outcome="ok"}' kvdecode_time_to_first_token_seconds_count kvdecode_rows_in_use; do
  echo "$metrics" | grep -q "^$m" || { echo "/metrics lacks $m"; exit 1; }
done
echo "$metrics" | grep -E '^kvdecode_requests_total|^kvdecode_completion_tokens_total'
echo "openai client and curl tests passed"
