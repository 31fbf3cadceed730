#!/usr/bin/env bash
# docs/phoenix-trace.png: the trace of one streamed chat request in Arize Phoenix's UI, taken by headless
# Chromium (Debian's `chromium`) in the same run of tests/integration/test_proxy_phoenix.py that checks the trace
# through Phoenix's API (the client's span, ours under it, GPU cost from a census segment).
#
#   docs/phoenix_screenshot.sh [OUT.png]          (PYTHON: a venv with the package's test extras)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-docs/phoenix-trace.png}"
command -v chromium >/dev/null || { echo "phoenix_screenshot.sh: no chromium (apt-get install -y chromium)" >&2; exit 1; }
bin="$(tests/support_phoenix.sh | tail -n 1)"
PHOENIX_BIN="$bin" PHOENIX_SCREENSHOT="$out" "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider \
  "tests/integration/test_proxy_phoenix.py::test_span_in_phoenix_under_the_callers_span_with_its_gpu_cost[grpc]"
echo "$out: $(stat -c %s "$out") bytes"
