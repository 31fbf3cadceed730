#!/usr/bin/env bash
# tests/engine_env.sh ENGINE VENV [REQS]: a virtual environment in which the real classes of an LLM engine import
# on a CPU-only machine, for its tests in tests/integration (ENGINE: vllm or sglang; tests/vllm_env.sh and
# tests/sglang_env.sh call this). The project with its test extras, torch 2.13.0 (the CPU build: where pip
# finds that file on disk, no CUDA download), then the engine and the packages its imports reach, all
# --no-deps at the versions in REQS (tests/ENGINE_cpu_requirements.txt by default; the engines' own metadata
# ask for other torch pins and several GB of CUDA packages), then tests/support/ENGINE_env_check.py, which
# imports the classes the hooks wrap and checks the engine's version against REQS's pin. Idempotent: a stamp in VENV records the inputs;
# nothing is done while they are unchanged. On failure: one line naming the step and the log, exit 1.
set -uo pipefail

if [ $# -lt 2 ] || [ $# -gt 3 ] || [ -z "$1" ] || [ -z "$2" ]; then
  echo "usage: tests/engine_env.sh vllm|sglang VENV [REQS]" >&2
  exit 2
fi
engine=$1 venv=$2
root=$(cd "$(dirname "$0")/.." && pwd)
reqs=${3:-tests/${engine}_cpu_requirements.txt}
check=tests/support/${engine}_env_check.py
[ -f "$root/$reqs" ] && [ -f "$root/$check" ] || { echo "${engine}_env: no $reqs or $check" >&2; exit 2; }
python=${PYTHON:-python3}
torch_pin=torch==2.13.0

# What the environment is built from: these scripts, the pins, the engine's support files, and the
# project (its metadata, native code and Python sources, since the project is installed, not linked).
inputs=$(cd "$root" && { ls tests/engine_env.sh "tests/${engine}_env.sh" "$reqs" tests/support/"${engine}"_*.py
         find pyproject.toml setup.py native/src native/include src -type f ! -path '*/__pycache__/*' \
           ! -path '*.egg-info/*' ! -path '*/_lib/*'; } 2>/dev/null)
digest=$(cd "$root" && printf '%s\n' $inputs | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -d' ' -f1)
stamp=$venv/.${engine}-env-stamp
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$digest" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi

mkdir -p "$venv" || { echo "${engine}_env: cannot create $venv"; exit 1; }
log=$(cd "$venv" && pwd)/${engine}-env.log
: >"$log"
step() {  # step NAME CMD...: run CMD with its output in the log; on failure one line and exit 1
  local name=$1; shift
  echo "== $name: $*" >>"$log"
  if ! "$@" >>"$log" 2>&1; then
    echo "${engine}_env: $name failed (log: $log)"
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
step "$engine" "${pip[@]}" install -q --no-deps -r "$reqs"
step import env ENGINE_REQS="$root/$reqs" "$venv/bin/python" "$check"
echo "$digest" >"$stamp"
