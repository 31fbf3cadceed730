#!/usr/bin/env bash
# The proxy's own time per request on a GPU llama-server, in one command (about 2 minutes on an H200
# with the random 8B model, most of it loading the model):
#
#   LLAMA_SERVER=BIN MODEL=GGUF [OLD_SRC=DIR] [N=100] examples/llamacpp/gpu_proxy_cost.sh
#
# One client, nothing else in flight: N requests (1,800-token prompts, 16 tokens out) straight to the
# server and N through the proxy, alternating; prints what the proxy adds to the answer's head, first
# event and end, and its CPU per request (bench/perf/perf_proxy_overhead.py --serial). With OLD_SRC (the
# src/ folder of another checkout, e.g. `git archive 8852d29 src native/include | tar -x -C /tmp/old`
# then OLD_SRC=/tmp/old/src) a second proxy from there takes its turn in every round. Throughput
# through the proxy under 16 clients on one server: bench/server/run_server_bench.py --proxy-pairs N.
# Results: $OUT/proxy_serial.json (OUT defaults to ./gpu-proxy-cost-out).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
: "${LLAMA_SERVER:?set LLAMA_SERVER to a llama-server binary}" "${MODEL:?set MODEL to a GGUF model}"
OUT="${OUT:-$PWD/gpu-proxy-cost-out}"
mkdir -p "$OUT"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
cd "$root"
# --no-census: the server runs without the injector here (the GPU ledger then reads an empty folder)
"${PYTHON:-python3}" bench/perf/perf_proxy_overhead.py --serial "${N:-100}" --tokens 16 --prompt-tokens 1800 \
  --server "$LLAMA_SERVER" --model "$MODEL" --server-args "-ngl 99 -np 16 -c 32768" --exporter none \
  --no-census ${OLD_SRC:+--also-src "$OLD_SRC"} --json "$OUT/proxy_serial.json" 2>&1 | tail -4
