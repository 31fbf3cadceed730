#!/usr/bin/env bash
# The install lines a user types, each in a fresh virtual environment (what .ci/run checks):
#   pip install .                  the core: run, report, doctor, the vLLM/SGLang hooks, OTLP
#   pip wheel . -w DIR             a wheel of the same
#   pip install 'WHEEL[proxy]'     + the tracing proxy          (what '.[proxy]' installs)
#   pip install 'WHEEL[prometheus]' + a Prometheus endpoint
#   pip install 'WHEEL[cupti]'     + libcupti for the precise census
#   pip install WHEEL              in a venv of another Python than the one that built it (py3-none-manylinux tag)
# and that each path without its extra says so in one line naming the extra. The extras install from the
# wheel built once (same metadata as the checkout, one build instead of four).
#
#   tests/install_paths.sh [WORKDIR]     exit 0 when every line works; one line per check either way
# OTHER_PYTHON names the second Python; else the first python3.9..3.13 (on PATH or under pyenv's root) whose
# version is not $PYTHON's. Without one, that check says it did not run.
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$(mktemp -d /tmp/otel-gpu-census-install.XXXXXX)}
python=${PYTHON:-python3}
sample=$root/examples/census/llama-default
failed=0
cd "$root" || exit 1

say() { echo "install: $*"; }
check() {  # check WHAT CMD...: run CMD, say ok/FAILED with WHAT
  local what=$1; shift
  local out
  if out=$("$@" 2>&1); then
    say "ok      $what"
  else
    say "FAILED  $what"
    printf '%s\n' "$out" | tail -n 15 | sed 's/^/    /'
    failed=1
  fi
}
says() {  # says WHAT TEXT CMD...: CMD fails and its output has TEXT (a path without its extra)
  local what=$1 text=$2; shift 2
  local out
  out=$("$@" 2>&1)
  if [ $? -ne 0 ] && grep -qF -- "$text" <<<"$out"; then
    say "ok      $what"
  else
    say "FAILED  $what (wanted a failure saying: $text)"
    printf '%s\n' "$out" | tail -n 15 | sed 's/^/    /'
    failed=1
  fi
}
venv() {  # venv NAME: a fresh virtual environment's directory
  rm -rf "$work/$1" && "$python" -m venv "$work/$1" && "$work/$1/bin/pip" install -q --upgrade pip >/dev/null 2>&1
  echo "$work/$1"
}

# -- pip install . : the core ----------------------------------------------------------------------------
core=$(venv core)
check "pip install . (core)" "$core/bin/pip" install -q .
check "core: otel-gpu-census --help" "$core/bin/otel-gpu-census" --help
check "core: the vLLM and SGLang hooks import" "$core/bin/python" -c \
  "import otel_gpu_census.integrations.vllm, otel_gpu_census.integrations.sglang"
check "core: no proxy, Prometheus or CUPTI packages" "$core/bin/python" -c "
import importlib.util as u, importlib.metadata as m, sys
have = [n for n in ('aiohttp', 'yarl', 'multidict', 'prometheus_client') if u.find_spec(n)]
try:
    m.version('nvidia-cuda-cupti'); have.append('nvidia-cuda-cupti')
except m.PackageNotFoundError:
    pass
sys.exit(f'installed without being asked for: {have}' if have else 0)"
if [ -d "$sample" ]; then
  check "core: report on a sample census" "$core/bin/otel-gpu-census" report "$sample" --request-log "$sample/requests.jsonl"
fi
says "core: proxy names its extra" "pip install 'otel-gpu-census[proxy]'" \
  "$core/bin/otel-gpu-census" proxy --upstream http://127.0.0.1:9 --listen 127.0.0.1:0
says "core: Prometheus names its extra" "pip install 'otel-gpu-census[prometheus]'" "$core/bin/python" -c "
import logging, sys
logging.basicConfig()
from otel_gpu_census.telemetry.setup import build_readers
sys.exit(1 if not build_readers(['prometheus']).readers else 0)"

mkdir -p "$work/bare"          # a PATH with neither make nor a C compiler on it
says "without make or cc the build says which it lacks" "building the native census library needs make and a C compiler" \
  env PATH="$work/bare" "$core/bin/pip" install -q --no-cache-dir --force-reinstall --no-deps .

# -- pip wheel . : the same as a wheel, then each extra from it ------------------------------------------
check "pip wheel . --no-deps" "$core/bin/pip" wheel -q --no-deps -w "$work/dist" .
wheel=$(ls "$work"/dist/otel_gpu_census-*.whl 2>/dev/null | head -n 1)
if [ -z "$wheel" ]; then
  say "FAILED  no wheel in $work/dist"
  exit 1
fi
check "the wheel carries the native library" "$core/bin/python" -c "
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
sys.exit(0 if 'otel_gpu_census/_lib/libotel_gpu_census.so' in names else f'no library in {names[:5]}...')" "$wheel"

check "the wheel is tagged for any Python 3 on a glibc (py3-none-manylinux_X_Y)" \
  grep -qE -- '-py3-none-manylinux_[0-9]+_[0-9]+_[a-z0-9_]+\.whl$' <<<"$wheel"

version_of() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null; }
other=${OTHER_PYTHON:-}
if [ -z "$other" ]; then
  mine=$(version_of "$python")
  roots=$(command -v pyenv >/dev/null && pyenv root 2>/dev/null)
  for v in 3.12 3.9 3.13 3.10 3.11; do
    for c in "python$v" ${roots:+"$roots"/versions/$v.*/bin/python$v}; do
      if [ "$(version_of "$c")" = "$v" ] && [ "$v" != "$mine" ]; then other=$c; break 2; fi
    done
  done
fi
if [ -n "$other" ]; then
  rm -rf "$work/other" && "$other" -m venv "$work/other"
  check "the wheel in Python $(version_of "$other") (built by $(version_of "$python"))" \
    "$work/other/bin/pip" install -q "$wheel"
  check "Python $(version_of "$other"): the library loads and a sample census reports" "$work/other/bin/python" -c "
import subprocess, sys
from otel_gpu_census import _native
_native.load_library()
subprocess.run([sys.prefix + '/bin/otel-gpu-census', 'report', sys.argv[1]], check=True, stdout=subprocess.DEVNULL)" \
    "$sample"
else
  say "skip    the wheel in another Python: no second python3.9..3.13 found (set OTHER_PYTHON)"
fi

proxy=$(venv proxy)
check "pip install 'otel-gpu-census[proxy]' (the wheel)" "$proxy/bin/pip" install -q "$wheel[proxy]"
check "[proxy]: the proxy listens and stops" "$proxy/bin/python" -c "
from otel_gpu_census.integrations.llamacpp import ProxyConfig, start_proxy_in_thread
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
h = start_proxy_in_thread(ProxyConfig(upstream='http://127.0.0.1:9', listen_host='127.0.0.1', listen_port=0),
                          TracerProvider(), MeterProvider())
assert h.port
h.stop()"

prom=$(venv prometheus)
check "pip install 'otel-gpu-census[prometheus]' (the wheel)" "$prom/bin/pip" install -q "$wheel[prometheus]"
check "[prometheus]: the endpoint serves" "$prom/bin/python" -c "
import urllib.request
from otel_gpu_census.telemetry.setup import build_readers
out = build_readers(['prometheus'], prometheus_port=0)
assert out.prometheus_port, out.descriptions
urllib.request.urlopen(f'http://127.0.0.1:{out.prometheus_port}/metrics', timeout=5).read()
out.close()"

cupti=$(venv cupti)
check "pip install 'otel-gpu-census[cupti]' (the wheel)" "$cupti/bin/pip" install -q "$wheel[cupti]"
check "[cupti]: libcupti from the wheel is found" "$cupti/bin/python" -c "
import sys
from otel_gpu_census.cli.launcher import find_cupti
p = find_cupti({})
sys.exit(0 if p and sys.prefix in str(p.resolve()) else f'libcupti found at {p}, not in this venv')"

rm -rf "$work/core" "$work/other" "$work/proxy" "$work/prometheus" "$work/cupti" "$work/bare"
[ $failed -eq 0 ] && say "every install line works" || say "some install lines failed (above)"
exit $failed
