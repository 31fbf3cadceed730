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
# The carried binaries lack libllama-server-impl.so (host code only): build it from the same
# source without CUDA; it links against the carried CUDA-built libllama/libggml.
if [ ! -f /root/llama/bin/libllama-server-impl.so ] && [ -f .llama/llama-src.tar.xz ]; then
  mkdir -p /root/llama/src && tar xJf .llama/llama-src.tar.xz -C /root/llama/src
  (cd /root/llama/src/llama.cpp && cmake -B /root/llama/cpu -DGGML_CUDA=OFF -DLLAMA_BUILD_TESTS=OFF \
     -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
     -DCMAKE_BUILD_TYPE=Release > /root/llama/cpu-cmake.log 2>&1 && \
   cmake --build /root/llama/cpu --target llama-server-impl -j 16 > /root/llama/cpu-build.log 2>&1)
  cp -L /root/llama/cpu/bin/libllama-server-impl.so /root/llama/bin/ 2>/dev/null || find /root/llama/cpu -name 'libllama-server-impl.so*' -exec cp -L {} /root/llama/bin/ \;
fi
export LLAMA_SERVER=/root/llama/bin/llama-server
export LD_LIBRARY_PATH=/root/llama/bin:${LD_LIBRARY_PATH:-}
[ -f /root/vocab.gguf ] || xz -dc .llama/ggml-vocab-llama-bpe.gguf.xz > /root/vocab.gguf
export VOCAB=/root/vocab.gguf
mkdir -p /root/work
