"""The one way text a client supplied (headers, paths, request bytes) reaches the proxy's log.

A client can send as many requests as it likes, each with whatever text it likes: a line per request,
quoting it, would let it flood the log and write lines of its own ("ERROR ..."). So every line that
comes from a client's input is

- rate-limited by kind: at most one every LOG_EVERY_S, the next one says how many were held back;
- one line, escaped (no newline, no terminal escape: telemetry.redact) and cut to LINE_LIMIT characters;
- about the input, not a copy of it: the libraries that quote what they refuse (OpenTelemetry's
  baggage and trace-context readers, aiohttp's request parser) are given a filter or logger here
  that keeps their reason and drops the quote.
"""
from __future__ import annotations

import logging
import time
from typing import Dict, Optional

from otel_gpu_census.telemetry import redact

LOG_EVERY_S = 10.0          # a kind of client-caused line at most this often
LINE_LIMIT = 300            # characters of one such line

LOG = logging.getLogger("otel_gpu_census.proxy")
HTTP_LOG = logging.getLogger("otel_gpu_census.proxy.http")


class RateLimit:
    """At most one line every LOG_EVERY_S; how many were held back is told in the next one."""

    def __init__(self):
        self.next_s, self.held = 0.0, 0

    def allow(self) -> Optional[str]:
        """None: hold this line back; else the suffix to end it with ('' or how many were held)."""
        now = time.monotonic()
        if now < self.next_s:
            self.held += 1
            return None
        suffix = f" ({self.held} more since the last such line)" if self.held else ""
        self.next_s, self.held = now + LOG_EVERY_S, 0
        return suffix


class ClientLog:
    """`warning(kind, text)`: one line for something a client caused, rate-limited per kind."""

    def __init__(self, logger: logging.Logger = LOG):
        self.logger = logger
        self.limits: Dict[str, RateLimit] = {}

    def warning(self, kind: str, text: str) -> None:
        limit = self.limits.get(kind)
        if limit is None:
            limit = self.limits[kind] = RateLimit()
        suffix = limit.allow()
        if suffix is not None:
            self.logger.warning("%s", redact.text(" ".join(text.split()), LINE_LIMIT) + suffix)


class ShortLog(logging.LoggerAdapter):
    """The logger aiohttp's server is given: each record becomes one short line (aiohttp's reason,
    without the request bytes it quotes; no traceback), rate-limited."""

    def __init__(self, logger: logging.Logger = HTTP_LOG):
        super().__init__(logger, {})
        self.limit = RateLimit()

    def log(self, level, msg, *args, exc_info=None, **kwargs) -> None:
        if not self.isEnabledFor(level):
            return
        suffix = self.limit.allow()
        if suffix is None:
            return
        try:
            what = (msg % args if args else str(msg)).replace("Error handling request", "bad request")
        except Exception:
            what = "bad request"
        exc = exc_info if isinstance(exc_info, BaseException) else None
        if exc is not None:
            what = f"{what}: {type(exc).__name__}: {getattr(exc, 'message', '') or exc}"
        self.logger.log(level, "%s", redact.reason(what, LINE_LIMIT) + suffix)


class OneLineFilter(logging.Filter):
    """For a library logger that quotes its input whole: one plain line instead, rate-limited."""

    def __init__(self, text: str):
        super().__init__()
        self.text, self.limit = text, RateLimit()

    def filter(self, record: logging.LogRecord) -> bool:
        suffix = self.limit.allow()
        if suffix is None:
            return False
        record.msg, record.args, record.exc_info, record.exc_text = self.text + suffix, None, None, None
        return True


# OpenTelemetry's readers of a client's headers log what they refuse, quoted whole (baggage: up to 180
# entries of 4 KiB per request; tracestate: each member). The proxy checks both headers first
# (server.py) and drops a bad one whole; these are what is left of those lines.
LIBRARY_FILTERS = {
    "opentelemetry.baggage.propagation": OneLineFilter(
        "a client's baggage header had entries OpenTelemetry refused (not the W3C Baggage format); they are "
        "not propagated"),
    "opentelemetry.baggage": OneLineFilter(
        "a client's baggage had entries OpenTelemetry refused; they are not propagated"),
    "opentelemetry.trace.span": OneLineFilter(
        "a tracestate OpenTelemetry refused (not the W3C Trace Context format); it is not propagated"),
    "opentelemetry.trace.propagation.tracecontext": OneLineFilter(
        "a client's traceparent or tracestate header OpenTelemetry refused (over its length limit); "
        "it is not propagated"),
}


def install_library_filters() -> None:
    for name, flt in LIBRARY_FILTERS.items():
        lg = logging.getLogger(name)
        if flt not in lg.filters:
            lg.addFilter(flt)
