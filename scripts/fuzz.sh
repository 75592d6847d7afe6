#!/usr/bin/env bash
# Fuzz everything kvdecode reads from untrusted sources, with cargo-fuzz (libFuzzer).
#
#   scripts/fuzz.sh [RUNS] [TARGET ...]     RUNS executions per target (default 10,000,000)
#   FUZZ_SECONDS=600 scripts/fuzz.sh 0 gguf  run by time instead (RUNS 0 = no run limit)
#   FUZZ_JOBS=2 scripts/fuzz.sh              RUNS split over this many parallel processes
#
# Targets (fuzz/fuzz_targets/): gguf (reader, weights, tokenizer, the file's chat template, and an
# engine built and stepped for every model shape that loads), safetensors (reader + engine),
# tokenizer (GGUF tokenizer metadata), chat_template (hostile templates and conversations), jsonl
# (request lines), openai_request (bodies of the server's /v1/chat/completions and /v1/completions:
# templates with tools, tool_choice, JSON schemas compiled by llguidance, every parameter), server
# (any bytes as an HTTP request to a running router: method and path, headers, body; never a
# 5xx; valid requests generate on the tiny tools model). Each
# starts from its seed corpus in fuzz/seeds/ (committed) plus whatever
# earlier runs found (fuzz/corpus/, git-ignored). Installs the nightly toolchain and cargo-fuzz if
# missing. Bounds: 2 GiB RSS, 10 s per input. A crash, timeout or bound exceeded stops that target
# with its reproducer in fuzz/artifacts/<target>/.
# FUZZ_SANITIZER=address adds ASan (and leak checks; the Vulkan driver's own allocations are
# suppressed by fuzz/lsan.supp) at about a seventh of the speed; the default is none, since
# kvdecode has no unsafe code and the bar is millions of executions per target on 2 cores.
# Prints a table of executions, time and peak RSS per target; exits non-zero if any target failed.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-10000000}
shift || true
rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz
ls /usr/share/vulkan/icd.d/lvp_icd.*.json >/dev/null 2>&1 || {
  echo "the gguf and safetensors targets build engines: install lavapipe (apt-get install mesa-vulkan-drivers)" >&2
  exit 1
}
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(gguf safetensors tokenizer chat_template jsonl openai_request server)
mkdir -p fuzz/logs
san=${FUZZ_SANITIZER:-none}
(cd fuzz && cargo +nightly fuzz build -O -s "$san")
summary=()
failed=0
for t in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$t"
  cp -n "fuzz/seeds/$t"/* "fuzz/corpus/$t/" 2>/dev/null || true
  case $t in
    gguf | safetensors) max_len=65536 ;;
    chat_template | openai_request | server) max_len=16384 ;;
    # every input builds a whole tokenizer (pre-tokenizer regexes, the added-token automaton):
    # 1 KiB (a hundred or two tokens of vocabulary, merges and texts) is about a millisecond
    tokenizer) max_len=1024 ;;
    *) max_len=8192 ;;
  esac
  jobs=${FUZZ_JOBS:-1}
  args=(-runs="$((runs / jobs))" -rss_limit_mb=2048 -timeout=10 -max_len="$max_len" -print_final_stats=1)
  [ "$jobs" -gt 1 ] && args+=(-jobs="$jobs" -workers="$jobs")
  [ -n "${FUZZ_SECONDS:-}" ] && args+=(-max_total_time="$FUZZ_SECONDS")
  [ "$runs" = 0 ] && args=("${args[@]:1}")  # no run limit: -max_total_time decides
  echo "== $t: ${args[*]}"
  start=$(date +%s)
  # the Vulkan driver keeps allocations for the life of the process: suppressed, ours are not
  [ "$san" = address ] && args+=(-malloc_limit_mb=1024)
  if (cd fuzz && LSAN_OPTIONS=suppressions=$PWD/lsan.supp cargo +nightly fuzz run -O -s "$san" "$t" "corpus/$t" -- "${args[@]}") \
    >"fuzz/logs/$t.log" 2>&1; then
    result="no crash"
  else
    result="FAILED (see fuzz/logs/$t.log, fuzz/artifacts/$t/)"
    failed=1
  fi
  secs=$(( $(date +%s) - start ))
  # with jobs, each process writes its own fuzz-N.log in fuzz/: add them up
  logs=("fuzz/logs/$t.log")
  [ "$jobs" -gt 1 ] && { mv fuzz/fuzz-*.log "fuzz/logs/" 2>/dev/null || true; logs=(fuzz/logs/fuzz-*.log); }
  execs=$(cat "${logs[@]}" | sed -n 's/^stat::number_of_executed_units: *//p' | awk '{s += $1} END {print s}')
  rss=$(cat "${logs[@]}" | sed -n 's/^stat::peak_rss_mb: *//p' | sort -n | tail -1)
  corpus=$(ls "fuzz/corpus/$t" | wc -l)
  summary+=("| $t | ${execs:-?} | $secs | ${rss:-?} | $corpus | $result |")
  echo "${summary[-1]}"
done
echo
echo "| target | executions | seconds | peak RSS MiB | corpus files | result |"
echo "| --- | --- | --- | --- | --- | --- |"
printf '%s\n' "${summary[@]}"
exit $failed
