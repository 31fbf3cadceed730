"""What an engine's settler reads, for real: a census segment written by the native tally with one kernel
per step, live and complete up to an hour from now, the injector pointed at it (its step tagging a no-op);
and a request as vLLM's hooks see it once it stopped."""
from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

from otel_gpu_census import injector

T = 1_700_000_000_000_000_000                # the first kernel's start (ns)


def one_kernel_per_step(segments, records, tmp_path, monkeypatch, n_steps: int) -> Path:
    """The segment (in tmp_path) of an engine that ran steps 1..n_steps, one kernel each; the injector
    (monkeypatched) reports it as the engine's own."""
    recs = []
    for sid in range(1, n_steps + 1):
        recs.append(records.external(sid, sid))
        recs.append(records.kernel(T + sid * 1000, T + sid * 1000 + 100, corr=sid))

    def complete(seg):
        seg.complete_wall_ns = time.time_ns() + 3600 * 10**9
    path = segments.segment(tmp_path, recs, final=False, edit=complete)
    monkeypatch.setattr(injector, "segment_path", lambda: str(path))
    monkeypatch.setattr(injector, "step_begin", lambda sid: True)
    monkeypatch.setattr(injector, "step_end", lambda: None)
    return path


def stopped_request(rid: str, trace_headers=None):
    """vLLM's Request for `rid`: 4 prompt tokens, 3 out, finished by a stop."""
    return SimpleNamespace(request_id=rid, arrival_time=time.time(), num_prompt_tokens=4, num_output_tokens=3,
                           status=SimpleNamespace(name="FINISHED_STOPPED"), get_finished_reason=lambda: "stop",
                           trace_headers=trace_headers)
