"""The vLLM classes the hooks wrap import in this environment, at the version the tests pin (run by
tests/engine_env.sh)."""
import os
from pathlib import Path

import vllm
import vllm.plugins  # noqa: F401
from vllm.entrypoints.generate.base.serving import GenerateBaseServing  # noqa: F401
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: F401
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
from vllm.v1.engine.core import EngineCore, EngineCoreProc  # noqa: F401
from vllm.v1.request import Request  # noqa: F401
from vllm.v1.worker.gpu_worker import Worker  # noqa: F401
from vllm.v1.worker.worker_base import WorkerWrapperBase  # noqa: F401

# the version the requirements file pins (tests/engine_env.sh names it: 0.25.1's by default)
reqs = os.environ.get("ENGINE_REQS") or str(Path(__file__).resolve().parents[1] / "vllm_cpu_requirements.txt")
(want,) = [line.split("==", 1)[1].strip() for line in Path(reqs).read_text().splitlines() if line.startswith("vllm==")]
assert vllm.__version__ == want, (vllm.__version__, want)
