#!/bin/bash
# The evidence for the report's diagnoses, on a GPU machine (an H200), in one call of < 10 min:
#     bash bench/explain_evidence.sh            # results under $OUT/explain (and explain.tgz)
# Runs, each under `otel-gpu-census run` in its own census folder, with the clients' request log:
#   default   llama-server, default flags, 16 clients x 64 requests  -> the state-save diagnosis
#   nocache   --cache-ram 0 --ctx-checkpoints 0, same load           -> no state save
#   client1   nocache, 1 client x 24 requests                        -> busy vs few requests in flight
#   offload   nocache, -ngl 16 (half the layers on the CPU), 2 x 4   -> weights copied for every batch
#   matmul / tiny  tests/gpu/busy_loops.py, SM occupancy from NVML GPM -> the occupancy diagnosis
# then `report --request-log` on each (report.txt / report.json in each run's folder) and
# `report --diff default nocache` (diff.txt). Prints every run's diagnoses; a run that fails says why
# and the others go on. Run through `bash bench/device/run.sh setup llama explain` (the carried wheels,
# the injector against libcupti 13.5, llama-server built for sm_90 and the 8B model), and torch for
# the busy loops.
set -u
cd "$(dirname "$0")/.."
W=${OUT:-/tmp}/explain; mkdir -p "$W"
OGC="python3 -m otel_gpu_census.cli"
MODEL=${MODEL:-/root/m8b.gguf}
LLAMA_SERVER=${LLAMA_SERVER:-$(cat /root/llama-server.path 2>/dev/null)}
PORT=8191
[ -x "$LLAMA_SERVER" ] && [ -f "$MODEL" ] || { echo "explain: no llama-server or model (run.sh llama first)"; exit 1; }

show() {   # name: the diagnoses of one run's report
  local n; n=$(grep -c '^  \* ' "$W/$1/report.txt" 2>/dev/null)
  echo "== $1: ${n:-0} diagnoses"
  sed -n '/^diagnoses:/,$p' "$W/$1/report.txt" | tail -n +2 | cut -c1-400
}

serve_run() {   # name clients requests n_predict -- llama-server flags...
  local name=$1 clients=$2 requests=$3 npred=$4; shift 5
  local D=$W/$name
  mkdir -p "$D" && mkdir -m 700 -p "$D/census"
  $OGC run --dir "$D/census" --requests "$requests" --json "$D/run.json" -- \
    "$LLAMA_SERVER" -m $MODEL -np 16 -c 32768 --host 127.0.0.1 --port $PORT "$@" > "$D/server.log" 2> "$D/run.stderr" &
  local pid=$! up=0
  for _ in $(seq 240); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null 2>&1 && { up=1; break; }
    kill -0 $pid 2>/dev/null || break
    sleep 0.5
  done
  if [ $up = 1 ]; then
    timeout 200 python3 bench/server/load.py --url "http://127.0.0.1:$PORT" --clients "$clients" --requests "$requests" \
      --n-predict "$npred" --out "$D/load.json" --request-log "$D/requests.jsonl" > "$D/load.txt" 2>&1
    tail -1 "$D/load.txt" | cut -c1-300
  else
    echo "$name: llama-server did not answer /health (see $D/server.log, $D/run.stderr)"
  fi
  kill -TERM $pid 2>/dev/null
  for _ in $(seq 60); do kill -0 $pid 2>/dev/null || break; sleep 0.5; done
  kill -KILL $pid 2>/dev/null; wait $pid 2>/dev/null
  if [ -s "$D/requests.jsonl" ]; then
    $OGC report "$D/census" --requests "$requests" --request-log "$D/requests.jsonl" > "$D/report.txt" 2>&1
    $OGC report "$D/census" --requests "$requests" --request-log "$D/requests.jsonl" --json > "$D/report.json" 2> /dev/null
    show "$name"
  fi
}

serve_run default 16 64 64 -- -ngl 99
serve_run nocache 16 64 64 -- -ngl 99 --cache-ram 0 --ctx-checkpoints 0
serve_run client1 1 24 64 -- -ngl 99 --cache-ram 0 --ctx-checkpoints 0
serve_run offload 2 4 16 -- -ngl 16 --cache-ram 0 --ctx-checkpoints 0

$OGC report --diff "$W/default/census" "$W/nocache/census" --requests 64 > "$W/diff.txt" 2>&1
echo "== diff default -> nocache (per request, device-to-host):"
sed -n '/^per request/,$p' "$W/diff.txt" | grep -A3 "^device-to-host" | cut -c1-120

# The busy loops, each in its own census folder (the script makes them under TMPDIR), with the
# medians of NVML GPM's SM occupancy while each ran (busy_gap.json).
BG=tests/gpu_busy_gap.py; [ -f $BG ] || BG=bench/perf/gpu_busy_gap.py
mkdir -p "$W/busy/tmp"
TMPDIR="$W/busy/tmp" timeout 150 python3 $BG --seconds 12 --loops matmul,tiny --out "$W/busy" > "$W/busy/busy_gap.txt" 2>&1
for loop in matmul tiny; do
  occ=$(python3 -c "import json,sys; r=[x for x in json.load(open(sys.argv[1])) if x['loop']==sys.argv[2]][0]; v=r['steady']['gpu_census.sm.occupancy'][0]; print('' if v is None else v)" "$W/busy/busy_gap.json" $loop 2>/dev/null)
  dir=$(ls -d "$W/busy/tmp"/busy-$loop-* 2>/dev/null | head -1)
  mkdir -p "$W/$loop"
  if [ -n "$occ" ] && [ -n "$dir" ]; then
    $OGC report "$dir" --sm-occupancy "$occ" > "$W/$loop/report.txt" 2>&1
    $OGC report "$dir" --sm-occupancy "$occ" --json > "$W/$loop/report.json" 2> /dev/null
    cp -r "$dir" "$W/$loop/census"
    echo "$loop: SM occupancy $occ (GPM median)"; show $loop
  else
    echo "$loop: no SM occupancy or no census folder (see $W/busy/busy_gap.txt)"
  fi
done
rm -rf "$W/busy/tmp"
cd "$W" && tar czf "${OUT:-/tmp}/explain.tgz" --exclude='*.gguf' .
