#!/usr/bin/env bash
# Build llama.cpp from the pinned llama-cpp-python source distribution on PyPI (sha256 checked)
# into ~/.cache/kvdecode/llamacpp/build-<name>, for the scripts that compare against it
# (bench-llamacpp.sh, fixtures/make_llamacpp_fixtures.sh).
#
#   scripts/llamacpp-build.sh NAME "TARGET..." [CMAKE FLAG...]   prints the build's bin/ folder
#
# Two snags on Debian 12 are handled here: its Vulkan headers lack VK_EXT_layer_settings (used
# only by the validation-settings block of ggml-vulkan.cpp, which gets an #ifdef), and on CPUs
# with AMX, GCC 12 miscompiles the AMX kernels, so the CPU backend is built for AVX2 (and
# AVX-512 where the CPU has it) without AMX (GGML_NATIVE=OFF). Needs root for the Debian packages (cmake build-essential
# libvulkan-dev glslc spirv-headers) when they are missing.
set -euo pipefail
name=$1
targets=$2
shift 2
version=0.3.36
sha=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
url=https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/llama_cpp_python-$version.tar.gz
cache=${KVDECODE_CACHE:-$HOME/.cache/kvdecode}/llamacpp
jobs=${JOBS:-$(nproc)}
mkdir -p "$cache"

need=()
command -v cmake >/dev/null || need+=(cmake)
command -v g++ >/dev/null || need+=(build-essential)
command -v glslc >/dev/null || need+=(glslc)
[ -e /usr/include/vulkan/vulkan.h ] || need+=(libvulkan-dev)
[ -d /usr/include/spirv ] || need+=(spirv-headers)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing ${need[*]}" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >&2
fi

# the source: vendor/llama.cpp of the pinned llama-cpp-python sdist
src=$cache/llama_cpp_python-$version/vendor/llama.cpp
if [ ! -d "$src" ]; then
  tarball=$cache/llama_cpp_python-$version.tar.gz
  [ -s "$tarball" ] || curl -sSfL -o "$tarball" "$url"
  echo "$sha  $tarball" | sha256sum -c --quiet
  tar xzf "$tarball" -C "$cache"
fi
# Debian 12's Vulkan headers (1.3.239) lack VK_EXT_layer_settings: compile its block only where
# the headers have it (it only configures the validation layer)
python3 - "$src/ggml/src/ggml-vulkan/ggml-vulkan.cpp" <<'PY'
import sys
p = sys.argv[1]
s = open(p).read()
if "#ifdef VK_EXT_layer_settings" not in s:
    start = "    VkBool32 enable_best_practice = layer_settings;\n"
    end = "    vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, layers, extensions, &layer_setting_info);\n"
    assert s.count(start) == 1 and s.count(end) == 1, "ggml-vulkan.cpp changed: update the patch"
    s = s.replace(start, "#ifdef VK_EXT_layer_settings\n" + start)
    s = s.replace(end, end + "#else\n    vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, layers, extensions);\n#endif\n")
    open(p, "w").write(s)
PY

dir=$cache/build-$name
# AVX-512 only where this CPU has it (the AMD EPYCs here lack it: its code dies of SIGILL there)
avx512=OFF
grep -qw avx512f /proc/cpuinfo && avx512=ON
grep -q "GGML_AVX512:BOOL=$avx512" "$dir/CMakeCache.txt" 2>/dev/null || rm -f "$dir/bin/libllama.so"
missing=0
for t in $targets; do
  case $t in llama | ggml*) ;; *) [ -x "$dir/bin/$t" ] || missing=1 ;; esac
done
[ -e "$dir/bin/libllama.so" ] || missing=1
if [ $missing = 1 ]; then
  echo "building llama.cpp ($name: $targets) ..." >&2
  cmake -S "$src" -B "$dir" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DGGML_AVX512="$avx512" "$@" >"$dir.cmake.log" 2>&1
  # shellcheck disable=SC2086
  cmake --build "$dir" -j "$jobs" --target llama $targets >"$dir.build.log" 2>&1 ||
    { tail -30 "$dir.build.log" >&2; exit 1; }
fi
echo "$dir/bin"
