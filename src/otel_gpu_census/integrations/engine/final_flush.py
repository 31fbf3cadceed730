"""The final census flush of an engine's processes, asked by the process that is about to stop them.

vLLM's API server SIGKILLs its engine a few seconds after asking it to stop, and SGLang's launcher
SIGKILLs every process of its tree at once (``kill_process_tree``): the workers' own shutdown code
never runs, and without this their censuses would lose their last flush period. Before the stop, the
manager writes ``census=finish`` beside the workers' segments (``census/control.py``); each worker's
flusher thread runs the final flush within one flush period. Only under the census; never raises."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Iterable

from otel_gpu_census import injector

FINISH_WAIT_S = 2.5     # the flusher answers within one flush period (1 s), the engine's settler
                        # writes its summary within its period (0.25 s) after that; never more at a stop


def finish_censuses(pids: Iterable[int], label: str, log: logging.Logger, exclude: Iterable[int] = ()) -> None:
    """census=finish for the censuses of `pids` and their descendants (not those of `exclude`); wait
    for them at most FINISH_WAIT_S. One log line for those that did not finish in time."""
    directory = os.environ.get("OTEL_GPU_CENSUS_DIR")
    pids = [p for p in pids if p]
    if not directory or not pids or not injector.under_census():
        return
    from otel_gpu_census.census import control
    asked, done = control.finish(directory, pids, FINISH_WAIT_S, exclude=exclude)
    if asked > done:
        log.info("otel-gpu-census: %d of %d %s censuses did not finish within %.1f s of the stop",
                 asked - done, asked, label, FINISH_WAIT_S)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stop_signals_deferred():
    """SIGTERM and SIGINT held back while the engine's own shutdown work (final flush, last requests
    settled and logged, spans exported) runs, then delivered: the process dies of them as it would
    have, only after that work. vLLM resets both to their default action just before it calls
    EngineCore.shutdown, and its API server SIGTERMs the engine as soon as the census says it has
    flushed: an engine could die inside that window and lose its request log. The work is bounded (the engine integrations give it ~3 s), and the manager's
    SIGKILL still ends a process that does not finish. Main thread only (elsewhere: no change)."""
    held, previous = [], {}
    try:
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                previous[s] = signal.signal(s, lambda signum, frame: held.append(signum))
    except (ValueError, OSError, TypeError):        # not settable here: leave them as they were
        _restore(previous)
        previous = {}
    try:
        yield
    finally:
        _restore(previous)
        for s in dict.fromkeys(held):               # once each, in the order they came
            try:
                os.kill(os.getpid(), s)
            except OSError:
                pass


def _restore(previous) -> None:
    for s, h in previous.items():
        try:
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        except (ValueError, OSError, TypeError):
            pass
