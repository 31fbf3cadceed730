"""The vLLM versions this integration is written and tested for (OTel contrib's package.py)."""
# 0.25.x: Scheduler.update_from_output/_free_request, WorkerWrapperBase.execute_model/sample_tokens,
# GenerateBaseServing._get_trace_headers, as tests/test_vllm_hooks.py checks against the real classes.
_instruments = ("vllm >= 0.25.0, < 0.26",)
