"""The vLLM classes the hooks wrap import in this environment, at the version the tests pin (run by
tests/engine_env.sh)."""
import vllm
import vllm.plugins  # noqa: F401
from vllm.entrypoints.generate.base.serving import GenerateBaseServing  # noqa: F401
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: F401
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
from vllm.v1.engine.core import EngineCore, EngineCoreProc  # noqa: F401
from vllm.v1.request import Request  # noqa: F401
from vllm.v1.worker.gpu_worker import Worker  # noqa: F401
from vllm.v1.worker.worker_base import WorkerWrapperBase  # noqa: F401

assert vllm.__version__ == "0.25.1", vllm.__version__
