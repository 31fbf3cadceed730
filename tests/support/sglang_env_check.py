"""The SGLang classes the hooks wrap import in this environment (on a CPU, through sglang_cpu), at the
version the tests pin (run by tests/engine_env.sh)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sglang_cpu  # noqa: E402

sglang_cpu.prepare()
import sglang  # noqa: E402
import sglang.srt.plugins  # noqa: E402,F401
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch  # noqa: E402,F401
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402,F401
from sglang.srt.managers.scheduler_components.output_streamer import SchedulerOutputStreamer  # noqa: E402,F401
from sglang.srt.managers.tokenizer_manager import TokenizerManager  # noqa: E402,F401
from sglang.srt.observability.req_time_stats import APIServerReqTimeStats, ReqTimeStatsBase  # noqa: E402,F401
from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: E402,F401

assert sglang.__version__ == "0.5.23", sglang.__version__
