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
  the span carries it, as the census's spans do (or ``gen_ai.latency.time_to_first_token``, vLLM's own);
  where it has a GPU share (``gpu_census.kernel.count`` and the rest: the proxy's spans), that share, its
  ``gpu_census.tenant`` and ``gen_ai.request.model`` (:class:`Charge`, for ``report --by``).

Numbers may be JSON integers or strings of digits (OTLP JSON writes 64-bit integers as strings). A
time must fall between EARLIEST_NS and LATEST_NS (years 2000 to 2100), a time to first token must be a
finite number of seconds. Anything else (a wrong JSON type at any level, a value out of range, JSON
nested too deeply) is refused with one line that says where.

The log is a file the user names, of any size: it must be a regular file (a FIFO or a device is refused,
never waited on), is read a line at a time, each line up to MAX_LINE_CHARS (a pretty-printed document
up to MAX_DOCUMENT_CHARS in all), and up to MAX_REQUESTS requests are kept: what was left is said
(``RequestLog.unread``).
"""
from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

from otel_gpu_census.census import DIRECTIONS

SPAN_KIND_SERVER = (2, "SPAN_KIND_SERVER")
# the GenAI conventions' name (the census's spans), then vLLM's own span's
TTFT_ATTRIBUTES = ("gen_ai.response.time_to_first_chunk", "gen_ai.latency.time_to_first_token")
EARLIEST_NS = 946_684_800 * 10**9          # 2000-01-01T00:00:00Z
LATEST_NS = 4_102_444_800 * 10**9          # 2100-01-01T00:00:00Z
MAX_REQUESTS = 500_000                     # requests kept from one log (a few dozen MB)
MAX_LINE_CHARS = 16 << 20                  # one line (an OTLP export of many spans is a few MB)
MAX_DOCUMENT_CHARS = 16 << 20              # one JSON document over several lines, read whole
CHARGE_FIGURES = ("kernel.count", "kernel.time_ns") + tuple(f"copy.{d}.bytes" for d in DIRECTIONS) + ("memset.bytes",)
_CHARGE_KEYS = {"gpu_census.tenant", "gen_ai.request.model", "gpu_census.attribution.status",
                "gpu_census.kernel.time_estimated", "gpu_census.kernel.time"} | {
               "gpu_census." + f for f in CHARGE_FIGURES if f != "kernel.time_ns"}
WHO_CHARS = 256


class RequestLogError(Exception):
    """A request log that cannot be used; the message is one line naming the file and the place."""


@dataclass(frozen=True)
class Charge:
    """A span's GPU share and who it is charged to, for `report --by` (its ``gpu_census.*`` attributes)."""
    tenant: Optional[str]
    model: Optional[str]
    figures: Tuple[Tuple[str, int], ...]  # (CHARGE_FIGURES name, value): integers; kernel.time_ns from seconds
    status: Optional[str] = None
    estimated: bool = False


@dataclass(frozen=True)
class RequestRecord:
    start_ns: int                         # wall clock (CLOCK_REALTIME), Unix ns
    end_ns: int
    first_token_ns: Optional[int] = None
    charge: Optional[Charge] = None       # an OTLP span's GPU share (where it has one)


class RequestLog(list):
    """The records, sorted by start; `unread` says what of the log was left past MAX_REQUESTS ('' if nothing)."""

    unread: str = ""


def _shown(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else f"{text[:40]}… ({len(text)} characters)"


def _time(v: Any, what: str) -> int:
    """A time in Unix ns: a JSON integer or a string of digits, between EARLIEST_NS and LATEST_NS."""
    if isinstance(v, int) and not isinstance(v, bool):
        t = v
    elif isinstance(v, str) and v.strip().isascii() and v.strip().isdigit() and len(v.strip()) <= 40:
        t = int(v)
    else:
        raise ValueError(f"{what} is not a whole number of nanoseconds: {_shown(v)}")
    if not EARLIEST_NS <= t < LATEST_NS:
        raise ValueError(f"{what} {_shown(t)} is not a time between the years 2000 and 2100 (Unix ns)")
    return t


def _seconds(v: Any, what: str) -> float:
    """A duration in seconds: a finite JSON number or a string of one."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        x = float(v) if not isinstance(v, int) or abs(v) < 1 << 63 else math.inf
    elif isinstance(v, str) and len(v) <= 40:
        try:
            x = float(v)
        except ValueError:
            x = math.nan
    else:
        x = math.nan
    if not math.isfinite(x):
        raise ValueError(f"{what} is not a finite number of seconds: {_shown(v)}")
    return x


def _record(start: int, end: int, first: Optional[int], charge: Optional[Charge] = None) -> RequestRecord:
    if end < start:
        raise ValueError(f"end ({end}) before start ({start})")
    if first is not None and not start <= first <= end:
        first = None          # a first token outside the request is not one we can place
    return RequestRecord(start, end, first, charge)


def _count(v: Any, what: str) -> int:
    """A count or bytes: a whole number 0..int64, or a string of digits (OTLP JSON's intValue)."""
    if isinstance(v, str) and v.strip().isascii() and v.strip().isdigit() and len(v.strip()) <= 19:
        v = int(v)
    if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63:
        return v
    raise ValueError(f"{what} is not a whole number: {_shown(v)}")


def _charge(attrs: Dict[str, Any]) -> Optional[Charge]:
    """The GPU share a span's attributes give (None: it has none)."""
    if "gpu_census.kernel.count" not in attrs:
        return None
    figures = []
    for f in CHARGE_FIGURES:
        if f == "kernel.time_ns":
            t = attrs.get("gpu_census.kernel.time")
            secs = 0.0 if t is None else _seconds(t, "gpu_census.kernel.time")
            if secs < 0:
                raise ValueError(f"gpu_census.kernel.time is negative: {_shown(t)}")
            figures.append((f, round(secs * 1e9)))
        elif "gpu_census." + f in attrs:
            figures.append((f, _count(attrs["gpu_census." + f], "gpu_census." + f)))
    who = [attrs.get(k) for k in ("gpu_census.tenant", "gen_ai.request.model", "gpu_census.attribution.status")]
    who = [x[:WHO_CHARS] if isinstance(x, str) and x else None for x in who]
    return Charge(who[0], who[1], tuple(figures), who[2], attrs.get("gpu_census.kernel.time_estimated") in (True,
                                                                                                        "true"))


def _plain(obj: dict) -> RequestRecord:
    start = _time(obj.get("start_time_unix_nano"), "start_time_unix_nano")
    end = _time(obj.get("end_time_unix_nano"), "end_time_unix_nano")
    first = obj.get("first_token_time_unix_nano")
    return _record(start, end, None if first is None else _time(first, "first_token_time_unix_nano"))


def _objects(v: Any, what: str) -> Iterator[dict]:
    """The JSON objects of the list `v` (absent: none); ValueError for any other type."""
    if v is None:
        return
    if not isinstance(v, list):
        raise ValueError(f"{what} is not a list: {_shown(v)}")
    for x in v:
        if not isinstance(x, dict):
            raise ValueError(f"an item of {what} is not an object: {_shown(x)}")
        yield x


def _attr_value(v: Any, key: str) -> Any:
    if not isinstance(v, dict):
        raise ValueError(f"the value of {key} is not an object: {_shown(v)}")
    for k in ("doubleValue", "intValue", "stringValue", "boolValue"):
        if k in v:
            return v[k]
    return None


def _spans(obj: dict) -> List[RequestRecord]:
    out = []
    for rs in _objects(obj.get("resourceSpans"), "resourceSpans"):
        for ss in _objects(rs.get("scopeSpans"), "scopeSpans"):
            for sp in _objects(ss.get("spans"), "spans"):
                if sp.get("kind") not in SPAN_KIND_SERVER:
                    continue
                start = _time(sp.get("startTimeUnixNano"), "startTimeUnixNano")
                end = _time(sp.get("endTimeUnixNano"), "endTimeUnixNano")
                first = None
                charge: Dict[str, Any] = {}
                for a in _objects(sp.get("attributes"), "attributes"):
                    if a.get("key") in TTFT_ATTRIBUTES and first is None:
                        ttft = _seconds(_attr_value(a.get("value"), a["key"]), a["key"])
                        # a first token outside the request is not one we can place
                        first = start + round(ttft * 1e9) if 0 <= ttft * 1e9 <= end - start else None
                    elif a.get("key") in _CHARGE_KEYS:
                        charge[a["key"]] = _attr_value(a.get("value"), a["key"])
                out.append(_record(start, end, first, _charge(charge)))
    return out


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply to read") from None


def _records(doc: Any, where: str) -> List[RequestRecord]:
    if not isinstance(doc, dict):
        raise RequestLogError(f"{where}: expected a JSON object per line")
    if "summary" in doc and "start_time_unix_nano" not in doc:
        return []           # an engine integration's closing line (its ledger's totals), not a request
    try:
        return _spans(doc) if "resourceSpans" in doc else [_plain(doc)]
    except ValueError as e:
        raise RequestLogError(f"{where}: {e}") from None


def _too_long(where: str, limit: int) -> RequestLogError:
    return RequestLogError(f"{where}: over {limit:,} characters, not a request log line (not read)")


def parse(lines: Iterable[str], name: str = "request log") -> RequestLog:
    """Records from the lines of a log (either form above), sorted by start; one line at a time."""
    it = iter(lines)
    out = RequestLog()
    seen = False                 # a line was read as JSON
    for i, line in enumerate(it, 1):
        if len(line) > MAX_LINE_CHARS:
            raise _too_long(f"{name}, line {i}", MAX_LINE_CHARS)
        if not line.strip():
            continue
        if len(out) >= MAX_REQUESTS:
            rest = 1 + sum(1 for x in it if x.strip())
            out.unread = f"{rest:,} lines past the first {len(out):,} requests were not read"
            break
        try:
            doc, where = _json(line), f"{name}, line {i}"
        except ValueError as e:
            if seen:
                raise RequestLogError(f"{name}, line {i}: not JSON ({getattr(e, 'msg', e)})") from None
            doc, where = _document(line, it, name, i, e), name    # one document over several lines
        seen = True
        out.extend(_records(doc, where))
    if not out:
        raise RequestLogError(f"{name}: no requests in it")
    out.sort(key=lambda r: (r.start_ns, r.end_ns))
    return out


def _document(first: str, rest: Iterator[str], name: str, i: int, error: ValueError) -> Any:
    """One JSON document from `first` and every line after it, up to MAX_DOCUMENT_CHARS."""
    parts, size = [first], len(first)
    for line in rest:
        size += len(line)
        if size > MAX_DOCUMENT_CHARS:
            raise RequestLogError(f"{name}, line {i}: not JSON ({getattr(error, 'msg', error)}), and not one "
                                  f"JSON document of up to {MAX_DOCUMENT_CHARS:,} characters either")
        parts.append(line)
    try:
        return _json("".join(parts))
    except ValueError:
        raise RequestLogError(f"{name}, line {i}: not JSON ({getattr(error, 'msg', error)})") from None


def _lines(f) -> Iterator[str]:
    """The lines of a text file, none longer than MAX_LINE_CHARS + 1 (parse refuses it)."""
    while True:
        line = f.readline(MAX_LINE_CHARS + 1)
        if not line:
            return
        yield line


def _file_kind(mode: int) -> str:
    for test, what in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return what
    return "not a regular file"


def load(path: str) -> RequestLog:
    from otel_gpu_census.census.folder import show_path          # a file name as a message shows it (escaped)
    name = show_path(path)
    try:
        # never blocks: a FIFO nobody writes is refused, not waited on
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise RequestLogError(f"cannot read request log {name}: {e.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise RequestLogError(f"request log {name} is {_file_kind(mode)}: a request log must be a regular file")
        with os.fdopen(fd, encoding="utf-8", closefd=False) as f:
            return parse(_lines(f), name)
    except OSError as e:
        raise RequestLogError(f"cannot read request log {name}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise RequestLogError(f"{name}: not a text file") from None
    finally:
        os.close(fd)


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
