"""The fail-soft state of one engine integration in one process, shared by the vLLM and SGLang hooks.

Engine hooks never raise into the engine: every piece of our work inside a hook goes through the
guard, and the first exception turns the integration off for the process with one log line, after
which hooks pass straight through. `closing` calls (ending a step pushed on this thread before) run
even then, so no step stays open on a thread whose later launches it would claim.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional, Tuple


class HookGuard:
    def __init__(self, engine_name: str, make_engine: Callable[[], Any], log: logging.Logger):
        self.name = engine_name
        self._make = make_engine
        self._log = log
        self._lock = threading.Lock()
        self.off = False                   # a guard tripped (or uninstrumented): hooks pass straight through
        self.current: Optional[Any] = None  # the process's telemetry engine, once made

    def engine(self) -> Any:
        """The process's telemetry engine (made on first use)."""
        if self.current is None:
            with self._lock:
                if self.current is None:
                    self.current = self._make()
        return self.current

    def __call__(self, what: str, fn: Callable, *args, default=None, closing: bool = False):
        """fn(*args), or `default` once the integration is off; an exception turns it off (one line)."""
        if self.off and not closing:
            return default
        try:
            return fn(*args)
        except Exception:
            if self.off:                   # already off and said so: a closing call failing too
                self._log.debug("otel-gpu-census: %s failed after the integration went off", what, exc_info=True)
                return default
            self.off = True
            self._log.exception("otel-gpu-census: the %s integration is off for this process (%s failed); "
                                "%s is unaffected", self.name, what, self.name)
            return default


def disabled_by_env(name: str, env=None) -> bool:
    """Whether OTEL_PYTHON_DISABLED_INSTRUMENTATIONS switches instrumentation `name` off, read as
    opentelemetry-instrument reads it: comma-separated entry point names, ``*`` for every one."""
    import os
    raw = (os.environ if env is None else env).get("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "")
    names = {n.strip() for n in raw.split(",")}
    return "*" in names or name in names


def make_engine(cls, providers: Tuple[Any, Any]) -> Any:
    """The process's telemetry engine of class `cls` (a StepEngine), on the (tracer, meter) providers an
    instrumentor was given. Providers that are objects of this process (given, or the application's own:
    telemetry.setup.providers_in_process) keep settling in a thread here: a settling child could not reach
    them."""
    from otel_gpu_census.telemetry.setup import providers_in_process
    eng = cls(settle_in="thread" if providers_in_process(*providers) else None)
    eng.providers = providers
    return eng


def start_integration(name: str, label: str, how: str, instrument: Callable[[], Any], log: logging.Logger) -> None:
    """An engine plugin entry point's whole work: `instrument()` unless OTEL_PYTHON_DISABLED_INSTRUMENTATIONS
    names `name` or the process is not under the census. Never raises (the engine would not start): at
    worst one log line and the engine runs uninstrumented. `how`: the command that starts it under the census."""
    from otel_gpu_census import injector
    try:
        if disabled_by_env(name):
            log.info("otel-gpu-census: %s integration disabled by OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", label)
            return
        if not injector.under_census():
            log.info("otel-gpu-census: %s integration idle: this process is not under the census (start %s with "
                     "`%s`)", label, label, how)
            return
        instrument()
    except Exception:
        log.exception("otel-gpu-census: the %s integration could not start; %s runs without it", label, label)
