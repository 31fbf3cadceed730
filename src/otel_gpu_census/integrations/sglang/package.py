"""The SGLang versions this integration is written and tested for (OTel contrib's package.py)."""
# sglang.srt.plugins (HookRegistry), Scheduler.run_batch / launch_batch_sample_if_needed /
# _add_request_to_queue / run_event_loop, SchedulerOutputStreamer.stream_output,
# TokenizerManager._init_req_state, ReqTimeStatsBase.__getstate__ / new_from_obj, utils.common.kill_process_tree
# and the ScheduleBatch / Req fields the hooks read, as tests/integration/test_sglang_classes.py checks against
# the real classes: run there against 0.5.20, 0.5.21, 0.5.22 and 0.5.23 (each installed --no-deps into the
# 0.5.23 environment; 0.5.20 with its xgrammar 0.2.1), all passing. 0.5.17-0.5.19 have every hooked name with
# the same parameters but import a transformers/huggingface-hub older than that environment's: not tested, so
# not listed. Releases after 0.5.23 did not exist to test.
_instruments = ("sglang >= 0.5.20, < 0.5.24",)
