#!/usr/bin/env bash
# Everything the tests need beyond rustup's toolchain, installed where missing, in four parts:
#   scripts/install.sh apt      Debian packages: lavapipe, Mesa EGL/GL, Python's pip, the browsers, Node,
#                               Xvfb and the X libraries of the desktop window
#   scripts/install.sh cargo    cargo-nextest, cargo-hakari, wasm-bindgen-cli, the wasm32 target
#   scripts/install.sh python [openai|wheel|grpo ...]
#                               the venvs of the openai, wheel and GRPO tests (torch, PEFT), and SmolLM2
#   scripts/install.sh web      the page's npm packages (playwright-core, puppeteer-core)
#   scripts/install.sh          all four
# `.ci/run` calls each part as a stage of its own, so a slow install shows as such; the test
# scripts call the part they need, which costs a few checks when all is there. The venvs live in
# ~/.cache/kvdecode (kept per machine: PyPI's torch wheel is 5.8 GB installed).
set -euo pipefail
cd "$(dirname "$0")/.."

apt_part() {
  local need=()
  ls /usr/share/vulkan/icd.d/lvp_icd.*.json >/dev/null 2>&1 || need+=(mesa-vulkan-drivers)
  ldconfig -p | grep -q 'libvulkan.so.1' || need+=(libvulkan1)
  ldconfig -p | grep -q 'libEGL.so.1' && [ -e /usr/share/glvnd/egl_vendor.d/50_mesa.json ] ||
    need+=(libegl1 libegl-mesa0 libgl1-mesa-dri)
  command -v python3 >/dev/null || need+=(python3)
  python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
  python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
  command -v curl >/dev/null || need+=(curl)
  command -v chromium >/dev/null || need+=(chromium)
  command -v chromedriver >/dev/null || need+=(chromium-driver)
  command -v firefox-esr >/dev/null || need+=(firefox-esr)
  command -v node >/dev/null || need+=(nodejs)
  # the desktop window's test (scripts/test-desktop.sh): an X server in memory, and the X client
  # libraries winit opens at run time
  command -v xvfb-run >/dev/null || need+=(xvfb)
  command -v xauth >/dev/null || need+=(xauth)
  for lib in libX11-xcb.so.1 libXcursor.so.1 libXrandr.so.2 libXi.so.6 libxkbcommon-x11.so.0; do
    ldconfig -p | grep -q "$lib" || need+=("$(echo "$lib" | sed 's/libX11-xcb.so.1/libx11-xcb1/; s/libXcursor.so.1/libxcursor1/;
      s/libXrandr.so.2/libxrandr2/; s/libXi.so.6/libxi6/; s/libxkbcommon-x11.so.0/libxkbcommon-x11-0/')")
  done
  command -v npm >/dev/null || need+=(npm)
  if [ ${#need[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need[@]}" >/dev/null
  fi
}

cargo_part() {
  command -v cargo >/dev/null || { echo "cargo is missing: this project needs a Rust toolchain (1.89+) from rustup" >&2; exit 1; }
  command -v rustup >/dev/null && rustup component add rustfmt clippy >/dev/null 2>&1 || true
  # nextest runs every test in a process of its own, several at once, and its filtersets pick
  # the tests a run needs by name (.config/nextest.toml)
  # the tools are built for this machine, not shipped: opt-level 1 and 16 codegen units build
  # cargo-hakari in 61 s instead of 76 and wasm-bindgen-cli in 86 s instead of 100 (2-core AMD
  # EPYC), and wasm-bindgen takes the same 0.5 s on the page's wasm either way
  local quick=(env CARGO_PROFILE_RELEASE_OPT_LEVEL=1 CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16
    CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_DEBUG=0 CARGO_PROFILE_RELEASE_STRIP=true)
  command -v cargo-nextest >/dev/null || "${quick[@]}" cargo install --locked cargo-nextest
  # hakari keeps workspace-hack/ current: one build of wgpu for the tests, the command and the wheel
  command -v cargo-hakari >/dev/null || "${quick[@]}" cargo install --locked cargo-hakari
  rustup target add wasm32-unknown-unknown >/dev/null 2>&1 || true
  local want
  want=$(grep -A1 '^name = "wasm-bindgen"$' Cargo.lock | sed -n 's/version = "\(.*\)"/\1/p')
  # not --locked: its lock file names a webpki-roots that crates.io no longer serves
  if [ "$(wasm-bindgen --version 2>/dev/null | cut -d' ' -f2)" != "$want" ]; then
    "${quick[@]}" cargo install wasm-bindgen-cli --version "$want"
  fi
}

venv() { # venv DIR IMPORTS PACKAGES...: DIR holds a venv in which IMPORTS succeed
  local dir=$1 imports=$2
  shift 2
  [ -x "$dir/bin/python" ] || python3 -m venv "$dir"
  "$dir/bin/python" -c "import $imports" 2>/dev/null || "$dir/bin/pip" install --quiet "$@"
}

python_part() { # python_part [openai] [wheel] [grpo]: those venvs (all three by default), and SmolLM2
  local cache=$HOME/.cache/kvdecode which=" ${*:-openai wheel grpo} "
  [[ $which != *" openai "* ]] ||
    venv "${KVDECODE_OPENAI_VENV:-$cache/openai-venv}" openai,jsonschema openai==3.57.0 jsonschema==4.26.0
  # ray: the rollout-workers example runs on a local Ray cluster in the tests
  [[ $which != *" wheel "* ]] ||
    venv "${KVDECODE_PYTHON_VENV:-$cache/python-venv}" numpy,pytest,ray numpy==2.4.6 pytest==9.2.0 ray==2.60.0
  [[ $which != *" grpo "* ]] ||
    venv "${KVDECODE_GRPO_VENV:-$cache/grpo-venv}" torch,numpy,safetensors,matplotlib,ray,peft \
      torch==2.15.0 numpy==2.4.6 safetensors==0.8.0 matplotlib==3.11.2 ray==2.60.0 \
      peft==0.21.2 transformers==5.24.0 accelerate==1.16.0
  bash scripts/fetch-smollm2.sh >/dev/null
}

web_part() {
  (cd examples/web && { [ -d node_modules/playwright-core ] && [ -d node_modules/puppeteer-core ]; } ||
    npm ci --no-audit --no-fund --silent)
}

case "${1:-all}" in
  apt) apt_part ;;
  cargo) cargo_part ;;
  python) shift; python_part "$@" ;;
  web) web_part ;;
  all) apt_part && cargo_part && python_part && web_part ;;
  *) echo "scripts/install.sh: expected apt, cargo, python, web or nothing, got '$1'" >&2; exit 2 ;;
esac
