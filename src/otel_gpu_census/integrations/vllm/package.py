"""The vLLM versions this integration is written and tested for (OTel contrib's package.py)."""
# The hooked methods (instrumentor.HOOKS) and what the hooks read, as tests/integration/test_vllm_*.py check
# against the real classes on CPU: 0.25.1 (make test-vllm; the release run on a GPU) and 0.34.0 (make
# test-vllm-latest) in CI; 0.25.0, 0.27.1 and 0.30.0 passed once each. 0.24.0 has no GenerateBaseServing.
# 0.34 moved _get_trace_headers to BaseServing and hands OffloadingWorker.submit_* DevicePointers; from 0.27 on
# handle_preemptions submits the jobs_to_flush itself: the hooks handle each. 0.26, 0.28, 0.29 and 0.31-0.33
# were not run; a method a hook does not find leaves that hook off, with one log line.
_instruments = ("vllm >= 0.25.0, < 0.35",)
