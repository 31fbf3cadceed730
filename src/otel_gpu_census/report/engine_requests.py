"""The requests an engine integration saw, as it logged them beside its census segment
(``gpu-census-<pid>-<start>.requests.jsonl``, written by ``integrations/engine/steps.py`` for vLLM and SGLang): for ``report``, which
prints per-request figures from them, so ``--requests N`` is not needed for an engine it hooks. Under
sampled kernel tracing a line's kernel figures are a sample (its ``kernel_traced_ratio``): ``report``
says so and shows the scaled estimate beside them (:func:`kernel_sample`). Under counted kernel tracing
(``kernel_time_estimated``) its kernel count is exact and its kernel time an estimate already, never
scaled (:func:`kernel_estimated`).

The files sit in a folder others may write to: each is opened without following a link or blocking,
must be a regular file, and is read up to bounds in bytes (MAX_BYTES), in lines (MAX_REQUESTS requests,
as many as the integration writes) and per line (MAX_LINE_BYTES); what was not read is said
(``EngineRequests.unread``). A line that is not one of ours (not JSON, nested too deeply, a figure that is
not a whole number within int64, a time that is not one) is skipped and counted, never trusted. Each
request is kept as the few figures the report reads (``Request``), not as its parsed JSON.
"""
from __future__ import annotations

import io
import json
import math
import os
import stat
import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

MAX_BYTES = 64 << 20            # a request log larger than this is read up to here
MAX_REQUESTS = 200_000          # requests read from one log (integrations.engine.steps writes at most as many)
MAX_LINE_BYTES = 64 << 10       # a line longer than this is not one of ours (they are a few hundred bytes)
SUFFIX = ".requests.jsonl"
FIELDS = ("copy.dtoh.bytes", "copy.htod.bytes", "copy.dtod.bytes", "kernel.time_ns", "kernel.count")
INT64_MAX = (1 << 63) - 1
KERNEL_TIME = FIELDS.index("kernel.time_ns")
# the rest of a share's figures (its bytes in the other directions, memsets) and its KV-offload part, kept where
# non-zero: `report --by` adds every byte up to the census's
MORE = ("copy.ptop.bytes", "copy.htoh.bytes", "copy.other.bytes", "memset.bytes")
KV = ("kv.copy.htod.bytes", "kv.copy.dtoh.bytes")
WHO_CHARS = 256
MAX_STATES = 200_000            # engine_state lines kept (one a second of stepping)
STATE_FIELDS = ("t", "steps", "step_ns", "running_ns", "waiting_ns", "cap", "at_cap_ns", "at_cap_running_ns",
                "at_cap_waiting_ns", "at_cap_kv_used_ns", "kv_total", "kv_used_max", "preempted", "recomputed_tokens",
                "recompute_kernel_ns", "kernel_ns")


class Request:
    """One logged request: the figures the report reads."""

    __slots__ = ("gpu", "start_ns", "end_ns", "first_token_ns", "tracing", "ratio", "counted", "estimated", "unknown", "status",
                 "note", "tenant", "model", "more")

    def __init__(self, gpu: Tuple[int, ...], start_ns: int, first_token_ns: int, tracing: Optional[str],
                 ratio: Optional[float], counted: bool, estimated: bool, unknown: bool, status: Optional[str] = None,
                 note: Optional[str] = None, end_ns: int = 0):
        self.gpu = gpu                             # one int per FIELDS (0 where the line had none)
        self.start_ns, self.end_ns, self.first_token_ns = start_ns, end_ns, first_token_ns   # 0: not logged
        self.tracing, self.ratio = tracing, ratio  # kernel_tracing (cut to 40 characters), kernel_traced_ratio
        self.counted, self.estimated, self.unknown = counted, estimated, unknown
        self.status, self.note = status, note      # the share's status, and the first of its notes (300 characters)
        self.tenant: Optional[str] = None          # who it is charged to, the model (or LoRA adapter) that served it
        self.model: Optional[str] = None           # (each cut to WHO_CHARS; None where the line has none)
        self.more: Optional[Dict[str, int]] = None  # MORE figures the line has beyond FIELDS (non-zero only)


@dataclass
class EngineRequests:
    path: str
    requests: List[Request] = field(default_factory=list)
    summary: Optional[dict] = None
    skipped: int = 0
    states: List[Dict[str, int]] = field(default_factory=list)   # the engine's state per second (engine_state lines)
    engine: Optional[str] = None     # the engine that wrote the state lines (vllm, sglang)
    unread: str = ""             # what of the log was not read (past a bound), for the report to say


def log_path(segment_path: str) -> str:
    return segment_path[:-len(".seg")] + SUFFIX if segment_path.endswith(".seg") else segment_path + SUFFIX


def read(path: str) -> Optional[EngineRequests]:
    """The log at `path`, or None when there is none (or it is not a regular file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(MAX_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    out = EngineRequests(path)
    lines = io.BytesIO(data)
    for raw in lines:                     # one line at a time: never a list of every line
        obj = _json(raw)
        if obj is None:
            out.skipped += bool(raw.strip())
        elif isinstance(obj, dict) and isinstance(obj.get("summary"), dict):
            out.summary = obj["summary"]
        elif isinstance(obj, dict) and "engine_state" in obj:
            b = _state(obj["engine_state"])
            if b is None or len(out.states) >= MAX_STATES:
                out.skipped += b is None
            else:
                out.states.append(b)
                eng = obj.get("engine")
                out.engine = eng[:20] if isinstance(eng, str) else out.engine
        elif len(out.requests) >= MAX_REQUESTS:
            rest = 1 + data.count(b"\n", lines.tell())
            out.unread = f"{rest:,} lines past the first {MAX_REQUESTS:,} requests were not read"
            out.summary = _summary(data) or out.summary
            break
        else:
            r = _request(obj)
            if r is None:
                out.skipped += 1
            else:
                out.requests.append(r)
    if st.st_size > len(data) and not out.unread:
        out.unread = f"the log is {st.st_size:,} bytes: only its first {MAX_BYTES:,} were read"
    return out


def _json(raw: bytes):
    """A line's JSON, or None for a line that is not one of ours."""
    if len(raw) > MAX_LINE_BYTES or not raw.strip():
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def _summary(data: bytes) -> Optional[dict]:
    """The summary from the log's last line (the integration writes it last)."""
    obj = _json(data.rstrip().rsplit(b"\n", 1)[-1])
    return obj["summary"] if isinstance(obj, dict) and isinstance(obj.get("summary"), dict) else None


def _whole(v, absent: int = 0) -> int:
    """A figure: a whole number in 0..int64, or `absent` where the line has none; ValueError otherwise."""
    if v is None:
        return absent
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= INT64_MAX:
        return v
    raise ValueError(v)


def _state(obj) -> Optional[Dict[str, int]]:
    """An engine_state line's bucket (attribution/engine_state.py): every field a whole number, or None."""
    if not isinstance(obj, dict) or set(obj) != set(STATE_FIELDS):
        return None
    try:
        return {k: _whole(obj[k], -1) for k in STATE_FIELDS}
    except ValueError:
        return None


def _request(obj) -> Optional[Request]:
    """A request line as the figures the report reads, or None when it is not one of ours."""
    if not isinstance(obj, dict) or not isinstance(obj.get("gpu"), dict):
        return None
    gpu = obj["gpu"]
    try:
        figures = tuple(_whole(gpu.get(f)) for f in FIELDS)
        start, first = _whole(obj.get("start_time_unix_nano")), _whole(obj.get("first_token_time_unix_nano"))
        end = _whole(obj.get("end_time_unix_nano"))
    except ValueError:
        return None
    tracing = obj.get("kernel_tracing")
    ratio = obj.get("kernel_traced_ratio")
    ratio = float(ratio) if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and \
        math.isfinite(ratio) and 0 <= ratio <= 1 else None
    counted = "kernel_time_estimated" in obj
    status, notes = obj.get("status"), obj.get("notes")
    note = notes[0][:300] if isinstance(notes, list) and notes and isinstance(notes[0], str) else None
    try:
        kv = obj.get("kv") if isinstance(obj.get("kv"), dict) else {}
        kv_gpu = kv.get("gpu") if isinstance(kv.get("gpu"), dict) else {}
        more = {f: _whole(gpu.get(f)) for f in MORE}
        more.update({f: _whole(kv_gpu.get(f[3:])) for f in KV})
    except ValueError:
        return None
    r = Request(figures, start, first, tracing[:40] if isinstance(tracing, str) else None, ratio, counted,
                obj.get("kernel_time_estimated") is True, obj.get("kernel_time_unknown") is True,
                status[:20] if isinstance(status, str) else None, note, end)
    r.more = {f: v for f, v in more.items() if v} or None
    tenant, model = obj.get("tenant"), obj.get("model")
    r.tenant = tenant[:WHO_CHARS] if isinstance(tenant, str) and tenant else None
    r.model = model[:WHO_CHARS] if isinstance(model, str) and model else None
    return r


def for_segments(segment_paths: Sequence[str]) -> List[EngineRequests]:
    logs = [read(log_path(p)) for p in segment_paths]
    return [x for x in logs if x is not None and x.requests]


def figures(log: EngineRequests) -> Dict[str, Dict[str, float]]:
    """Per field: median, mean and max over the log's requests."""
    out = {}
    for i, f in enumerate(FIELDS):
        vals = [r.gpu[i] for r in log.requests]
        out[f] = {"median": statistics.median(vals), "mean": sum(vals) / len(vals), "max": max(vals)}
    ttft = [(r.first_token_ns - r.start_ns) / 1e9 for r in log.requests if r.first_token_ns]
    if ttft:
        out["ttft_s"] = {"median": statistics.median(ttft), "mean": sum(ttft) / len(ttft), "max": max(ttft)}
    return out


def _sampled(r: Request) -> bool:
    return r.tracing is not None and not r.counted


def kernel_sample(log: EngineRequests) -> Optional[dict]:
    """None unless some requests' kernel figures are a sample (sampled kernel tracing: their line has
    ``kernel_tracing`` and ``kernel_traced_ratio``, and no ``kernel_time_estimated``). Then: the modes,
    how many requests, their median traced ratio, and the kernel time scaled to the whole
    (kernel.time_ns / ratio; a line without the keys was traced whole, a counted one is estimated
    whole) over the requests it can be estimated for (ratio > 0)."""
    sampled = [r for r in log.requests if _sampled(r)]
    if not sampled:
        return None
    ratios = [r.ratio for r in sampled if r.ratio is not None]
    est = []
    for r in log.requests:
        x = r.ratio if _sampled(r) else 1.0
        if x:
            est.append(r.gpu[KERNEL_TIME] / x)
    out = {"modes": sorted({r.tracing for r in sampled})[:4], "requests": len(sampled),
           "ratio_median": statistics.median(ratios) if ratios else None, "estimate": None}
    if est:
        out["estimate"] = {"median": statistics.median(est), "mean": sum(est) / len(est), "max": max(est),
                           "requests": len(est)}
    return out


def kernel_estimated(log: EngineRequests) -> Optional[dict]:
    """None unless some requests were counted (counted kernel tracing: exact kernel counts, eager kernels'
    time priced from a sample). Then: the modes, how many requests, how many of them have an estimated
    kernel time, and how many had eager launches no sample could price (their time left out)."""
    counted = [r for r in log.requests if r.counted]
    if not counted:
        return None
    return {"modes": sorted({r.tracing or "" for r in counted})[:4],
            "requests": len(counted), "estimated": sum(1 for r in counted if r.estimated),
            "unknown": sum(1 for r in counted if r.unknown)}


def recomputed(log: EngineRequests) -> Optional[Tuple[int, int]]:
    """(tokens, kernel ns) the summary says preempted requests computed again, or None (none, or not ours)."""
    rec = (log.summary or {}).get("recomputed")
    try:
        return (_whole(rec["tokens"]), _whole(rec["kernel_time_ns"])) if isinstance(rec, dict) else None
    except (KeyError, ValueError):
        return None


def incomplete(log: EngineRequests) -> Optional[dict]:
    """None when every request's share is complete and none was dropped. Else how many are partial (their
    shares know they miss work: the line's ``notes`` say what) or stale, the first partial's first note,
    and the requests the summary counts as dropped (no span or line: their settling process died)."""
    partial = [r for r in log.requests if r.status == "partial"]
    stale = sum(1 for r in log.requests if r.status == "stale")
    try:
        dropped = _whole((log.summary or {}).get("requests_dropped"))
    except ValueError:
        dropped = 0
    if not (partial or stale or dropped):
        return None
    note = next((r.note for r in partial if r.note), None)
    return {"partial": len(partial), "stale": stale, "dropped": dropped, "note": note}
