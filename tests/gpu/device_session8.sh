#!/bin/bash
# The measurements the open targets still need, two device calls of < 10 min each (written
# 2026-11-29 when the device time ran out; not yet run). Call 1 cold (setup ~110 s: llama-server's
# host library; then the random 8B model):
#     bash tests/gpu/device_session8.sh a     # kernel tracing on one server, wave loads; sidecar CPU
# then, warm:
#     bash tests/gpu/device_session8.sh b     # the proxy on one server, llama-server -t 8 vs -t 16
# Each leaves its logs and JSON under $OUT (session8_<part>.tgz) and prints the summary lines.
#  a: issue 5 — does a wave load (same shape every load) tighten the traced/untraced ratio (0.940,
#     ±4 % load to load with free-running clients)? issue 3 — sidecar CPU after the point cut.
#  b: issue 4 — the proxy's 4 %: CPU contention with llama-server's 16 pool threads on 16 cores?
#     Same-server direct/proxy pairs with the server on 8 threads, then on 16, wave loads.
set -u
part=${1:?usage: device_session8.sh a|b}
cd "$(dirname "$0")/../.."
source tests/gpu/device_setup.sh
W=/root/work/e8$part; mkdir -p $W
[ -f /root/work/m8b.gguf ] || python3 bench/server/make_model.py /root/work/m8b.gguf --vocab $VOCAB --preset 8b > $W/make_model.log 2>&1
bench() { python3 bench/server/run_server_bench.py --server $LLAMA_SERVER --model /root/work/m8b.gguf \
            --flag-sets nocache --census-mode env --load-mode waves "$@"; }
case $part in
a)
  timeout 270 bench --out $W/kphase-waves.json --kernel-phase-pairs 6 --budget-s 260 > $W/kphase.log 2>&1
  grep -v "^\[" $W/kphase.log | tail -14
  timeout 70 python3 tests/perf_sidecar_cpu.py --workload cuda --seconds 25 --out $W/sidecar_cpu > $W/sidecar.txt 2>&1
  tail -1 $W/sidecar.txt ;;
b)
  for t in 8 16; do
    timeout 250 bench --out $W/proxy-t$t.json --proxy-pairs 8 --server-args "-t $t" --budget-s 240 \
      > $W/proxy-t$t.log 2>&1
    echo "llama-server -t $t:"; grep -v "^\[" $W/proxy-t$t.log | tail -5
  done ;;
*) echo "usage: device_session8.sh a|b" >&2; exit 2 ;;
esac
cd $W && tar czf $OUT/session8_$part.tgz --exclude='*.gguf' .
