#!/usr/bin/env bash
# rotel (a Rust OpenTelemetry collector shipped in a PyPI wheel) in a virtual environment of its own, for
# tests/integration/test_metrics_rotel.py. PyPI has only alpha releases of it, so it is pinned here, for CI,
# rather than in the project's [test] extra.
#
#   tests/support_rotel.sh [VENV]          VENV defaults to .venv-rotel at the repository root
#
# Prints the rotel-agent binary's path on its last line of stdout (the test takes it from ROTEL_AGENT).
# Idempotent: a VENV that already holds this version is reused as it is. ROTEL_SPEC overrides the pin.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$root/.venv-rotel}"
spec="${ROTEL_SPEC:-rotel==0.0.1a15}"
python="${PYTHON:-python3}"

agent() { "$venv/bin/python" -c 'import pathlib, rotel; print(pathlib.Path(rotel.__file__).parent / "rotel-agent")'; }
if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.installed" 2>/dev/null)" = "$spec" ]; then
  agent
  exit 0
fi
"$python" -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip >&2
"$venv/bin/pip" install -q "$spec" >&2
[ -x "$(agent)" ] || { echo "rotel installed without its agent binary" >&2; exit 1; }
printf '%s\n' "$spec" > "$venv/.installed"
agent
