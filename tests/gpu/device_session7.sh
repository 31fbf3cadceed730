#!/bin/bash
# Device calls E4 and E5 (run warm after device_session6.sh): the cost of kernel tracing on ONE
# llama-server (traced vs untraced phases), the sidecar's CPU with NVML's share per call, and restart
# pairs plain vs sampled kernels (100/1000) with the segments kept for inspection.
set -u
cd "$(dirname "$0")/../.."
source tests/gpu/device_setup.sh
W=/root/work/e4; mkdir -p $W
# E4
timeout 330 python3 bench/server/run_server_bench.py --server $LLAMA_SERVER --model /root/work/m8b.gguf \
  --out $W/kphase --kernel-phase-pairs 8 --flag-sets nocache --census-mode env --budget-s 320 > $W/kphase.log 2>&1
grep -v "^\[" $W/kphase.log | tail -16
timeout 70 python3 tests/perf_sidecar_cpu.py --workload cuda --seconds 25 --out $W/sidecar_cpu > $W/sidecar.txt 2>&1
tail -1 $W/sidecar.txt
# E5
timeout 150 python3 bench/server/run_server_bench.py --server $LLAMA_SERVER --model /root/work/m8b.gguf \
  --out $W/sampled.json --rounds 4 --flag-sets nocache --variants plain,census-sampled --sample 100/1000 \
  --census-mode env --warmup-requests 0 --budget-s 140 --cycle-estimate-s 16 --keep-segments > $W/sampled.log 2>&1
grep -v "^\[" $W/sampled.log | tail -6
python3 -m otel_gpu_census.cli report "$(ls -d $W/server-work/census-* | tail -1)" | head -30
cd $W && tar czf $OUT/session_e4.tgz --exclude='*.gguf' .
