"""The SGLang versions this integration is written and tested for (OTel contrib's package.py)."""
# 0.5.23: sglang.srt.plugins (HookRegistry), Scheduler.run_batch / launch_batch_sample_if_needed /
# _add_request_to_queue / run_event_loop, SchedulerOutputStreamer.stream_output,
# TokenizerManager._init_req_state, ReqTimeStatsBase.__getstate__ / new_from_obj, and the ScheduleBatch /
# Req fields the hooks read, as tests/integration/test_sglang_classes.py checks against the real classes.
_instruments = ("sglang >= 0.5.23, < 0.5.24",)
