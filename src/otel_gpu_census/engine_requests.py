"""The requests an engine integration saw, as it logged them beside its census segment
(``gpu-census-<pid>-<start>.requests.jsonl``, written by ``integrations/engine_steps.py`` for vLLM and SGLang): for ``report``, which
prints per-request figures from them, so ``--requests N`` is not needed for an engine it hooks. Under
sampled kernel tracing a line's kernel figures are a sample (its ``kernel_traced_ratio``): ``report``
says so and shows the scaled estimate beside them (:func:`kernel_sample`). Under counted kernel tracing
(``kernel_time_estimated``) its kernel count is exact and its kernel time an estimate already, never
scaled (:func:`kernel_estimated`).

The files sit in a folder others may write to: each is opened without following a link or blocking,
must be a regular file, and is read up to a bound; a line that is not one of ours is skipped and
counted, never trusted.
"""
from __future__ import annotations

import json
import os
import stat
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

MAX_BYTES = 64 << 20            # a request log larger than this is read up to here
SUFFIX = ".requests.jsonl"
FIELDS = ("copy.dtoh.bytes", "copy.htod.bytes", "copy.dtod.bytes", "kernel.time_ns", "kernel.count")


@dataclass
class EngineRequests:
    path: str
    requests: List[dict] = field(default_factory=list)     # {"gpu": {...}, "first_token_time_unix_nano", ...}
    summary: Optional[dict] = None
    skipped: int = 0


def log_path(segment_path: str) -> str:
    return segment_path[:-len(".seg")] + SUFFIX if segment_path.endswith(".seg") else segment_path + SUFFIX


def read(path: str) -> Optional[EngineRequests]:
    """The log at `path`, or None when there is none (or it is not a regular file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    out = EngineRequests(path)
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            out.skipped += bool(line.strip())
            continue
        if isinstance(obj, dict) and isinstance(obj.get("summary"), dict):
            out.summary = obj["summary"]
        elif isinstance(obj, dict) and isinstance(obj.get("gpu"), dict):
            out.requests.append(obj)
        else:
            out.skipped += 1
    return out


def for_segments(segment_paths: Sequence[str]) -> List[EngineRequests]:
    logs = [read(log_path(p)) for p in segment_paths]
    return [x for x in logs if x is not None and x.requests]


def _num(v) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def figures(log: EngineRequests) -> Dict[str, Dict[str, float]]:
    """Per field: median, mean and max over the log's requests."""
    out = {}
    for f in FIELDS:
        vals = [_num(r["gpu"].get(f)) for r in log.requests]
        out[f] = {"median": statistics.median(vals), "mean": sum(vals) / len(vals), "max": max(vals)}
    ttft = [(_num(r.get("first_token_time_unix_nano")) - _num(r.get("start_time_unix_nano"))) / 1e9
            for r in log.requests if _num(r.get("first_token_time_unix_nano"))]
    if ttft:
        out["ttft_s"] = {"median": statistics.median(ttft), "mean": sum(ttft) / len(ttft), "max": max(ttft)}
    return out


def _ratio(r: dict) -> Optional[float]:
    v = r.get("kernel_traced_ratio")
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1 else None


def _counted(r: dict) -> bool:
    return "kernel_time_estimated" in r


def _sampled(r: dict) -> bool:
    return isinstance(r.get("kernel_tracing"), str) and not _counted(r)


def kernel_sample(log: EngineRequests) -> Optional[dict]:
    """None unless some requests' kernel figures are a sample (sampled kernel tracing: their line has
    ``kernel_tracing`` and ``kernel_traced_ratio``, and no ``kernel_time_estimated``). Then: the modes,
    how many requests, their median traced ratio, and the kernel time scaled to the whole
    (kernel.time_ns / ratio; a line without the keys was traced whole, a counted one is estimated
    whole) over the requests it can be estimated for (ratio > 0)."""
    sampled = [r for r in log.requests if _sampled(r)]
    if not sampled:
        return None
    ratios = [x for x in map(_ratio, sampled) if x is not None]
    est = []
    for r in log.requests:
        x = _ratio(r) if _sampled(r) else 1.0
        if x:
            est.append(_num(r["gpu"].get("kernel.time_ns")) / x)
    out = {"modes": sorted({r["kernel_tracing"][:40] for r in sampled})[:4], "requests": len(sampled),
           "ratio_median": statistics.median(ratios) if ratios else None, "estimate": None}
    if est:
        out["estimate"] = {"median": statistics.median(est), "mean": sum(est) / len(est), "max": max(est),
                           "requests": len(est)}
    return out


def kernel_estimated(log: EngineRequests) -> Optional[dict]:
    """None unless some requests were counted (counted kernel tracing: exact kernel counts, eager kernels'
    time priced from a sample). Then: the modes, how many requests, how many of them have an estimated
    kernel time, and how many had eager launches no sample could price (their time left out)."""
    counted = [r for r in log.requests if _counted(r)]
    if not counted:
        return None
    return {"modes": sorted({str(r.get("kernel_tracing", ""))[:40] for r in counted})[:4],
            "requests": len(counted), "estimated": sum(1 for r in counted if r["kernel_time_estimated"] is True),
            "unknown": sum(1 for r in counted if r.get("kernel_time_unknown") is True)}


def incomplete(log: EngineRequests) -> Optional[dict]:
    """None when every request's share is complete and none was dropped. Else how many are partial (their
    shares know they miss work: the line's ``notes`` say what) or stale, the first partial's first note,
    and the requests the summary counts as dropped (no span or line: their settling process died)."""
    partial = [r for r in log.requests if r.get("status") == "partial"]
    stale = sum(1 for r in log.requests if r.get("status") == "stale")
    dropped = _num((log.summary or {}).get("requests_dropped"))
    if not (partial or stale or dropped):
        return None
    notes = next((r["notes"] for r in partial if isinstance(r.get("notes"), list) and r["notes"]), [])
    return {"partial": len(partial), "stale": stale, "dropped": dropped,
            "note": str(notes[0])[:300] if notes else None}
