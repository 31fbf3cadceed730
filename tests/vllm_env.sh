#!/usr/bin/env bash
# tests/vllm_env.sh VENV: the environment in which the real vLLM 0.25.1 classes import on a CPU-only machine,
# for tests/integration/test_vllm_*.py (make test-vllm); tests/engine_env.sh says how it is built.
exec "$(dirname "$0")/engine_env.sh" vllm "$@"
