#!/usr/bin/env bash
# Fills .whl/ (ignored; carried to the GPU machine, which has no network) with the wheels the package
# needs there and the machine's image lacks: OpenTelemetry, cffi, and CUPTI 13.5 with the CUDA headers
# the injector builds against. Versions are those of the local test venv (.venv), so what runs on the
# GPU is what the CPU suite tested. Run where PyPI is reachable:  bash bench/device/wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
py=${PYTHON:-.venv/bin/python}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
pins=$("$py" -m pip freeze | grep -iE '^(opentelemetry-|cffi==|pycparser==|googleapis-common-protos==|importlib.metadata==|nvidia-cuda-(cupti|runtime|crt)==)' \
       | grep -viE 'opentelemetry-instrumentation-' || true)
[ -n "$pins" ] || { echo "wheels.sh: no pins from $py (run make install first)" >&2; exit 1; }
rm -rf .whl && mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_25_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $pins
du -sh .whl
