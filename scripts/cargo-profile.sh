# Sourced by the scripts that build the command, the `logits` example or the wheel: which cargo
# profile they build with, and where its outputs land. (The browser page is always built in
# release: a dev build of the wasm loads SmolLM2 too slowly in Chromium.)
#   KVDECODE_PROFILE=release (the default): what a user runs and benchmarks.
#   KVDECODE_PROFILE=dev: what `.ci/run` uses. The tests have already built the command in dev
#   (dependencies at opt-level 2, see Cargo.toml), so these scripts reuse it instead of compiling
#   wgpu, axum and the rest again in release; the GPU work they check is the same either way.
profile=${KVDECODE_PROFILE:-release}
case "$profile" in
  dev) profile_dir=debug ;;
  release) profile_dir=release ;;
  *) echo "KVDECODE_PROFILE=$profile: expected dev or release" >&2; exit 2 ;;
esac
