# Sourced by the scripts that build the command, the `logits` example, the wheel or the page:
# which cargo profile they build with, and where its outputs land.
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
