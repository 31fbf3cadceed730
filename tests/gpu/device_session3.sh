#!/bin/bash
# Device call B: launch-bound micro benchmark, busy-is-not-full metrics, reliability subset,
# llama-server plain vs census pairs (nocache flags).
set -u
cd "$(dirname "$0")/../.."
source tests/gpu/device_setup.sh
T0=$SECONDS
make -s -C bench/floor > $OUT/floor_build.log 2>&1
timeout 130 python3 bench/micro.py --out /root/work/micro --rounds 5 --eager-n 100000 --graph-replays 100 \
  --budget-s 110 > /root/work/micro.log 2>&1
for m in matmul tiny; do
  timeout 40 python3 -m otel_gpu_census.cli run --exporter console --metrics-interval 1 --dir /root/work/busy-$m \
    -- python3 tests/gpu/busy_loops.py $m 12 > /root/work/busy-$m.metrics 2> /root/work/busy-$m.report
done
timeout 180 python3 bench/reliability/run.py --out /root/work/reliability --server $LLAMA_SERVER --vocab $VOCAB \
  --budget-s 165 --cycles 40 --short-n 20 --reader-kills 10 > /root/work/reliability.log 2>&1
timeout $((575-(SECONDS-T0))) python3 bench/server/run_server_bench.py --server $LLAMA_SERVER --model /root/work/m8b.gguf \
  --out /root/work/server_b --rounds 3 --flag-sets nocache --variants plain,census --census-mode env \
  --budget-s $((565-(SECONDS-T0))) --warmup-requests 0 > /root/work/server_b.log 2>&1
cd /root/work && tar czf $OUT/session_b.tgz micro micro.log busy-* reliability reliability.log server_b server_b.log 2>/dev/null
tail -30 /root/work/server_b.log; ls -la $OUT
