#!/usr/bin/env bash
# tests/sglang_env.sh VENV: a virtual environment in which the real SGLang 0.5.23 classes import on a CPU-only
# machine, for tests/integration/test_sglang_*.py. The project with its test extras, torch 2.13.0 (the CPU
# build: where pip finds that file on disk, no CUDA download), then SGLang and the packages its imports reach,
# all --no-deps at the versions in tests/sglang_cpu_requirements.txt (SGLang's own metadata asks for torch
# 2.14.1 and several GB of CUDA packages). Idempotent: a stamp in VENV records the inputs; nothing is done
# while they are unchanged. On failure: one line naming the step and the log, and a non-zero exit.
set -uo pipefail

if [ $# -ne 1 ] || [ -z "$1" ]; then
  echo "usage: tests/sglang_env.sh VENV" >&2
  exit 2
fi
venv=$1
root=$(cd "$(dirname "$0")/.." && pwd)
reqs=$root/tests/sglang_cpu_requirements.txt
python=${PYTHON:-python3}
torch_pin=torch==2.13.0

# What the environment is built from: this script, the pins, and the project (its metadata, native code
# and Python sources, since the project is installed, not linked).
digest=$(cd "$root" && find tests/sglang_env.sh tests/sglang_cpu_requirements.txt tests/support/sglang_cpu.py pyproject.toml setup.py \
           native/src native/include src -type f ! -path '*/__pycache__/*' ! -path '*.egg-info/*' \
           ! -path '*/_lib/*' 2>/dev/null \
         | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1)
stamp=$venv/.sglang-env-stamp
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$digest" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi

mkdir -p "$venv" || { echo "sglang_env: cannot create $venv"; exit 1; }
log=$(cd "$venv" && pwd)/sglang-env.log
: >"$log"
step() {  # step NAME CMD...: run CMD with its output in the log; on failure one line and exit 1
  local name=$1; shift
  echo "== $name: $*" >>"$log"
  if ! "$@" >>"$log" 2>&1; then
    echo "sglang_env: $name failed (log: $log)"
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
step sglang "${pip[@]}" install -q --no-deps -r "$reqs"
step import "$venv/bin/python" -c "
import sys
sys.path.insert(0, '$root/tests/support')
import sglang_cpu
sglang_cpu.prepare()
import sglang, sglang.srt.plugins
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.schedule_batch import ScheduleBatch, Req
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer
from sglang.srt.observability.req_time_stats import ReqTimeStatsBase, APIServerReqTimeStats
assert sglang.__version__ == '0.5.23', sglang.__version__
"
echo "$digest" >"$stamp"
