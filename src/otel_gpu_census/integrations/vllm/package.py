"""The vLLM versions this integration is written and tested for (OTel contrib's package.py)."""
# Scheduler.add_request/update_from_output/_free_request, WorkerWrapperBase.execute_model, Worker.sample_tokens,
# GenerateBaseServing._get_trace_headers, the KV-offload connector's methods, as tests/integration/test_vllm_*.py
# check against the real classes: passing with 0.25.1 and 0.25.0 (installed --no-deps into the 0.25.1
# environment). 0.24.0 has no vllm.entrypoints.generate.base.serving (GenerateBaseServing). 0.27.1, 0.30.0
# and 0.34.0 pass them too (each in a CPU environment of its own, torch 2.13.0 CPU; 0.34.0 pins torch 2.14.0):
# 0.34.0 moved _get_trace_headers to BaseServing and hands OffloadingWorker.submit_* DevicePointers, 0.27 on
# submit handle_preemptions' jobs_to_flush; the hooks handle both. 0.26.x, 0.28.x, 0.29.x and 0.31-0.33
# were not run.
_instruments = ("vllm >= 0.25.0, < 0.35",)
