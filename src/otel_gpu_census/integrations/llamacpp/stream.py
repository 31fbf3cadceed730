"""Read facts out of a copy of a response body as it streams past: tokens, ids, usage, timings.

Nothing here touches the bytes the client receives: the proxy writes each chunk to the client first
and then hands the same chunk to the reader, which keeps it (with its arrival time) and reads the
chunk before it: a chunk is read after the next one went out, and the last (llama-server's final
event, with timings and the echoed prompt: the largest) only after the answer's end went out. The
parser keeps at most one partial event in memory; the facts are those of reading every chunk on arrival.

Three body shapes:
- ``text/event-stream`` (llama-server, OpenAI style): ``data: {...}`` events separated by a blank
  line, comment lines (``:`` pings), ``data: [DONE]`` at the end of OpenAI-style streams.
- ``application/x-ndjson`` (Ollama): one JSON object per line.
- anything else is parsed as one JSON document at the end (non-streamed answers), if it is small
  enough to be worth it.

*First token*: the first streamed event that carries generation (not a ``prompt_progress`` update,
not an error, not the ``[DONE]`` marker). llama-server sends the chat role delta together with the
first token's delta, so the first chat chunk is the first token too.
"""
from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

MAX_EVENT_BYTES = 4 << 20        # one SSE event or NDJSON line larger than this is skipped
MAX_JSON_BODY_BYTES = 16 << 20   # a non-streamed body larger than this is not parsed
MAX_INFLATED_BYTES = 16 << 20    # a compressed answer's copy is inflated (and read) up to this many bytes
INFLATE_SLICE = 1 << 18          # inflated at a time
HEAVY_BYTES = 1 << 20            # a close with more than this left to parse is worth a thread
NUMBER_LIMIT = 1 << 63           # numbers read from a body are within int64's range

TIMING_KEYS = ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "cache_n")
OLLAMA_KEYS = ("prompt_eval_count", "eval_count", "total_duration", "load_duration",
               "prompt_eval_duration", "eval_duration")


@dataclass
class StreamFacts:
    """What the response told us. Times are wall-clock ns as observed at the proxy."""

    kind: str = "json"                     # "sse", "ndjson" or "json"
    response_id: Optional[str] = None
    model: Optional[str] = None
    first_token_ns: Optional[int] = None
    last_event_ns: Optional[int] = None
    events: int = 0                        # parsed events / lines / documents
    token_events: int = 0
    input_tokens: Optional[int] = None
    output_tokens: Optional[int] = None
    cached_tokens: Optional[int] = None
    timings: Dict[str, float] = field(default_factory=dict)
    id_slot: Optional[int] = None
    finish_reason: Optional[str] = None
    done: bool = False                     # a terminal event was seen (stop, [DONE], done:true)
    error: Optional[str] = None            # an error the upstream reported inside the body
    ollama: Dict[str, int] = field(default_factory=dict)
    unparsed: int = 0                      # events that were not JSON or too large
    note: Optional[str] = None             # why the body was not read, when it was not

    @property
    def streamed(self) -> bool:
        return self.kind in ("sse", "ndjson")


def _int(v: Any) -> Optional[int]:
    """A JSON integer that fits int64 (what OTLP carries), else None."""
    return v if isinstance(v, int) and not isinstance(v, bool) and -NUMBER_LIMIT <= v < NUMBER_LIMIT else None


def _count(v: Any) -> Optional[int]:
    """A count (tokens, nanoseconds): a JSON integer from 0 within int64, else None: an upstream's -5
    tokens is not a figure a span can carry."""
    n = _int(v)
    return n if n is not None and n >= 0 else None


def _number(v: Any) -> Optional[float]:
    """A finite JSON number within int64's magnitude (sums of two stay finite), else None: Python's JSON
    reader takes NaN, Infinity and 1e400 (inf), and a fact must never break the span it goes into."""
    if isinstance(v, float):
        return v if math.isfinite(v) and -NUMBER_LIMIT <= v <= NUMBER_LIMIT else None
    return _int(v)


class FactCollector:
    """Folds decoded JSON events into StreamFacts; knows llama-server, OpenAI and Ollama shapes."""

    def __init__(self, facts: StreamFacts):
        self.facts = facts

    def event(self, obj: Any, now_ns: int, streamed: bool) -> None:
        f = self.facts
        f.events += 1
        f.last_event_ns = now_ns
        if isinstance(obj, list):            # multi-prompt non-OAI answers: read the first
            obj = obj[0] if obj and isinstance(obj[0], dict) else None
        if not isinstance(obj, dict):
            return
        err = obj.get("error")
        if err is not None and "choices" not in obj:
            if isinstance(err, dict):
                f.error = str(err.get("message") or err.get("type") or err)
            else:
                f.error = str(err)
            return
        if isinstance(obj.get("id"), str):
            f.response_id = obj["id"]
        if isinstance(obj.get("model"), str) and obj["model"]:
            f.model = obj["model"]
        if _int(obj.get("id_slot")) is not None and obj["id_slot"] >= 0:   # partial events say -1
            f.id_slot = obj["id_slot"]
        timings = obj.get("timings")
        if isinstance(timings, dict):
            f.timings = {k: timings[k] for k in TIMING_KEYS if _number(timings.get(k)) is not None
                         and timings[k] >= 0}
        self._usage(obj)
        if streamed and f.first_token_ns is None and self._carries_generation(obj):
            f.first_token_ns = now_ns
        if streamed and self._carries_generation(obj):
            f.token_events += 1

    def done(self) -> None:
        self.facts.done = True

    def _carries_generation(self, obj: Dict[str, Any]) -> bool:
        if "prompt_progress" in obj:
            return False
        if "stop" in obj and "content" in obj:            # llama-server /completion
            return obj.get("stop") is False or bool(obj.get("content"))
        choices = obj.get("choices")
        if isinstance(choices, list):                     # OpenAI completion / chat chunk
            return bool(choices)
        if "done" in obj and ("response" in obj or "message" in obj):   # Ollama
            return obj.get("done") is False or bool(obj.get("response")) or bool(
                (obj.get("message") or {}).get("content") if isinstance(obj.get("message"), dict) else False)
        return False

    def _usage(self, obj: Dict[str, Any]) -> None:
        f = self.facts
        usage = obj.get("usage")
        if isinstance(usage, dict):
            if _count(usage.get("prompt_tokens")) is not None:
                f.input_tokens = usage["prompt_tokens"]
            if _count(usage.get("completion_tokens")) is not None:
                f.output_tokens = usage["completion_tokens"]
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and _count(details.get("cached_tokens")) is not None:
                f.cached_tokens = details["cached_tokens"]
        if obj.get("stop") is True:                       # llama-server /completion final event
            if _count(obj.get("tokens_evaluated")) is not None:
                f.input_tokens = obj["tokens_evaluated"]
            if _count(obj.get("tokens_predicted")) is not None:
                f.output_tokens = obj["tokens_predicted"]
            if isinstance(obj.get("stop_type"), str):
                f.finish_reason = obj["stop_type"]
            f.done = True
        if "tokens_evaluated" in obj and f.input_tokens is None and _count(obj.get("tokens_evaluated")) is not None:
            f.input_tokens = obj["tokens_evaluated"]      # embeddings: no stop flag
        choices = obj.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            fr = choices[0].get("finish_reason")
            if isinstance(fr, str):
                f.finish_reason = fr
        if obj.get("done") is True:                       # Ollama final chunk
            for k in OLLAMA_KEYS:
                if _count(obj.get(k)) is not None:
                    f.ollama[k] = obj[k]
            if "prompt_eval_count" in f.ollama:
                f.input_tokens = f.ollama["prompt_eval_count"]
            if "eval_count" in f.ollama:
                f.output_tokens = f.ollama["eval_count"]
            if isinstance(obj.get("done_reason"), str):
                f.finish_reason = obj["done_reason"]
            f.done = True


_DECODER = json.JSONDecoder()


def _json(raw: bytes) -> Any:
    """json.loads(raw) without its per-call encoding detection (a BOM, UTF-16/32 or lone surrogates
    still go through it). ValueError for anything that is not JSON it can read, including JSON nested
    deeper than the interpreter's recursion limit (200 kB of ``[[[...``)."""
    try:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            return json.loads(raw)
        if text.startswith("\ufeff"):
            return json.loads(raw)
        return _DECODER.decode(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply to read") from None


class SSEParser:
    """Incremental text/event-stream parser (line endings CRLF, LF or CR, per the SSE spec)."""

    def __init__(self, collector: FactCollector):
        self.c = collector
        self.buf = b""
        self.data: list = []
        self.size = 0
        self.skipping = False
        self.pending_cr = False

    def feed(self, chunk: bytes, now_ns: int) -> None:
        if self.pending_cr and chunk.startswith(b"\n"):
            chunk = chunk[1:]                 # the LF of a CRLF split across chunks
        self.pending_cr = False
        buf = self.buf + chunk if self.buf else chunk
        if b"\r" not in buf:                  # LF only (llama-server, Ollama): split once
            lines = buf.split(b"\n")
            self.buf = lines.pop()
            for line in lines:
                self._line(line, now_ns)
            if len(self.buf) > MAX_EVENT_BYTES:
                self.buf = b""
                self.skipping = True
            return
        pos, n = 0, len(buf)
        while pos < n:
            lf, cr = buf.find(b"\n", pos), buf.find(b"\r", pos)
            i = lf if cr < 0 else cr if lf < 0 else min(lf, cr)
            if i < 0:
                break
            line = buf[pos:i]
            if buf[i] == 13:                  # CR, maybe followed by LF
                if i + 1 < n:
                    pos = i + 2 if buf[i + 1] == 10 else i + 1
                else:
                    self.pending_cr = True
                    pos = i + 1
            else:
                pos = i + 1
            self._line(line, now_ns)
        self.buf = buf[pos:]
        if len(self.buf) > MAX_EVENT_BYTES:
            self.buf = b""
            self.skipping = True

    def _line(self, line: bytes, now_ns: int) -> None:
        if not line:
            self._dispatch(now_ns)
            return
        if line.startswith(b":"):
            return
        name, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if name == b"data" and not self.skipping:
            self.size += len(value)
            if self.size > MAX_EVENT_BYTES:
                self.skipping = True
                self.data = []
            else:
                self.data.append(value)

    def _dispatch(self, now_ns: int) -> None:
        skipped, data = self.skipping, self.data
        self.data, self.size, self.skipping = [], 0, False
        if skipped:
            self.c.facts.unparsed += 1
            return
        if not data:
            return
        payload = b"\n".join(data)
        if payload.strip() == b"[DONE]":
            self.c.done()
            return
        try:
            obj = _json(payload)
        except ValueError:
            self.c.facts.unparsed += 1
            return
        self.c.event(obj, now_ns, streamed=True)

    def close(self, now_ns: int) -> None:
        # An event not closed by a blank line is dropped by browsers; we read it anyway, since
        # llama-server's last /completion event is always terminated, this only helps broken upstreams.
        if self.buf:
            self._line(self.buf, now_ns)
            self.buf = b""
        self._dispatch(now_ns)


class NDJSONParser:
    def __init__(self, collector: FactCollector):
        self.c = collector
        self.buf = b""
        self.skipping = False

    def feed(self, chunk: bytes, now_ns: int) -> None:
        start = 0
        while True:
            i = chunk.find(b"\n", start)
            if i < 0:
                break
            line = self.buf + chunk[start:i]
            self.buf = b""
            start = i + 1
            if self.skipping:
                self.skipping = False
                self.c.facts.unparsed += 1
                continue
            self._line(line, now_ns)
        if not self.skipping:
            self.buf += chunk[start:]
            if len(self.buf) > MAX_EVENT_BYTES:
                self.buf = b""
                self.skipping = True

    def _line(self, line: bytes, now_ns: int) -> None:
        line = line.strip()
        if not line:
            return
        try:
            obj = _json(line)
        except ValueError:
            self.c.facts.unparsed += 1
            return
        self.c.event(obj, now_ns, streamed=True)

    def close(self, now_ns: int) -> None:
        if self.skipping:
            self.c.facts.unparsed += 1
        elif self.buf:
            self._line(self.buf, now_ns)
        self.buf = b""


class JSONBodyParser:
    def __init__(self, collector: FactCollector):
        self.c = collector
        self.parts: list = []
        self.size = 0
        self.too_big = False

    def feed(self, chunk: bytes, now_ns: int) -> None:
        if self.too_big:
            return
        self.size += len(chunk)
        if self.size > MAX_JSON_BODY_BYTES:
            self.too_big, self.parts = True, []
            self.c.facts.note = f"body larger than {MAX_JSON_BODY_BYTES} bytes: not read"
            return
        self.parts.append(chunk)

    @property
    def pending(self) -> int:
        return 0 if self.too_big else self.size

    def close(self, now_ns: int) -> None:
        if self.too_big or not self.parts:
            return
        try:
            obj = _json(b"".join(self.parts))
        except ValueError:
            self.c.facts.unparsed += 1
            return
        finally:
            self.parts = []
        self.c.event(obj, now_ns, streamed=False)


class InflateBudget(Exception):
    """The inflated copy reached MAX_INFLATED_BYTES."""


class _Decoder:
    """Undo gzip/deflate on the parser's copy, up to MAX_INFLATED_BYTES in all (a few KB on the wire can
    inflate to GBs); the client still gets the compressed bytes."""

    def __init__(self, encoding: str):
        wbits = 16 + zlib.MAX_WBITS if encoding in ("gzip", "x-gzip") else zlib.MAX_WBITS
        self.z = zlib.decompressobj(wbits)
        self.left = MAX_INFLATED_BYTES
        self.over = False

    def slices(self, chunk: bytes):
        """What `chunk` inflates to, INFLATE_SLICE bytes at a time (a parser never holds more at once)."""
        if self.over:
            raise InflateBudget()
        data = chunk
        while self.left > 0 and data:
            out = self.z.decompress(data, min(self.left, INFLATE_SLICE))
            self.left -= len(out)
            data = self.z.unconsumed_tail
            if out:
                yield out
            elif not data:
                break
        if self.left <= 0 and not self.z.eof:
            self.over = True                 # more would come: the caller reads up to here and stops


class BodyReader:
    """Chooses a parser from the response headers and never raises into the proxy's data path.

    `on_first_token(t_ns)` is called once, when the chunk that carried the first token is read.

    A compressed answer is `deferred`: its chunks are only kept (with their arrival times) as they pass,
    up to MAX_INFLATED_BYTES, and inflated and read at close(), which the proxy runs on a thread (`heavy`):
    what a small compressed answer costs to read is not bounded by its size on the wire, so it must not be
    paid on the event loop that serves every client. The facts are the same (each event still has its
    chunk's arrival time); on_first_token is not called (the caller reads facts.first_token_ns after close).
    """

    def __init__(self, content_type: str, content_encoding: str = "", default_kind: str = "json",
                 on_first_token: Optional[Callable[[int], None]] = None):
        self.facts = StreamFacts()
        self._on_first_token = on_first_token
        self._held: Optional[Tuple[bytes, int]] = None          # the latest chunk, not read yet
        ct = (content_type or "").split(";")[0].strip().lower()
        if ct == "text/event-stream":
            kind = "sse"
        elif ct in ("application/x-ndjson", "application/ndjson", "application/jsonl"):
            kind = "ndjson"
        elif ct in ("application/json", "") or ct.endswith("+json"):
            kind = default_kind if ct == "" else "json"
        else:
            kind = None
        enc = (content_encoding or "").strip().lower()
        self.decode = None
        if kind is not None and enc not in ("", "identity"):
            if enc in ("gzip", "x-gzip", "deflate"):
                self.decode = _Decoder(enc)
            else:
                self.facts.note = f"content-encoding {enc}: body not read"
                kind = None
        collector = FactCollector(self.facts)
        if kind is None:
            self.parser = None
            if self.facts.note is None:
                self.facts.note = f"content-type {ct}: body not read"
        else:
            self.facts.kind = kind
            self.parser = {"sse": SSEParser, "ndjson": NDJSONParser, "json": JSONBodyParser}[kind](collector)
        self.failed: Optional[str] = None
        self.deferred = self.decode is not None and self.parser is not None
        self._kept: list = []                  # deferred: (chunk, arrival ns) to read at close
        self._kept_bytes = 0
        if self.deferred:
            self._on_first_token = None

    @property
    def heavy(self) -> bool:
        """Whether close() may be long: the proxy then runs it on a thread."""
        if self.parser is None:
            return False
        return self.deferred or getattr(self.parser, "pending", 0) > HEAVY_BYTES

    def feed(self, chunk: bytes, now_ns: int) -> None:
        if self.deferred:
            if self.parser is not None and self._kept_bytes < MAX_INFLATED_BYTES:
                self._kept.append((chunk, now_ns))
                self._kept_bytes += len(chunk)
            return
        held, self._held = self._held, (chunk, now_ns)
        if held is not None:
            self._read(*held)

    def catch_up(self) -> None:
        """Read the chunk held back (at the end of an answer whose first token is still unknown)."""
        if self.deferred:
            return                              # read at close(), on a thread
        held, self._held = self._held, None
        if held is not None:
            self._read(*held)

    def _read(self, chunk: bytes, now_ns: int) -> None:
        if self.parser is None:
            return
        try:
            if self.decode is None:
                self.parser.feed(chunk, now_ns)
            else:
                for piece in self.decode.slices(chunk):
                    self.parser.feed(piece, now_ns)
            if self.decode is not None and self.decode.over:
                raise InflateBudget()
        except InflateBudget:
            self.facts.note = f"compressed body inflates past {MAX_INFLATED_BYTES} bytes: read up to there"
            self.parser = None
            return
        except Exception as e:  # a parser bug must never break the client's stream
            self.failed = f"{type(e).__name__}: {e}"
            self.facts.note = f"body reader stopped: {self.failed}"
            self.parser = None
            return
        if self._on_first_token is not None and self.facts.first_token_ns is not None:
            callback, self._on_first_token = self._on_first_token, None
            try:
                callback(self.facts.first_token_ns)
            except Exception as e:
                self.facts.note = f"first-token callback failed: {type(e).__name__}: {e}"

    def close(self, now_ns: int) -> StreamFacts:
        kept, self._kept = self._kept, []
        for chunk, t_ns in kept:
            if self.parser is None:
                break
            self._read(chunk, t_ns)
        if self.deferred and self._kept_bytes >= MAX_INFLATED_BYTES and self.facts.note is None:
            self.facts.note = f"compressed body over {MAX_INFLATED_BYTES} bytes: read up to there"
        self.catch_up()
        if self.parser is not None:
            try:
                self.parser.close(now_ns)
            except Exception as e:
                self.facts.note = f"body reader stopped: {type(e).__name__}: {e}"
            self.parser = None
        return self.facts


def parse_request_body(body: bytes, content_encoding: str = "") -> Dict[str, Any]:
    """Fields of a request body the span wants: model, stream, max tokens, temperature, top_p, seed (top level, else
    Ollama's options). {} when not JSON.
    A gzip or deflate body (forwarded as sent) is read from a decompressed copy of its start."""
    enc = (content_encoding or "").strip().lower()
    try:
        if enc in ("gzip", "x-gzip", "deflate"):
            body = zlib.decompressobj(16 + zlib.MAX_WBITS if enc != "deflate" else zlib.MAX_WBITS
                                      ).decompress(body, MAX_JSON_BODY_BYTES)
        elif enc not in ("", "identity"):
            return {}
        obj = _json(body)
    except (ValueError, zlib.error):
        return {}
    if not isinstance(obj, dict):
        return {}
    out: Dict[str, Any] = {}
    if isinstance(obj.get("model"), str):
        out["model"] = obj["model"]
    if isinstance(obj.get("stream"), bool):
        out["stream"] = obj["stream"]
    for k in ("max_tokens", "max_completion_tokens", "n_predict"):
        if _int(obj.get(k)) is not None:
            out["max_tokens"] = obj[k]
            break
    opts = obj.get("options")
    if "max_tokens" not in out and isinstance(opts, dict) and _int(opts.get("num_predict")) is not None:
        out["max_tokens"] = opts["num_predict"]
    for k, read in (("temperature", _number), ("top_p", _number), ("seed", _int)):
        for where in (obj, opts if isinstance(opts, dict) else {}):
            v = read(where.get(k))
            if v is not None:
                out[k] = float(v) if read is _number else v
                break
    return out
