"""The final census flush of an engine's processes, asked by the process that is about to stop them.

vLLM's API server SIGKILLs its engine a few seconds after asking it to stop, and SGLang's launcher
SIGKILLs every process of its tree at once (``kill_process_tree``): the workers' own shutdown code
never runs, and without this their censuses would lose their last flush period. Before the stop, the
manager writes ``census=finish`` beside the workers' segments (``census/control.py``); each worker's
flusher thread runs the final flush within one flush period. Only under the census; never raises."""
from __future__ import annotations

import logging
import os
from typing import Iterable

from .. import injector

FINISH_WAIT_S = 1.5     # the workers' flushers answer a control file within one flush period (1 s)


def finish_censuses(pids: Iterable[int], label: str, log: logging.Logger, exclude: Iterable[int] = ()) -> None:
    """census=finish for the censuses of `pids` and their descendants (not those of `exclude`); wait
    for them at most FINISH_WAIT_S. One log line for those that did not finish in time."""
    directory = os.environ.get("OTEL_GPU_CENSUS_DIR")
    pids = [p for p in pids if p]
    if not directory or not pids or not injector.under_census():
        return
    from ..census import control
    asked, done = control.finish(directory, pids, FINISH_WAIT_S, exclude=exclude)
    if asked > done:
        log.info("otel-gpu-census: %d of %d %s censuses did not finish within %.1f s of the stop",
                 asked - done, asked, label, FINISH_WAIT_S)
