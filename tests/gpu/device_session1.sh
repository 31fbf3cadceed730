#!/bin/bash
# One device call: install carried wheels, start the llama-server CUDA build in the background,
# run the GPU census tests, the micro benchmark if present; logs to $OUT.
set -u
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $OUT/pip.log 2>&1
mkdir -p /tmp/cupti135 && tar xJf .llama/cupti135.tar.xz -C /tmp/cupti135
export PYTHONPATH=/tmp/site
( nvidia-smi; nvcc --version | tail -1; python3 -c 'import torch; print(torch.__version__, torch.version.cuda)'; ls /tmp/cupti135/nvidia/cu13/lib ) > $OUT/env.txt 2>&1
# llama-server build, in its own session so it outlives this call (used by the next one)
if [ ! -x /root/llama/build/bin/llama-server ]; then
  mkdir -p /root/llama && tar xJf .llama/llama-src.tar.xz -C /root/llama && cp .llama/*.gguf /root/llama/
  setsid nohup bash -c 'cd /root/llama/llama.cpp && cmake -B /root/llama/build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release > /root/llama/cmake.log 2>&1 && nice -n 5 cmake --build /root/llama/build --target llama-server -j 14 > /root/llama/build.log 2>&1; echo $? > /root/llama/build.rc' > /dev/null 2>&1 &
fi
export OTEL_GPU_CENSUS_LIB=$PWD/native/build/libotel_gpu_census.so
export OTEL_GPU_CENSUS_CUPTI=/tmp/cupti135/nvidia/cu13/lib/libcupti.so.13
timeout 420 python3 -m pytest -q -m gpu tests/gpu --noconftest -p no:cacheprovider -o addopts="" -rA 2>&1 | tee $OUT/gpu_tests.log | tail -40
cp /root/llama/cmake.log $OUT/ 2>/dev/null; tail -5 /root/llama/build.log > $OUT/llama_build_tail.log 2>/dev/null
