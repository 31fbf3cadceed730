# Sourced by the device session scripts: carried wheels, libcupti 13.5, llama-server binaries.
export PYTHONUNBUFFERED=1
REPO=$PWD
if [ ! -d /tmp/site/opentelemetry ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$REPO/src
[ -d /tmp/cupti135 ] || { mkdir -p /tmp/cupti135 && tar xJf .llama/cupti135.tar.xz -C /tmp/cupti135; }
export OTEL_GPU_CENSUS_LIB=$REPO/native/build/libotel_gpu_census.so
export OTEL_GPU_CENSUS_CUPTI=/tmp/cupti135/nvidia/cu13/lib/libcupti.so.13
if [ ! -x /root/llama/bin/llama-server ] && [ -f .llama/llama-bin.tar.xz ]; then
  mkdir -p /root/llama/bin && tar xJf .llama/llama-bin.tar.xz -C /root/llama/bin
fi
export LLAMA_SERVER=/root/llama/bin/llama-server
export LD_LIBRARY_PATH=/root/llama/bin:${LD_LIBRARY_PATH:-}
[ -f /root/vocab.gguf ] || xz -dc .llama/ggml-vocab-llama-bpe.gguf.xz > /root/vocab.gguf
export VOCAB=/root/vocab.gguf
mkdir -p /root/work
