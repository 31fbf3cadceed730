"""The vLLM versions this integration is written and tested for (OTel contrib's package.py)."""
# Scheduler.add_request/update_from_output/_free_request, WorkerWrapperBase.execute_model, Worker.sample_tokens,
# GenerateBaseServing._get_trace_headers, the KV-offload connector's methods, as tests/integration/test_vllm_*.py
# check against the real classes: passing with 0.25.1 and 0.25.0 (installed --no-deps into the 0.25.1
# environment). 0.24.0 has no vllm.entrypoints.generate.base.serving (GenerateBaseServing); 0.26.0 has every
# hooked name, but its OffloadingConnectorWorker takes a kv_cache_config and its Scheduler an ec_connector that
# the tests' real objects lack: not shown to work, so not listed.
_instruments = ("vllm >= 0.25.0, < 0.26",)
