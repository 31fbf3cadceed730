#!/bin/bash
# Device call E1: GPU census tests (incl. sampled kernels on both CUPTI APIs), micro benchmark with the
# kernel modes (plain / floor / census / census-kernels-off / census-sampled), llama-server 8B pairs
# plain / census / census-sampled (nocache flags). Budget ~560 s.
set -u
cd "$(dirname "$0")/../.."
T0=$SECONDS
mkdir -p /root/work/e1
# llama-server's host library and the 8B model build in the background while the GPU tests run.
( source tests/gpu/device_setup.sh
  [ -f /root/work/m8b.gguf ] || python3 bench/server/make_model.py /root/work/m8b.gguf --vocab $VOCAB --preset 8b
) > /root/work/e1/setup.log 2>&1 &
SETUP=$!
sleep 20   # the wheels are installed by then (the setup's first step)
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src OTEL_GPU_CENSUS_LIB=$PWD/native/build/libotel_gpu_census.so
[ -d /tmp/cupti135 ] || { mkdir -p /tmp/cupti135 && tar xJf .llama/cupti135.tar.xz -C /tmp/cupti135; }
export OTEL_GPU_CENSUS_CUPTI=/tmp/cupti135/nvidia/cu13/lib/libcupti.so.13
timeout 200 python3 -m pytest -q -m gpu tests/gpu --noconftest -p no:cacheprovider -o addopts="" -rA \
  > /root/work/e1/gpu_tests.log 2>&1; cp $OUT/gpu_census.json /root/work/e1/ 2>/dev/null
grep -E "passed|failed|PASSED|FAILED|Error" /root/work/e1/gpu_tests.log | tail -16
echo "gpu tests done at $((SECONDS-T0)) s"
wait $SETUP; echo "setup done at $((SECONDS-T0)) s"; tail -3 /root/work/e1/setup.log
source tests/gpu/device_setup.sh
make -C bench/floor > /root/work/e1/floor_build.log 2>&1 || tail -5 /root/work/e1/floor_build.log
timeout 130 python3 bench/micro.py --out /root/work/e1/micro.json --rounds 3 \
  --variants plain,floor,census,census-kernels-off,census-sampled --sample 100/1000 \
  --eager-n 100000 --graph-replays 100 --budget-s 120 > /root/work/e1/micro.log 2>&1; tail -14 /root/work/e1/micro.log
echo "micro done at $((SECONDS-T0)) s"
LEFT=$((555 - (SECONDS-T0)))
timeout $LEFT python3 bench/server/run_server_bench.py --server $LLAMA_SERVER --model /root/work/m8b.gguf \
  --out /root/work/e1/server.json --rounds 6 --flag-sets nocache --variants plain,census,census-sampled \
  --sample 100/1000 --census-mode env --budget-s $((LEFT-15)) --warmup-requests 0 --cycle-estimate-s 16 \
  > /root/work/e1/server.log 2>&1; tail -12 /root/work/e1/server.log
echo "total $((SECONDS-T0)) s"
cd /root/work/e1 && tar czf $OUT/session_e1.tgz --exclude='*.seg' --exclude='*.gguf' . && ls -la $OUT
