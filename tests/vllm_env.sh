#!/usr/bin/env bash
# tests/vllm_env.sh VENV [REQS]: the environment in which the real vLLM classes import on a CPU-only machine, for
# tests/integration/test_vllm_*.py: 0.25.1 (make test-vllm), or the release REQS pins (make test-vllm-latest:
# tests/vllm_latest_cpu_requirements.txt, a path in the repository); tests/engine_env.sh says how it is built.
exec "$(dirname "$0")/engine_env.sh" vllm "$@"
