#!/bin/bash
# Device call A: 8B random model; llama-server default vs --cache-ram 0 --ctx-checkpoints 0,
# plain / census / census+proxy (spans to the console exporter); census report --requests.
set -u
cd "$(dirname "$0")/../.."
source tests/gpu/device_setup.sh
T0=$SECONDS
[ -f /root/work/m8b.gguf ] || python3 bench/server/make_model.py /root/work/m8b.gguf --vocab $VOCAB --preset 8b > $OUT/make_model.log 2>&1
echo "model ready after $((SECONDS-T0)) s" | tee -a $OUT/make_model.log
timeout 500 python3 bench/server/run_server_bench.py --server $LLAMA_SERVER --model /root/work/m8b.gguf \
  --out /root/work/server_a --rounds 1 --flag-sets default,nocache --variants plain,census,census+proxy \
  --census-mode env --proxy-traces-exporter console --keep-segments --budget-s $((540-(SECONDS-T0))) \
  --warmup-requests 0 > $OUT/server_a.log 2>&1
tail -40 $OUT/server_a.log
cd /root/work && tar czf $OUT/server_a.tgz server_a 2>/dev/null; ls -la $OUT
