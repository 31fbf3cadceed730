"""The reverse proxy: forwards to one upstream, byte for byte, and opens one SERVER span per request.

Data path for a model request (see routes.py for which those are):
  client ─▶ aiohttp server ─▶ request body: read whole when it has a Content-Length up to 1 MiB (then
            a stale pooled connection can be retried), else streamed through
         ─▶ aiohttp client (pooled connections, checked before reuse: upstream.py)
         ─▶ upstream; its answer streamed back chunk by chunk, each chunk written to the client
            first and then handed to stream.BodyReader, which reads each chunk after the next one
            went out (the last after the answer's end went out).
Only the span's start (its id goes upstream in `traceparent`) comes before the first byte is sent on;
the request body is parsed, attributes are set and metrics recorded after the answer's last byte went
to the client. Then the span waits (in the background) for the census to cover its window, gets its
GPU cost (attribution.ledger) and ends with its real end time (telemetry.request: the lifecycle every
integration shares).

Failures answer like llama-server does, ``{"error": {"code", "message", "type"}}``:
  connection refused / unreachable → 503; upstream closed or sent garbage before answering, or
  answered 101 (an upgrade) → 502; no answer within --upstream-timeout → 504; request body over
  --max-body-bytes → 413; no byte of the request body for --client-timeout → 408;
  absolute-form or CONNECT requests → 400/405 (the proxy talks to its upstream only); a path with a
  '..' segment, also percent-encoded → 400 (it would climb out of the upstream's path prefix).
After the answer has started, a failure can only cut the connection: the client sees a truncated
body, never a clean end (also when the upstream breaks its chunked encoding).
Every read of a client has a deadline: a connection idle, or slow to send a whole request head, for
--client-timeout is closed, and so is one that takes no byte of its answer for that long while bytes
wait for it (its buffers go with it). Connections past what the file descriptors allow are answered
503 (connections.py). Whatever a client's input makes the proxy log (a malformed request, a dropped
header) goes through clientlog: one short escaped line per kind at most every LOG_EVERY_S. A client's
baggage or tracestate header past the W3C limits is dropped (neither read nor forwarded). A model request's tenant
(telemetry/tenant.py: baggage or a configured header, within those limits) is read once, as its span starts. What a
client or the upstream supplied reaches spans and logs only through
telemetry.redact (credentials in the upstream's URL and secret query values never do; headers never).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass, field
from collections import deque
from typing import Any, AsyncIterator, Deque, Dict, Optional, Tuple
from urllib.parse import unquote

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from otel_gpu_census.attribution.ledger import CensusSource, GpuLedger
from otel_gpu_census.telemetry import propagators, redact
from otel_gpu_census.telemetry import tenant as tenant_of
from otel_gpu_census.telemetry.loop_lag import LoopLagProbe
from otel_gpu_census.telemetry.request import RequestTelemetry, TrackedRequest
from otel_gpu_census.integrations.llamacpp import spans as spanattrs
from otel_gpu_census.integrations.llamacpp import clientlog, connections
from otel_gpu_census.integrations.llamacpp.clientlog import HTTP_LOG, RateLimit
from otel_gpu_census.integrations.llamacpp import upstream as upstream_conn
from otel_gpu_census.integrations.llamacpp.config import ConfigError, ProxyConfig, check_not_itself, forwards_to_itself
from otel_gpu_census.integrations.llamacpp.routes import LLAMACPP, Route, classify, http_route, untraced
from otel_gpu_census.integrations.llamacpp.stream import HEAVY_BYTES, BodyReader, parse_request_body

log = logging.getLogger("otel_gpu_census.proxy")

# RFC 7230 section 6.1 hop-by-hop headers, plus Proxy-Connection (common, non-standard).
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
                        "upgrade", "proxy-authenticate", "proxy-authorization"})
# Also not forwarded upstream: Host is the upstream's; Expect is answered by this proxy.
REQUEST_DROP = HOP_BY_HOP | {"host", "expect"}
REQUEST_PARSE_BYTES = 1 << 20          # request body kept to read `model` / `stream`
BUFFER_BODY_BYTES = 1 << 20            # bodies up to this (with a Content-Length) are read whole first
# Per-connection buffer budget: what a stream reader holds before it stops reading its socket (aiohttp
# stops at twice this; its own default, 256 KiB, lets a client that never reads pin about 1 MiB of answer).
READ_BUFFER_BYTES = 1 << 16
STOP_GRACE_S = 2.0                     # how long answers in flight may go on once the proxy stops
FINISH_AFTER_S = 0.05                  # a finished request's span work waits this long (see _finish)
SERVED_KEPT = 100_000                  # model requests remembered (start, end, first token) for `run`'s report
SCOPE = "otel_gpu_census.proxy"        # instrumentation scope of the proxy's spans and metrics
WATCH_S = 0.25                         # how often answers in flight are checked for a lost upstream
LOOP_LAG_PATH = "/.otel-gpu-census/loop-lag"   # the lag probe's figures (only with --loop-lag-probe)
RESOLVE_S = 3.0                        # how long the upstream's name may take to resolve at start
MODEL_NAME_LIMIT = 256                 # characters of a client's `model` kept (span name, attribute, metric label)

# gpu_census.proxy.outcome values
COMPLETE = "complete"
CLIENT_GONE = "client_disconnected"
UPSTREAM_UNAVAILABLE = "upstream_unavailable"
UPSTREAM_ERROR = "upstream_error"
UPSTREAM_TIMEOUT = "upstream_timeout"
BODY_TOO_LARGE = "body_too_large"
CLIENT_TIMEOUT = "client_timeout"
REJECTED = "rejected"


# A write to a client that went away (aiohttp >= 3.10 raises its own subclass).
CLIENT_RESET = (ConnectionResetError, getattr(aiohttp, "ClientConnectionResetError", ConnectionResetError))


class BodyProblem(Exception):
    """The request body cannot be forwarded (too large, stalled): _Exchange.body_problem says how to answer."""


class UpstreamLost(aiohttp.ClientPayloadError):
    """The upstream connection closed mid-answer and the client library never ended the answer."""


# W3C Baggage limits (also OpenTelemetry's): a client's header past them is dropped whole (telemetry/tenant.py
# reads the tenant from baggage within the same limits).
_baggage_problem = tenant_of.baggage_problem
BAGGAGE_MAX_BYTES = tenant_of.BAGGAGE_MAX_BYTES


# W3C Trace Context limits on tracestate (OpenTelemetry's): a client's header past them, or with a member
# not in its format, is dropped whole (the span still joins the client's trace through traceparent).
TRACESTATE_MAX_CHARS = 8192
TRACESTATE_MAX_MEMBERS = 32
_TRACESTATE_KEY = r"[a-z][_0-9a-z\-\*\/]{0,255}|[a-z0-9][_0-9a-z\-\*\/]{0,240}@[a-z][_0-9a-z\-\*\/]{0,13}"
_TRACESTATE_MEMBER = re.compile(rf"(?:{_TRACESTATE_KEY})=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{{0,255}}"
                                r"[\x21-\x2b\x2d-\x3c\x3e-\x7e]")


def _tracestate_problem(values) -> Optional[str]:
    """Why a client's tracestate header(s) must be dropped whole, or None. Says what is wrong, never
    what the client wrote."""
    n = sum(len(v) for v in values) + max(0, len(values) - 1)
    if n > TRACESTATE_MAX_CHARS:
        return f"{n} characters, over the {TRACESTATE_MAX_CHARS} W3C Trace Context allows"
    members = [m.strip(" \t") for v in values for m in v.split(",")]
    members = [m for m in members if m]
    if len(members) > TRACESTATE_MAX_MEMBERS:
        return f"{len(members)} members, over the {TRACESTATE_MAX_MEMBERS} W3C Trace Context allows"
    bad = sum(1 for m in members if _TRACESTATE_MEMBER.fullmatch(m) is None)
    if bad:
        return f"{bad} of its {len(members)} members not in the W3C Trace Context format"
    keys = [m.split("=", 1)[0] for m in members]
    if len(set(keys)) != len(keys):
        return "a key given twice"
    return None


def _path_escapes(raw_path: str) -> bool:
    """Whether the path has a '..' segment, also percent-encoded (%2e%2e) or behind a backslash:
    joined to the upstream's path prefix it would be resolved above it."""
    path = raw_path.split("?", 1)[0]
    if "." not in path and "%" not in path:
        return False
    return ".." in re.split(r"[/\\]", unquote(path))


# What a response the client library could not parse raises (its pure-Python parser raises these
# unwrapped; they are not ClientErrors).
HTTP_PARSE_ERRORS = (aiohttp.http_exceptions.HttpProcessingError,)


def _strip(headers, drop) -> CIMultiDict:
    """Headers without `drop` and without the ones a Connection header names."""
    named = set()
    for v in headers.getall("Connection", []):
        named.update(t.strip().lower() for t in v.split(",") if t.strip())
    out = CIMultiDict()
    for k, v in headers.items():
        lk = k.lower()
        if lk in drop or lk in named:
            continue
        out.add(k, v)
    return out


def _error_body(code: int, message: str, typ: str = "proxy_error") -> bytes:
    return json.dumps({"error": {"code": code, "message": message, "type": typ}}).encode()


@dataclass
class _Exchange:
    """One request's state as it moves through the handler."""

    start_ns: int
    route: Optional[Route]
    span: Any = None
    tracked: Optional[TrackedRequest] = None   # model requests: the lifecycle behind `span`
    key: str = ""
    request_fields: Dict[str, Any] = field(default_factory=dict)
    outcome: str = COMPLETE
    status: Optional[int] = None
    error_type: Optional[str] = None
    error_message: Optional[str] = None
    req_bytes: int = 0
    resp_bytes: int = 0
    reader: Optional[BodyReader] = None
    ledger_open: bool = False
    head: Any = None                       # start of the request body, to read `model` from
    body_encoding: str = ""                # the request body's Content-Encoding
    body_problem: Optional[tuple] = None   # (status, outcome, message) when the request body failed
    watch_bytes: int = -1                  # resp_bytes at the relay watch's last look
    write_stalled_since: Optional[float] = None   # monotonic s since the client stopped taking the answer
    upstream_done: bool = False            # the upstream's answer was read to its end
    retried: bool = False                  # sent again on a new connection (upstream.py)
    connection: Any = None                 # the upstream connection's protocol (upstream.py)
    spent: bool = False                    # the connection carried a chunked answer: not reused
    baggage_dropped: bool = False          # the client's baggage header broke W3C limits


class Proxy:
    """The aiohttp application and its upstream session; `start()`/`stop()` inside an event loop."""

    def __init__(self, config: ProxyConfig, tracer_provider=None, meter_provider=None,
                 census_source: Optional[CensusSource] = None):
        self.config = config
        self.upstream_shown = redact.url(config.upstream)     # what telemetry and logs say of the upstream
        self.authorization = config.upstream_authorization   # credentials in the upstream's URL, as a header
        self.upstream_base = config.upstream_base             # what every forwarded request's URL starts with
        self.telemetry = RequestTelemetry(tracer_provider, meter_provider, provider_name=LLAMACPP,
                                          instrumentation_name=SCOPE)
        if census_source is None and config.gpu:
            census_source = _default_source(config)
        self.ledger = GpuLedger(census_source, margin_s=config.gpu_margin_s, max_wait_s=config.gpu_max_wait_s,
                                note=spanattrs.NOTE_STATE_SAVE)
        self.session: Optional[aiohttp.ClientSession] = None
        self.runner: Optional[web.AppRunner] = None
        self.port: Optional[int] = None
        self._finishing: set = set()
        # the model requests served, for `run --proxy`'s report: when each was in flight (wall ns)
        self.served: Deque[Tuple[int, int, Optional[int]]] = deque(maxlen=SERVED_KEPT)
        self._stopping = False
        # answers being relayed, by exchange: (the upstream's answer, the client's request, the exchange)
        self._relays: Dict[int, Tuple[aiohttp.ClientResponse, web.Request, _Exchange]] = {}
        self._watcher: Optional[asyncio.Task] = None
        self.loop_lag: Optional[LoopLagProbe] = LoopLagProbe(config.loop_lag_s) if config.loop_lag_s > 0 else None
        clientlog.install_library_filters()
        self.tenant_source = tenant_of.source()      # who a request is charged to (OTEL_GPU_CENSUS_TENANT)
        self.propagator, dropped = propagators.for_environment()     # never fails on a name it cannot load
        if dropped:
            log.warning("%s", redact.text(dropped, 300))
        self.client_log = clientlog.ClientLog(log)    # every line a client's input causes goes through it
        self._refusals = RateLimit()
        self._loop_errors = RateLimit()
        self.cap = 0                       # client connections served at once (connections.py), set at start
        # auto_decompress off: a compressed request body is forwarded as sent, with its Content-Encoding.
        # keepalive_timeout: aiohttp closes a connection that has not delivered a whole request head
        # that long after it opened or after its last answer (slowloris), and an idle one.
        self.app = web.Application(handler_args={"max_field_size": 65536, "auto_decompress": False,
                                                 "read_bufsize": READ_BUFFER_BYTES,
                                                 "keepalive_timeout": config.client_timeout_s,
                                                 "logger": clientlog.ShortLog(HTTP_LOG)},
                                   middlewares=[self._guard])
        if self.loop_lag is not None:     # answered here, never forwarded (and never traced)
            self.app.router.add_route("GET", LOOP_LAG_PATH, self._loop_lag_figures)
        self.app.router.add_route("*", "/{tail:.*}", self.handle)

    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        # Before routing: the proxy forwards origin-form requests to its upstream and nothing else.
        if request.method == "CONNECT":
            return self._plain_error(405, "CONNECT is not supported: this proxy forwards to its upstream only")
        if not request.raw_path.startswith("/"):
            return self._plain_error(400, "absolute-form request targets are refused: this proxy forwards "
                                     "to its configured upstream only")
        if _path_escapes(request.raw_path):
            return self._plain_error(400, "a path with a '..' segment is refused: it would leave the "
                                     "upstream's path prefix")
        return await handler(request)

    # -- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        check_not_itself(cfg.listen_host, cfg.listen_port, cfg.upstream)
        self.cap = connections.connection_cap()
        self.connector = upstream_conn.connector(cfg.unix_socket, cfg.upstream_keepalive_s, limit=self.cap,
                                                 read_bytes=READ_BUFFER_BYTES)
        self.session = aiohttp.ClientSession(
            connector=self.connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar(),
            read_bufsize=READ_BUFFER_BYTES,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_timeout_s,
                                          sock_read=cfg.upstream_timeout_s))
        # handler_cancellation: a client that hangs up cancels its handler, which cancels the
        # upstream request, even while the upstream is silent (long prompt processing).
        self.runner = web.AppRunner(self.app, handle_signals=False, handler_cancellation=True,
                                    access_log=None, shutdown_timeout=STOP_GRACE_S)
        await self.runner.setup()
        asyncio.get_running_loop().set_exception_handler(self._loop_error)
        site = connections.CappedSite(self.runner, cfg.listen_host, cfg.listen_port, self.cap, self._refused)
        await site.start()
        sock = site._server.sockets[0] if site._server and site._server.sockets else None
        self.port = sock.getsockname()[1] if sock is not None else cfg.listen_port
        try:      # the upstream by another name of this machine (its host name, another address, port 0)
            itself = await asyncio.wait_for(asyncio.to_thread(forwards_to_itself, cfg.listen_host, self.port,
                                                              cfg.upstream), RESOLVE_S)
        except asyncio.TimeoutError:
            itself = False        # a name that does not resolve in time is not this machine's
        if itself:
            await site.stop()
            raise ConfigError(f"the proxy would forward to itself: it listens on {cfg.listen_host}:{self.port} and "
                              f"its upstream {redact.url(cfg.upstream)} is this machine; give the server and the "
                              "proxy different ports")
        self._watcher = asyncio.get_running_loop().create_task(self._watch_relays(), name="proxy-relay-watch")
        if self.loop_lag is not None:
            self.loop_lag.start()

    def _refused(self, open_now: int) -> None:
        suffix = self._refusals.allow()
        if suffix is not None:
            log.warning("%d client connections open, the most %d file descriptors allow: new ones are answered "
                        "503 (`ulimit -n` raises the limit)%s", open_now, connections.descriptor_limit(), suffix)

    def _loop_error(self, loop, context: dict) -> None:
        """What the event loop reports (a failed accept, a callback's error): one short line, rate-limited,
        instead of asyncio's traceback each time (at every accept retry when descriptors run out)."""
        suffix = self._loop_errors.allow()
        if suffix is not None:
            log.warning("%s%s", redact.text(connections.loop_error_line(context), 300), suffix)
        log.debug("event loop: %s", context.get("message"), exc_info=context.get("exception"))

    async def _loop_lag_figures(self, request: web.Request) -> web.Response:
        reset = request.query.get("reset", "") not in ("", "0")
        return web.json_response(self.loop_lag.stats(reset=reset))

    async def stop(self, drain_s: float = 0.0) -> None:
        """Stop. With drain_s, first give spans waiting for the census that long to finish normally."""
        if drain_s > 0 and self._finishing:
            await asyncio.wait(list(self._finishing), timeout=drain_s)
        self._stopping = True
        if self.runner is not None:
            # stop listening; answers still streaming get STOP_GRACE_S, then their handlers are cancelled
            await self.runner.cleanup()
        if self._watcher is not None:
            self._watcher.cancel()
        if self.loop_lag is not None:
            self.loop_lag.stop()
            log.warning("event-loop lag since the last reset: %s", json.dumps(self.loop_lag.stats()))
        await self.ledger.stop()
        if self._finishing:
            await asyncio.wait(list(self._finishing), timeout=5)
        if self.session is not None:
            await self.session.close()

    async def _watch_relays(self) -> None:
        """Every WATCH_S, for each answer being relayed (costs the data path nothing):

        - a client that has taken no byte of its answer for --client-timeout while bytes wait for it
          is cut (outcome client_timeout): a client that never reads must not hold an upstream slot,
          a connection and the buffered answer for ever;
        - after a burst of connections has gone, their memory goes back to the system (connections.py);
        - an answer whose upstream connection is gone but whose stream neither ended nor failed is
          failed: aiohttp (3.14, with its C parser) closes the connection on a broken chunked encoding
          but never ends the answer's stream, and drops its read timer, so the relay, and the client,
          would wait forever, past --upstream-timeout."""
        timeout = self.config.client_timeout_s
        give_back = connections.MemoryGiveBack()
        while True:
            await asyncio.sleep(WATCH_S)
            now = time.monotonic()
            if self.runner is not None and self.runner.server is not None:
                give_back.seen(len(self.runner.server.connections))
            for up, request, ex in list(self._relays.values()):
                try:
                    self._check_client(request, ex, now, timeout)
                except Exception:      # a check must never break the proxy
                    log.debug("client watch failed", exc_info=True)
                try:
                    content, conn = up.content, up.connection
                    if conn is None or content.is_eof() or content.exception() is not None:
                        continue
                    proto = conn.protocol
                    if proto is not None and proto.transport is None:
                        why = proto.exception() if hasattr(proto, "exception") else None
                        detail = " ".join(str(why).split()) if why is not None else ""
                        content.set_exception(UpstreamLost("the upstream connection closed mid-answer"
                                                           + (f" ({detail})" if detail else "")))
                except Exception:      # a check must never break the proxy
                    log.debug("relay watch failed", exc_info=True)

    def _check_client(self, request: web.Request, ex: _Exchange, now: float, timeout: float) -> None:
        transport = request.transport
        if transport is None or transport.is_closing():
            return
        if ex.resp_bytes != ex.watch_bytes or transport.get_write_buffer_size() == 0:
            ex.watch_bytes, ex.write_stalled_since = ex.resp_bytes, None      # taking it, or nothing waits
            return
        if ex.write_stalled_since is None:
            ex.write_stalled_since = now
        elif now - ex.write_stalled_since >= timeout:
            self._cut(request, ex, CLIENT_TIMEOUT, f"the client took no byte of the answer for {timeout:g} s "
                      f"({ex.resp_bytes} bytes went out)")

    # -- the handler ------------------------------------------------------------------------
    async def handle(self, request: web.Request) -> web.StreamResponse:
        cfg = self.config
        upstream_conn.bound_reads(request.transport, READ_BUFFER_BYTES)
        raw_path = request.raw_path
        route = classify(request.method, request.path, cfg.api_prefix)
        ex = _Exchange(start_ns=time.time_ns(), route=route)
        t0 = time.monotonic_ns()
        carrier = request.headers
        for header, check in (("baggage", _baggage_problem), ("tracestate", _tracestate_problem)):
            values = carrier.getall(header, ())
            problem = check(values) if values else None
            if problem is not None:       # dropped whole: neither read nor forwarded
                carrier = CIMultiDict(carrier)
                carrier.popall(header)
                if header == "baggage":
                    ex.baggage_dropped = True
                self.client_log.warning(header, f"dropped a client's {header} header ({problem})")
        parent = self.propagator.extract(carrier)
        if route is not None or not untraced(request.path, cfg.api_prefix):
            ex.span = self._start_span(request, ex, parent, carrier)
        ctx = trace.set_span_in_context(ex.span, parent) if ex.span is not None else parent
        if route is not None:
            ex.key = uuid.uuid4().hex
            self.ledger.open(ex.key, ex.start_ns)
            ex.ledger_open = True
        try:
            return await self._forward(request, ex, ctx, raw_path)
        except asyncio.CancelledError:
            if ex.outcome == COMPLETE:
                ex.outcome = ex.error_type = "proxy_stopped" if self._stopping else CLIENT_GONE
                ex.error_message = "the proxy stopped" if self._stopping else "the client hung up"
            raise
        finally:
            end_ns = ex.start_ns + (time.monotonic_ns() - t0)
            self._finish(ex, end_ns)

    async def _forward(self, request: web.Request, ex: _Exchange, ctx, raw_path: str) -> web.StreamResponse:
        cfg = self.config
        length = request.content_length
        if length is not None and length > cfg.max_body_bytes:
            return self._fail(ex, 413, BODY_TOO_LARGE,
                              f"request body of {length} bytes is over the limit of {cfg.max_body_bytes}",
                              close=True)
        headers = _strip(request.headers, REQUEST_DROP)
        for k in ("traceparent", "tracestate") + (("baggage",) if ex.baggage_dropped else ()):
            headers.popall(k, None)
        self.propagator.inject(headers, context=ctx)
        if self.authorization is not None and "Authorization" not in headers:
            headers["Authorization"] = self.authorization
        body: Any = None
        ex.body_encoding = request.headers.get("Content-Encoding", "")
        if request.body_exists:
            whole = length is not None and length <= BUFFER_BODY_BYTES
            body = self._request_body(request, ex, keep_head=not whole)
            if whole:
                try:
                    body = b"".join([chunk async for chunk in body])
                except BodyProblem:
                    return self._fail(ex, *ex.body_problem, close=True)
                if ex.route is not None:
                    ex.head = body
        url = self.upstream_base + raw_path
        try:
            upstream = await self._send(request.method, url, headers, body, ex)
        except BodyProblem:
            return self._fail(ex, *ex.body_problem, close=True)
        except asyncio.TimeoutError:
            if ex.body_problem:
                return self._fail(ex, *ex.body_problem, close=True)
            return self._fail(ex, 504, UPSTREAM_TIMEOUT,
                              f"upstream {cfg.upstream} did not answer within {cfg.upstream_timeout_s:g} s")
        except aiohttp.ClientConnectorError as e:
            return self._fail(ex, 503, UPSTREAM_UNAVAILABLE, f"cannot connect to upstream {cfg.upstream}: "
                              f"{e.os_error.strerror if e.os_error and e.os_error.strerror else e}")
        except (aiohttp.ClientError, OSError, *HTTP_PARSE_ERRORS) as e:
            if ex.body_problem:
                return self._fail(ex, *ex.body_problem, close=True)
            return self._fail(ex, 502, UPSTREAM_ERROR, f"upstream {cfg.upstream} failed before answering: "
                              f"{type(e).__name__}: {' '.join(str(e).split())}")
        try:
            return await self._relay(request, upstream, ex)
        finally:
            # An answer not read to its end must not leave a half-read connection behind.
            upstream.release() if ex.upstream_done else upstream.close()
            if ex.spent and ex.connection is not None:
                ex.connection.close()     # after the end went out, not on the next request's way

    async def _send(self, method: str, url: str, headers: CIMultiDict, body: Any, ex: _Exchange
                    ) -> aiohttp.ClientResponse:
        """The upstream's answer head; once more on a new connection when a reused one was reset
        before answering and the body is at hand (upstream.retryable)."""
        attempt = upstream_conn.Attempt()
        token = upstream_conn.ATTEMPT.set(attempt)
        try:
            try:
                resp = await self.session.request(method, url, headers=headers, data=body,
                                                  allow_redirects=False, compress=None)
            except (aiohttp.ClientOSError, ConnectionResetError) as e:
                if not upstream_conn.retryable(attempt, e, isinstance(body, bytes) or body is None):
                    raise
                ex.retried = True
                attempt = upstream_conn.Attempt(fresh_only=True)
                upstream_conn.ATTEMPT.set(attempt)
                resp = await self.session.request(method, url, headers=headers, data=body,
                                                  allow_redirects=False, compress=None)
            ex.connection = attempt.protocol
            return resp
        finally:
            upstream_conn.ATTEMPT.reset(token)

    def _request_body(self, request: web.Request, ex: _Exchange, keep_head: bool) -> AsyncIterator[bytes]:
        """The request body as it comes. Over --max-body-bytes it fails (413); a client that sends no
        byte of it for --client-timeout fails it too (408): every read of a client has a deadline, so a
        body announced and never sent cannot hold a connection (and its descriptor) for ever."""
        cfg = self.config
        limit, timeout = cfg.max_body_bytes, cfg.client_timeout_s
        keep = keep_head and ex.route is not None
        head = ex.head = bytearray()
        content = request.content
        loop = asyncio.get_running_loop()

        def stalled() -> None:
            got = f"{ex.req_bytes} of {request.content_length} bytes" if request.content_length is not None \
                else f"{ex.req_bytes} bytes"
            ex.body_problem = (408, CLIENT_TIMEOUT, f"the client sent no byte of its request body for "
                               f"{timeout:g} s ({got} came)")
            content.set_exception(BodyProblem())

        async def gen():
            while True:
                timer = loop.call_later(timeout, stalled)      # a timer per read: no task, no wait_for
                try:
                    chunk = await content.readany()
                finally:
                    timer.cancel()
                if not chunk:
                    return
                ex.req_bytes += len(chunk)
                if ex.req_bytes > limit:
                    ex.body_problem = (413, BODY_TOO_LARGE, f"request body is over the limit of {limit} bytes")
                    raise BodyProblem()
                if keep and len(head) < REQUEST_PARSE_BYTES:
                    head.extend(chunk[:REQUEST_PARSE_BYTES - len(head)])
                yield chunk
        return gen()

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse, ex: _Exchange
                     ) -> web.StreamResponse:
        if upstream.status < 200:
            # 101 Switching Protocols (or another 1xx as the final answer): what follows is not HTTP, and
            # the proxy forwards HTTP only (it drops Upgrade); relayed, it would leave the client mid-protocol.
            return self._fail(ex, 502, UPSTREAM_ERROR, f"upstream answered {upstream.status} "
                              f"{upstream.reason or ''}: protocol upgrades and informational answers are not "
                              "forwarded", close=True)
        ex.status = upstream.status
        headers = _strip(upstream.headers, HOP_BY_HOP)
        resp = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
        if upstream.headers.get("Transfer-Encoding", "").lower().endswith("chunked"):
            ex.spent = True                           # llama-server closes it right after the answer
            self.connector.spend(ex.connection)
        feed = None
        if ex.route is not None:
            key, tracked = ex.key, ex.tracked

            def on_first_token(t_ns: int) -> None:
                self.ledger.first_token(key, t_ns)
                tracked.first_token(t_ns)
            ex.reader = BodyReader(upstream.headers.get("Content-Type", ""),
                                   upstream.headers.get("Content-Encoding", ""), ex.route.body_kind,
                                   on_first_token=on_first_token)
            feed = ex.reader.feed
        await resp.prepare(request)
        relays = self._relays
        relays[id(ex)] = (upstream, request, ex)
        try:
            # per chunk: a write; feed keeps the chunk and reads the one before (stream.py)
            async for chunk in upstream.content.iter_any():
                now = time.time_ns()
                await resp.write(chunk)
                ex.resp_bytes += len(chunk)
                if feed is not None:
                    feed(chunk, now)
            ex.upstream_done = True
        except CLIENT_RESET as e:
            if type(e) is not ConnectionResetError or request.transport is None or request.transport.is_closing():
                if ex.outcome == COMPLETE:          # else the watch cut it, and said why
                    ex.outcome = ex.error_type = CLIENT_GONE
                    ex.error_message = "the client hung up"
                return resp
            raise
        except asyncio.TimeoutError:
            self._cut(request, ex, UPSTREAM_TIMEOUT,
                      f"upstream went silent for {self.config.upstream_timeout_s:g} s mid-answer")
            return resp
        except (aiohttp.ClientError, OSError, *HTTP_PARSE_ERRORS) as e:
            self._cut(request, ex, UPSTREAM_ERROR, f"upstream failed mid-answer: {type(e).__name__}: "
                      f"{' '.join(str(e).split())}")
            return resp
        finally:
            relays.pop(id(ex), None)
        try:
            await resp.write_eof()
        except CLIENT_RESET:
            ex.outcome = ex.error_type = CLIENT_GONE
        return resp

    def _cut(self, request: web.Request, ex: _Exchange, outcome: str, message: str) -> None:
        """The answer started and cannot be completed: drop the client connection so the client sees
        a truncated body rather than a clean end."""
        ex.outcome = ex.error_type = outcome
        ex.error_message = redact.text(message)
        if request.transport is not None:
            request.transport.abort() if hasattr(request.transport, "abort") else request.transport.close()

    def _fail(self, ex: _Exchange, code: int, outcome: str, message: str, close: bool = False) -> web.Response:
        """An answer of the proxy's own; `message` goes to the client and the span, made safe (the
        upstream's credentials, a peer's text: telemetry.redact)."""
        message = redact.text(message)
        ex.outcome, ex.status, ex.error_type, ex.error_message = outcome, code, outcome, message
        if ex.ledger_open:
            self.ledger.forget(ex.key)
            ex.ledger_open = False
        resp = web.Response(status=code, body=_error_body(code, message), content_type="application/json")
        if close:
            resp.force_close()
        return resp

    def _plain_error(self, code: int, message: str) -> web.Response:
        resp = web.Response(status=code, body=_error_body(code, message, "invalid_request_error"),
                            content_type="application/json")
        resp.force_close()
        return resp

    # -- spans and metrics --------------------------------------------------------------------
    def _start_span(self, request: web.Request, ex: _Exchange, parent, carrier=None) -> Any:
        cfg = self.config
        attrs = {
            "http.request.method": request.method,
            "url.scheme": "http",           # the proxy listens on plain HTTP only
            "url.path": redact.printable(redact.cut(request.path)),
            "server.address": cfg.listen_host,
            "server.port": self.port or cfg.listen_port,
            "network.protocol.version": f"{request.version.major}.{request.version.minor}",
            "gpu_census.proxy.upstream": self.upstream_shown,
        }
        if request.remote:
            attrs["client.address"] = request.remote
        if request.query_string:
            attrs["url.query"] = redact.printable(redact.cut(redact.query(request.query_string)))
        if ex.route is not None:
            # the request lifecycle: its span, the in-flight counter, later the GenAI metrics
            attrs["gen_ai.provider.name"] = ex.route.provider
            who = tenant_of.of_headers(request.headers if carrier is None else carrier, self.tenant_source)
            ex.tracked = self.telemetry.start(start_ns=ex.start_ns, operation=ex.route.operation,
                                              span_name=ex.route.operation, parent=parent, attributes=attrs,
                                              tenant=who)
            return ex.tracked.span
        route = http_route(request.path, cfg.api_prefix)
        name = request.method
        if route is not None:
            attrs["http.route"] = route
            name = f"{request.method} {route}"
        return self.telemetry.tracer.start_span(name, context=parent, kind=SpanKind.SERVER, start_time=ex.start_ns,
                                                attributes=redact.attributes(attrs))

    def _finish(self, ex: _Exchange, end_ns: int) -> None:
        """The answer is over (its last byte is with the client). Now: the ledger learns the end (for
        GPU attribution) and the in-flight counter drops. The rest (reading the kept chunks, the request
        body, span attributes, histograms) follows FINISH_AFTER_S later in a task, off the moment when
        streams end together and their clients' next requests arrive; the span ends after the GPU wait."""
        if ex.span is None and ex.route is None:      # untraced (health checks): nothing to record
            return
        fut = None
        try:
            if ex.ledger_open and not (ex.reader is not None and ex.reader.deferred):   # else in _complete
                if ex.reader is not None and ex.reader.facts.first_token_ns is None:
                    ex.reader.catch_up()          # the ledger splits prefill from decode at it
                fut = self.ledger.close(ex.key, end_ns)
            if ex.route is not None:
                first = ex.reader.facts.first_token_ns if ex.reader is not None else None
                self.served.append((ex.start_ns, end_ns, first))
            if ex.tracked is not None:
                ex.tracked.served()
        except Exception as e:      # telemetry must never break the proxy
            self._telemetry_failed(e)
        task = asyncio.get_running_loop().create_task(self._complete(ex, end_ns, fut))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    async def _complete(self, ex: _Exchange, end_ns: int, fut) -> None:
        if not self._stopping:
            await asyncio.sleep(FINISH_AFTER_S)
        cost, attrs, outcome = None, {}, (None, None)
        try:
            if ex.head and (ex.body_encoding or len(ex.head) > HEAVY_BYTES):    # inflating or a large parse
                ex.request_fields = await asyncio.to_thread(parse_request_body, bytes(ex.head), ex.body_encoding)
                ex.head = b""
            reader = ex.reader
            if reader is not None and reader.heavy:
                # a compressed or large answer: inflating and reading it can take seconds, on a thread
                try:
                    await asyncio.to_thread(reader.close, end_ns)
                finally:
                    if reader.deferred and ex.ledger_open:     # its first token is known only now
                        if reader.facts.first_token_ns is not None:
                            self.ledger.first_token(ex.key, reader.facts.first_token_ns)
                        fut = self.ledger.close(ex.key, end_ns)
            try:
                attrs, outcome = self._record(ex, end_ns)
            except Exception as e:      # telemetry must never break the proxy; the GPU cost still comes
                self._telemetry_failed(e)
            if fut is not None:
                cost = await fut
        except Exception as e:
            self._telemetry_failed(e)
        finally:
            if ex.tracked is not None:
                output_tokens, error = outcome
                ex.tracked.finish(end_ns, cost=cost, attributes=attrs, output_tokens=output_tokens, error_type=error)
            elif ex.span is not None:
                ex.span.set_attributes(redact.attributes(attrs))
                ex.span.end(end_time=end_ns)

    def _telemetry_failed(self, e: Exception) -> None:
        # what failed may quote a client's or the upstream's text: the client log bounds and escapes it
        self.client_log.warning("span", f"could not finish the span of a request: {type(e).__name__}: {e}")
        log.debug("span failure", exc_info=e)

    def _record(self, ex: _Exchange, end_ns: int):
        """What the answer said: (span attributes, (output tokens for TPOT, error type)). The span's
        name and error status are set here; the request lifecycle does the rest."""
        facts = ex.reader.close(end_ns) if ex.reader is not None else None
        if ex.head:
            ex.request_fields = parse_request_body(bytes(ex.head), ex.body_encoding)
        span = ex.span
        model = ex.request_fields.get("model") if isinstance(ex.request_fields.get("model"), str) else None
        if model is None and facts is not None and facts.model:
            model = facts.model
        model = redact.printable(redact.cut(model, MODEL_NAME_LIMIT)) if model else None
        attrs: Dict[str, Any] = {"gpu_census.proxy.outcome": ex.outcome,
                                 "http.request.body.size": ex.req_bytes,
                                 "http.response.body.size": ex.resp_bytes}
        if ex.status is not None:
            attrs["http.response.status_code"] = ex.status
        if ex.retried:
            attrs["gpu_census.proxy.upstream_retried"] = True
        if ex.route is not None:
            # the proxy's own id of the exchange (the answer's id, where it has one, is gen_ai.response.id)
            attrs["gpu_census.proxy.request.id"] = ex.key
            if model:
                attrs["gen_ai.request.model"] = model
            for field in ("max_tokens", "temperature", "top_p", "seed"):
                if field in ex.request_fields:
                    attrs[f"gen_ai.request.{field}"] = ex.request_fields[field]
            if "stream" in ex.request_fields:
                attrs["gpu_census.proxy.request.stream"] = ex.request_fields["stream"]
            if facts is not None:
                if facts.first_token_ns is not None and ex.tracked is not None:
                    ex.tracked.first_token(facts.first_token_ns)
                attrs.update(spanattrs.fact_attributes(facts))
            if model:
                span.update_name(f"{ex.route.operation} {model}")
        error = ex.error_type
        if error is None and ex.status is not None and ex.status >= 500:
            error = str(ex.status)
        if error is not None:
            attrs["error.type"] = error
            span.set_status(Status(StatusCode.ERROR, ex.error_message or f"HTTP {ex.status}"))
        elif facts is not None and facts.error and (ex.status or 0) < 400:
            # an error inside a 200 answer (llama-server streams errors as events); 4xx stays unset
            span.set_status(Status(StatusCode.ERROR, f"upstream error in the answer: {redact.text(facts.error, 200)}"))
        ok = ex.outcome == COMPLETE and ex.status is not None and ex.status < 400
        output_tokens = spanattrs.output_tokens(facts) if facts is not None and ok else None
        return attrs, (output_tokens, error)


def _default_source(config: ProxyConfig) -> Optional[CensusSource]:
    """The census folder to read, or None when there is none to read (spans say no_census).
    The default folder is read only when it is private and ours, as `run` requires: segments
    another user planted there would pass for the server's."""
    from pathlib import Path

    from otel_gpu_census.census import folder
    named = bool(config.census_dir)
    path = Path(config.census_dir) if named else folder.default_census_dir()
    shown = folder.show_path(path)
    try:
        if not named and os.path.lexists(path):
            folder.check_private_dir(path, follow=folder.named_census_dir())
        if not path.is_dir():
            if named:
                log.warning("census folder %s does not exist (yet): it is read once it does", shown)
                return CensusSource(str(path), config.upstream_pid)
            return None
        if not os.access(path, os.R_OK | os.X_OK):
            log.warning("census folder %s is not readable: spans carry no GPU cost", shown)
            return None
    except folder.CensusDirError as e:
        log.warning("%s; it is not read, so spans carry no GPU cost (name it with --dir to read it "
                    "anyway)", e)
        return None
    except OSError as e:
        log.warning("census folder %s cannot be read (%s): spans carry no GPU cost", shown, e.strerror)
        return None
    return CensusSource(str(path), config.upstream_pid)
