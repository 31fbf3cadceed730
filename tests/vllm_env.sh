#!/usr/bin/env bash
# tests/vllm_env.sh VENV: a virtual environment in which the real vLLM 0.25.1 classes import on a CPU-only
# machine, for tests/test_vllm_*.py. The project with its test extras, torch 2.13.0 (the CPU build: where
# pip finds that file on disk, no CUDA download), then vLLM and the packages its imports reach, all
# --no-deps at the versions in tests/vllm_cpu_requirements.txt (vLLM's own metadata asks for torch 2.11
# and several GB of CUDA packages). Idempotent: a stamp in VENV records the inputs; nothing is done
# while they are unchanged. On failure: one line naming the step and the log, and a non-zero exit.
set -uo pipefail

if [ $# -ne 1 ] || [ -z "$1" ]; then
  echo "usage: tests/vllm_env.sh VENV" >&2
  exit 2
fi
venv=$1
root=$(cd "$(dirname "$0")/.." && pwd)
reqs=$root/tests/vllm_cpu_requirements.txt
python=${PYTHON:-python3}
torch_pin=torch==2.13.0

# What the environment is built from: this script, the pins, and the project (its metadata, native code
# and Python sources, since the project is installed, not linked).
digest=$(cd "$root" && find tests/vllm_env.sh tests/vllm_cpu_requirements.txt pyproject.toml setup.py \
           native/src native/include src -type f ! -path '*/__pycache__/*' ! -path '*.egg-info/*' \
           ! -path '*/_lib/*' 2>/dev/null \
         | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1)
stamp=$venv/.vllm-env-stamp
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$digest" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi

mkdir -p "$venv" || { echo "vllm_env: cannot create $venv"; exit 1; }
log=$(cd "$venv" && pwd)/vllm-env.log
: >"$log"
step() {  # step NAME CMD...: run CMD with its output in the log; on failure one line and exit 1
  local name=$1; shift
  echo "== $name: $*" >>"$log"
  if ! "$@" >>"$log" 2>&1; then
    echo "vllm_env: $name failed (log: $log)"
    exit 1
  fi
}

rm -f "$stamp"
[ -x "$venv/bin/python" ] || step venv "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
step pip "${pip[@]}" install -q --upgrade pip
cd "$root" || exit 1
step project "${pip[@]}" install -q '.[test]' "$torch_pin"
# A CUDA build here would mean pip did not find the CPU file and downloaded GBs: say so rather than go on.
step torch-cpu "$venv/bin/python" -c "import sys, torch; sys.exit(0 if torch.version.cuda is None else 'torch is a CUDA build: ' + torch.__version__)"
step vllm "${pip[@]}" install -q --no-deps -r "$reqs"
step import "$venv/bin/python" -c "
import vllm, vllm.plugins
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.worker.worker_base import WorkerWrapperBase
from vllm.v1.worker.gpu_worker import Worker
from vllm.v1.engine.core import EngineCore, EngineCoreProc
from vllm.v1.request import Request
from vllm.entrypoints.generate.base.serving import GenerateBaseServing
assert vllm.__version__ == '0.25.1', vllm.__version__
"
echo "$digest" >"$stamp"
