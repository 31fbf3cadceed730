#!/bin/bash
# Device call E3: sampled-kernel GPU tests again (v2 clock fix), the proxy's cost on ONE server
# (direct vs proxy loads, ABBA), the cost of kernel tracing on ONE server (traced vs untraced phases
# of OTEL_GPU_CENSUS_KERNELS=14000/28000), the hybrid model with --cache-ram 0 --ctx-checkpoints 0.
set -u
cd "$(dirname "$0")/../.."
T0=$SECONDS
W=/root/work/e3; mkdir -p $W
( source tests/gpu/device_setup.sh
  [ -f /root/work/m8b.gguf ] || python3 bench/server/make_model.py /root/work/m8b.gguf --vocab $VOCAB --preset 8b
  [ -f /root/work/hybrid.gguf ] || python3 bench/server/make_model.py /root/work/hybrid.gguf --vocab $VOCAB --preset hybrid
) > $W/setup.log 2>&1 &
SETUP=$!
sleep 20
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src OTEL_GPU_CENSUS_LIB=$PWD/native/build/libotel_gpu_census.so
[ -d /tmp/cupti135 ] || { mkdir -p /tmp/cupti135 && tar xJf .llama/cupti135.tar.xz -C /tmp/cupti135; }
export OTEL_GPU_CENSUS_CUPTI=/tmp/cupti135/nvidia/cu13/lib/libcupti.so.13
timeout 100 python3 -m pytest -q -m gpu tests/gpu -k sampled --noconftest -p no:cacheprovider -o addopts="" -rA \
  > $W/gpu_tests.log 2>&1; cp $OUT/gpu_census.json $W/ 2>/dev/null
grep -E "^(PASSED|FAILED)|passed|failed" $W/gpu_tests.log | tail -5; echo "tests at $((SECONDS-T0)) s"
wait $SETUP; echo "setup at $((SECONDS-T0)) s"; tail -2 $W/setup.log
source tests/gpu/device_setup.sh
timeout 175 python3 bench/server/run_server_bench.py --server $LLAMA_SERVER --model /root/work/m8b.gguf \
  --out $W/proxy --proxy-pairs 6 --flag-sets nocache --census-mode env --budget-s 165 > $W/proxy.log 2>&1
grep -v "^\[" $W/proxy.log | tail -8; echo "proxy at $((SECONDS-T0)) s"
LEFT=$((500 - (SECONDS-T0)))
timeout $LEFT python3 bench/server/run_server_bench.py --server $LLAMA_SERVER --model /root/work/m8b.gguf \
  --out $W/kphase --kernel-phase-pairs 8 --flag-sets nocache --census-mode env --budget-s $((LEFT-10)) > $W/kphase.log 2>&1
grep -v "^\[" $W/kphase.log | tail -10; echo "kphase at $((SECONDS-T0)) s"
LEFT=$((585 - (SECONDS-T0)))
timeout $LEFT python3 bench/server/run_server_bench.py --server $LLAMA_SERVER --model /root/work/hybrid.gguf \
  --out $W/hybrid_nocache.json --rounds 1 --flag-sets nocache --variants census --census-mode env \
  --warmup-requests 0 --server-args "-lv 4" --budget-s $((LEFT-5)) --cycle-estimate-s 25 > $W/hybrid.log 2>&1
grep -v "^\[" $W/hybrid.log | tail -5; echo "total $((SECONDS-T0)) s"
cd $W && tar czf $OUT/session_e3.tgz --exclude='*.seg' --exclude='*.gguf' . ; ls $OUT
