"""Request records: when each request was in flight, in wall-clock time, for `report --request-log`.

The census knows what the GPU did and when; only the caller knows when requests came and went. A
request log gives that, so the report can put requests in flight next to GPU time and check whether
copies follow request boundaries. Two forms are read:

* JSON Lines, one request per line, times in Unix nanoseconds (the OTLP field names), as
  ``bench/server/load.py --request-log`` and the vLLM integration (``*.requests.jsonl`` beside the
  engine's segment, its last line the ledger's summary) write them:
  ``{"start_time_unix_nano": 1764400000123456789, "end_time_unix_nano": 1764400004123456789,
  "first_token_time_unix_nano": 1764400000623456789}`` (the first token is optional);
* OTLP JSON traces (what the Collector's file exporter writes, one export a line, or one object):
  every SERVER span is a request; its first token is ``gen_ai.response.time_to_first_chunk`` (s) when
  the span carries it, as the census's spans do (or ``gen_ai.latency.time_to_first_token``, vLLM's own).

Numbers may be JSON integers or strings of digits (OTLP JSON writes 64-bit integers as strings).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable, List, Optional

SPAN_KIND_SERVER = (2, "SPAN_KIND_SERVER")
# the GenAI conventions' name (the census's spans), then vLLM's own span's
TTFT_ATTRIBUTES = ("gen_ai.response.time_to_first_chunk", "gen_ai.latency.time_to_first_token")


class RequestLogError(Exception):
    """A request log that cannot be used; the message is one line naming the file and the place."""


@dataclass(frozen=True)
class RequestRecord:
    start_ns: int                         # wall clock (CLOCK_REALTIME), Unix ns
    end_ns: int
    first_token_ns: Optional[int] = None


def _int(v: Any, what: str) -> int:
    if isinstance(v, bool):
        raise ValueError(f"{what} is not a whole number: {v!r}")
    if isinstance(v, int):
        return v
    if isinstance(v, str) and v.strip().isdigit():
        return int(v)
    raise ValueError(f"{what} is not a whole number of nanoseconds: {v!r}")


def _record(start: int, end: int, first: Optional[int]) -> RequestRecord:
    if start <= 0 or end < start:
        raise ValueError(f"end ({end}) before start ({start}), or no start")
    if first is not None and not start <= first <= end:
        first = None          # a first token outside the request is not one we can place
    return RequestRecord(start, end, first)


def _plain(obj: dict) -> RequestRecord:
    start = _int(obj.get("start_time_unix_nano"), "start_time_unix_nano")
    end = _int(obj.get("end_time_unix_nano"), "end_time_unix_nano")
    first = obj.get("first_token_time_unix_nano")
    return _record(start, end, None if first is None else _int(first, "first_token_time_unix_nano"))


def _attr_value(v: dict) -> Any:
    for k in ("doubleValue", "intValue", "stringValue"):
        if k in v:
            return v[k]
    return None


def _spans(obj: dict) -> List[RequestRecord]:
    out = []
    for rs in obj.get("resourceSpans") or ():
        for ss in rs.get("scopeSpans") or ():
            for sp in ss.get("spans") or ():
                if sp.get("kind") not in SPAN_KIND_SERVER:
                    continue
                start = _int(sp.get("startTimeUnixNano"), "startTimeUnixNano")
                end = _int(sp.get("endTimeUnixNano"), "endTimeUnixNano")
                first = None
                for a in sp.get("attributes") or ():
                    if a.get("key") in TTFT_ATTRIBUTES and first is None:
                        try:
                            first = start + round(float(_attr_value(a.get("value") or {})) * 1e9)
                        except (TypeError, ValueError):
                            first = None
                out.append(_record(start, end, first))
    return out


def parse(lines: Iterable[str], name: str = "request log") -> List[RequestRecord]:
    """Records from the lines of a log (either form above), sorted by start."""
    text = list(lines)
    out: List[RequestRecord] = []
    docs = []
    for i, line in enumerate(text, 1):
        if not line.strip():
            continue
        try:
            docs.append((i, json.loads(line)))
        except ValueError as e:
            try:     # one JSON document over several lines (an OTLP export, pretty-printed)
                whole = json.loads("".join(text))
            except ValueError:
                raise RequestLogError(f"{name}, line {i}: not JSON ({e.msg})") from None
            docs = [(0, whole)]
            break
    for i, doc in docs:
        where = f"{name}, line {i}" if i else name
        if not isinstance(doc, dict):
            raise RequestLogError(f"{where}: expected a JSON object per line")
        if "summary" in doc and "start_time_unix_nano" not in doc:
            continue        # an engine integration's closing line (its ledger's totals), not a request
        try:
            out.extend(_spans(doc) if "resourceSpans" in doc else [_plain(doc)])
        except ValueError as e:
            raise RequestLogError(f"{where}: {e}") from None
    if not out:
        raise RequestLogError(f"{name}: no requests in it")
    out.sort(key=lambda r: (r.start_ns, r.end_ns))
    return out


def load(path: str) -> List[RequestRecord]:
    try:
        with open(path, encoding="utf-8") as f:
            return parse(f, path)
    except OSError as e:
        raise RequestLogError(f"cannot read request log {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise RequestLogError(f"{path}: not a text file") from None


def peak_in_flight(records: Iterable[RequestRecord], lo_ns: int, hi_ns: int) -> int:
    """The most requests in flight at one moment inside [lo_ns, hi_ns)."""
    events = []
    for r in records:
        a, b = max(r.start_ns, lo_ns), min(r.end_ns, hi_ns)
        if a < b:
            events += [(a, 1), (b, -1)]
    events.sort(key=lambda e: (e[0], e[1]))      # an end before a start at the same instant
    most = k = 0
    for _, d in events:
        k += d
        most = max(most, k)
    return most
