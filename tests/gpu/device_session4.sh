#!/bin/bash
# Device call D: GPU census tests again (flusher thread, two processes on one GPU), llama-server
# plain / census / census+proxy pairs after the proxy fix, NVML/GPM metrics and the busy gap.
set -u
cd "$(dirname "$0")/../.."
source tests/gpu/device_setup.sh
T0=$SECONDS
mkdir -p /root/work/d
timeout 150 python3 -m pytest -q -m gpu tests/gpu --noconftest -p no:cacheprovider -o addopts="" -rA \
  > /root/work/d/gpu_tests.log 2>&1; cp $OUT/gpu_census.json /root/work/d/ 2>/dev/null; tail -12 /root/work/d/gpu_tests.log
[ -f /root/work/m8b.gguf ] || python3 bench/server/make_model.py /root/work/m8b.gguf --vocab $VOCAB --preset 8b > /root/work/d/make_model.log 2>&1
timeout 200 python3 bench/server/run_server_bench.py --server $LLAMA_SERVER --model /root/work/m8b.gguf \
  --out /root/work/d/server --rounds 3 --flag-sets nocache --variants plain,census,census+proxy --census-mode env \
  --budget-s 190 --warmup-requests 0 > /root/work/d/server.log 2>&1; tail -8 /root/work/d/server.log
timeout 70 python3 -m pytest -q -s -p no:cacheprovider -o addopts="" tests/test_metrics_nvml.py > /root/work/d/metrics_nvml.log 2>&1; tail -4 /root/work/d/metrics_nvml.log
timeout 75 python3 tests/gpu_busy_gap.py --seconds 10 --out /root/work/d/busy_gap > /root/work/d/busy_gap.txt 2>&1; tail -30 /root/work/d/busy_gap.txt
echo "total $((SECONDS-T0)) s"
cd /root/work/d && tar czf $OUT/session_d.tgz --exclude='*.seg' --exclude='*.gguf' . && ls -la $OUT
