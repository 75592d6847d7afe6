#!/usr/bin/env bash
# The desktop chat window (examples/desktop-chat) as a person sees it: under Xvfb, on Mesa's
# lavapipe, with SmolLM2 and a LoRA adapter, it answers a prompt given on the command line, takes
# a screenshot and closes. Checked:
# - the answer it showed is exactly `kvdecode chat`'s with the same model, adapter and sampling
#   options (the window's device is egui's own, shared with the engine; the command makes its own);
# - frames kept coming while it decoded: more frames than decode steps (a step goes to the GPU in
#   parts, one per frame, so the window's drawing waits for a part, not a whole step);
# - the screenshot is the window's size;
# - and, with the embedded demo model, that stopping an answer (what the Stop button does) ends it
#   after the step in flight.
#   scripts/test-desktop.sh [SCREENSHOT.png]     (default: a temporary file)
# Run by .ci/run; docs/desktop-chat.png is one of its screenshots.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/cargo-profile.sh
cargo build --profile "$profile" -p kvdecode-cli -p kvdecode-desktop-chat
bin=target/$profile_dir
bash scripts/fetch-smollm2.sh >/dev/null
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
shot=${1:-$work/window.png}
python3 scripts/serve/make_lora_adapters.py "$work" smollm2-lora-r4
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
prompt="Name three colors of the rainbow."
opts=(--model "$model" --lora "$work/smollm2-lora-r4" --temperature 0.7 --seed 3 --max-tokens 24)

"$bin/kvdecode" chat "${opts[@]}" "$prompt" >"$work/chat.txt" 2>"$work/chat.log" || { cat "$work/chat.log"; exit 1; }
t0=$SECONDS
xvfb-run -a -s "-screen 0 1024x768x24" "$bin/desktop-chat" "${opts[@]}" --prompt "$prompt" --exit-after 24 \
  --screenshot "$shot" >"$work/report.json" 2>"$work/window.log" || { cat "$work/window.log"; exit 1; }
echo "the window ran for $((SECONDS - t0)) s"
python3 - "$work/chat.txt" "$work/report.json" "$shot" <<'EOF'
import json, struct, sys
chat = open(sys.argv[1], encoding="utf-8").read().rstrip("\n")
report = json.loads(open(sys.argv[2], encoding="utf-8").read().strip().splitlines()[-1])
print(json.dumps({k: v for k, v in report.items() if k != "token_ids"}, ensure_ascii=False))
assert report["error"] is None, report["error"]
assert report["adapter"], "the window shows the adapter"
assert report["answer"] == chat, f"the window showed {report['answer']!r}, kvdecode chat printed {chat!r}"
assert len(report["token_ids"]) == 24, report["token_ids"]
steps, frames = report["steps"], report["frames_while_decoding"]
print(f"{frames} frames while decoding over {steps} scheduler steps: {frames / steps:.1f} frames a step")
assert frames > steps, "frames did not keep coming while the model decoded"
png = open(sys.argv[3], "rb").read()
assert png[:8] == b"\x89PNG\r\n\x1a\n", "the screenshot is a PNG"
w, h = struct.unpack(">II", png[16:24])
assert (w, h) == (720, 520), f"the screenshot is {w}x{h}, the window 720x520"
print(f"screenshot {w}x{h}, {len(png)} bytes: {sys.argv[3]}")
EOF
# the demo model (no --model), stopped after 5 of at most 40 tokens: --exit-after calls the Stop
# button's stop(), which cancels the request when the step in flight ends: one token more
xvfb-run -a -s "-screen 0 1024x768x24" "$bin/desktop-chat" --prompt "hello" --max-tokens 40 --exit-after 5 \
  >"$work/demo.json" 2>"$work/demo.log" || { cat "$work/demo.log"; exit 1; }
python3 - "$work/demo.json" <<'EOF'
import json, sys
report = json.loads(open(sys.argv[1], encoding="utf-8").read().strip().splitlines()[-1])
print(json.dumps({k: report[k] for k in ("model", "answer", "steps", "frames_while_decoding")}))
assert report["error"] is None, report["error"]
assert len(report["token_ids"]) == 6, f"stopped after {len(report['token_ids'])} tokens, not 5 + the step in flight"
assert report["answer"] == "".join(f"{t} " for t in report["token_ids"]), "the demo model's answer shows its ids"
EOF
