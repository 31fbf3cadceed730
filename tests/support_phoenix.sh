#!/usr/bin/env bash
# Arize Phoenix (an OTLP trace store with a query API and a web UI) in a virtual environment of its
# own, for tests/integration/test_proxy_phoenix.py: it pulls ~200 packages (~850 MB), none of which may land in
# the project's venv.
#
#   tests/support_phoenix.sh [VENV]        VENV defaults to .venv-phoenix at the repository root
#
# Prints the `phoenix` command's path on its last line of stdout (the tests take it from
# PHOENIX_BIN, or find VENV's default place themselves). Idempotent: a VENV that already holds this
# version is reused as it is. PHOENIX_SPEC overrides the pinned version (the tests read its REST API).
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$root/.venv-phoenix}"
spec="${PHOENIX_SPEC:-arize-phoenix==20.26.1}"
python="${PYTHON:-python3}"

if [ -x "$venv/bin/phoenix" ] && [ "$(cat "$venv/.installed" 2>/dev/null)" = "$spec" ]; then
  echo "$venv/bin/phoenix"
  exit 0
fi
"$python" -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip >&2
"$venv/bin/pip" install -q "$spec" >&2
"$venv/bin/python" -c 'import phoenix.server.main' >&2
printf '%s\n' "$spec" > "$venv/.installed"
echo "$venv/bin/phoenix"
