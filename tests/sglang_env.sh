#!/usr/bin/env bash
# tests/sglang_env.sh VENV: the environment in which the real SGLang 0.5.23 classes import on a CPU-only machine,
# for tests/integration/test_sglang_*.py (make test-sglang); tests/engine_env.sh says how it is built.
exec "$(dirname "$0")/engine_env.sh" sglang "$@"
