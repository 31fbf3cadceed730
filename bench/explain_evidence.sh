#!/bin/bash
# The evidence for the report's diagnoses on llama-server's prompt cache, on a GPU machine (an H200), in one
# call of about 4-5 minutes once llama-server is built (torch for the last two runs):
#     bash bench/device/run.sh setup explain        # after `run.sh setup llama` on the same machine
# (or OUT=DIR bash bench/explain_evidence.sh with the package importable). It writes $OUT/explain-hybrid/ and
# $OUT/explain-hybrid.tgz (well under 2 MB), which becomes bench/results/<date>-h200-explain-hybrid.tgz, the
# archive tests/unit/test_diagnose_recorded.py reads.
#
# llama-server (/root/llama-server.path) with a random 7.9B granitehybrid (made here once, /root/hybrid.gguf)
# and the dense 8B of the llama phase (/root/m8b.gguf), 16 slots, 16 clients (bench/server/load.py: distinct
# prompts of 1800 tokens, 64 output tokens; $REQUESTS requests, 32 for the proxy and precise runs), each run in
# its own census folder:
#   hybrid-default          default flags, `run --requests`                 -> the state save, its flags
#   hybrid-nocache          --cache-ram 0 --ctx-checkpoints 0               -> no state save
#   hybrid-default-proxy    default flags, `run --proxy`: every request known to the report
#   hybrid-default-precise  default flags, `run --precise` (CUPTI; `--activity on` where --precise is not there yet)
#   dense-default           the dense 8B, default flags
#   own-pageable / own-pinned   bench/server/own_program.py: a user's torch loop copying its logits to pageable
#                           memory (-> pageable host memory on a hot path) or to a pinned buffer (-> nothing)
# Kept per run (DIR/<run>/): census/ (the segment), requests.jsonl (the clients' request log), load.txt (the
# load's summary), run.txt and run.json (the report `run` printed and wrote at the end, with the windows it kept
# over the run and, under --proxy, the proxy's requests), report.txt / report.json (`report --request-log`
# afterwards: request boundaries known), report-count.txt (`report --requests N`: only the count),
# server-cache.txt (llama-server's log lines about its prompt cache and checkpoints). Runs go in order of
# importance; one that would start after BUDGET_S is skipped, saying so.
set -u
cd "$(dirname "$0")/.."
W=${OUT:-/tmp}/explain-hybrid; rm -rf "$W"; mkdir -p "$W"
OGC="python3 -m otel_gpu_census.cli"
LLAMA_SERVER=${LLAMA_SERVER:-$(cat /root/llama-server.path 2>/dev/null)}
VOCAB=${VOCAB:-/root/vocab-llama-bpe.gguf}
HYBRID=${HYBRID:-/root/hybrid.gguf}
DENSE=${DENSE:-/root/m8b.gguf}
REQUESTS=${REQUESTS:-64}
BUDGET_S=${BUDGET_S:-330}
PORT=8191; PPORT=8192
T0=$(date +%s)
[ -x "$LLAMA_SERVER" ] || { echo "explain: no llama-server (run.sh llama first)"; exit 1; }
[ -f "$HYBRID" ] || python3 bench/server/make_model.py "$HYBRID" --vocab "$VOCAB" --preset hybrid || exit 1
[ -f "$DENSE" ] || python3 bench/server/make_model.py "$DENSE" --vocab "$VOCAB" --preset 8b || exit 1
PRECISE=--precise; $OGC run --help | grep -q -- --precise || PRECISE="--activity on"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; "$LLAMA_SERVER" --version 2>&1 | head -2
  echo "precise census: run $PRECISE; requests per run: $REQUESTS"; } > "$W/versions.txt"
echo "explain: models ready after $(( $(date +%s) - T0 )) s"

serve_run() {   # name model requests -- `run` options -- llama-server flags
  local name=$1 model=$2 REQUESTS=$3; shift 4
  local runopts=() load_port=$PORT
  while [ "$1" != "--" ]; do runopts+=("$1"); shift; done; shift
  [[ " ${runopts[*]} " == *" --proxy "* ]] && load_port=$PPORT
  if [ $(( $(date +%s) - T0 )) -gt "$BUDGET_S" ]; then echo "== $name: skipped, past ${BUDGET_S} s"; return; fi
  local D=$W/$name
  mkdir -p "$D" && mkdir -m 700 -p "$D/census"
  $OGC run --dir "$D/census" --requests "$REQUESTS" --json "$D/run.json" "${runopts[@]}" -- \
    "$LLAMA_SERVER" -m "$model" -np 16 -c 32768 -ngl 99 --host 127.0.0.1 --port $PORT "$@" \
    > /dev/null 2> "$D/run.stderr" &
  local pid=$! up=0
  for _ in $(seq 240); do
    curl -sf "http://127.0.0.1:$load_port/health" > /dev/null 2>&1 && { up=1; break; }
    kill -0 $pid 2>/dev/null || break
    sleep 0.25
  done
  if [ $up = 1 ]; then
    timeout 200 python3 bench/server/load.py --url "http://127.0.0.1:$load_port" --clients 16 \
      --requests "$REQUESTS" --n-predict 64 --request-log "$D/requests.jsonl" > "$D/load.out" 2>&1
    tail -1 "$D/load.out" > "$D/load.txt"; rm -f "$D/load.out"
  else
    echo "$name: llama-server did not answer /health (see $D/run.stderr)"
  fi
  kill -TERM $pid 2>/dev/null          # `run` passes it on; llama-server exits, `run` writes its report
  for _ in $(seq 120); do kill -0 $pid 2>/dev/null || break; sleep 0.5; done
  kill -KILL $pid 2>/dev/null; wait $pid 2>/dev/null
  sed -n '/^otel-gpu-census report:/,$p' "$D/run.stderr" > "$D/run.txt"
  grep -iE "prompt cache|checkpoint|cache state|cache_ram|saving" "$D/run.stderr" | head -200 > "$D/server-cache.txt"
  rm -f "$D/run.stderr"
  if [ -s "$D/requests.jsonl" ]; then
    $OGC report "$D/census" --request-log "$D/requests.jsonl" > "$D/report.txt" 2>&1
    $OGC report "$D/census" --request-log "$D/requests.jsonl" --json > "$D/report.json" 2> /dev/null
    $OGC report "$D/census" --requests "$REQUESTS" > "$D/report-count.txt" 2>&1
  fi
  echo "== $name ($(( $(date +%s) - T0 )) s): $(cut -c1-200 "$D/load.txt" 2>/dev/null)"
  sed -n '/^per request while serving/,/^$/p;/^per request over the whole run/,/^$/p' "$D/run.txt" | head -6
  sed -n '/^diagnoses:/,$p' "$D/run.txt" | cut -c1-400
}

own_run() {   # name -- own_program.py options: the user's own program, `run --requests` around it
  local name=$1; shift 2
  if [ $(( $(date +%s) - T0 )) -gt "$BUDGET_S" ]; then echo "== $name: skipped, past ${BUDGET_S} s"; return; fi
  local D=$W/$name
  mkdir -p "$D" && mkdir -m 700 -p "$D/census"
  timeout 120 $OGC run --dir "$D/census" --requests 24 --json "$D/run.json" -- \
    python3 bench/server/own_program.py --requests 24 --request-log "$D/requests.jsonl" "$@" > /dev/null 2> "$D/run.stderr"
  sed -n '/^otel-gpu-census report:/,$p' "$D/run.stderr" > "$D/run.txt"; rm -f "$D/run.stderr"
  if [ -s "$D/requests.jsonl" ]; then
    $OGC report "$D/census" --request-log "$D/requests.jsonl" > "$D/report.txt" 2>&1
    $OGC report "$D/census" --request-log "$D/requests.jsonl" --json > "$D/report.json" 2> /dev/null
    $OGC report "$D/census" --requests 24 > "$D/report-count.txt" 2>&1
  fi
  echo "== $name ($(( $(date +%s) - T0 )) s)"; sed -n '/^diagnoses:/,$p' "$D/run.txt" | cut -c1-300
}

serve_run hybrid-default "$HYBRID" "$REQUESTS" -- --
serve_run hybrid-nocache "$HYBRID" "$REQUESTS" -- -- --cache-ram 0 --ctx-checkpoints 0
serve_run hybrid-default-proxy "$HYBRID" 32 -- --proxy 127.0.0.1:$PPORT --
serve_run hybrid-default-precise "$HYBRID" 32 -- $PRECISE --
serve_run dense-default "$DENSE" "$REQUESTS" -- --
own_run own-pageable --
own_run own-pinned -- --pinned

cd "$W" && tar czf "${OUT:-/tmp}/explain-hybrid.tgz" .
size=$(stat -c %s "${OUT:-/tmp}/explain-hybrid.tgz")
echo "explain: ${OUT:-/tmp}/explain-hybrid.tgz, $size bytes, $(( $(date +%s) - T0 )) s in all"
[ "$size" -lt 2000000 ] || echo "explain: WARNING the archive is over 2 MB"
