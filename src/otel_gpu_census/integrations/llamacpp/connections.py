"""The proxy's client connections: never more than its file descriptors allow, and what the event loop
reports about them as one short line.

A request in flight holds two descriptors (its client's connection and one to the upstream), so the
proxy serves at most ``(soft RLIMIT_NOFILE - FD_RESERVE) / 2`` client connections at once (`ulimit -n`
raises it) and opens at most as many upstream connections. A connection over the cap is answered
``503`` with ``Retry-After`` at once and closed: a client learns the proxy is busy instead of waiting in
the listen queue, and accept never fails for want of descriptors (when it does anyway, asyncio's
traceback per retry becomes one line, rate-limited by the caller).
"""
from __future__ import annotations

import asyncio
import collections
import errno
import json
import resource
from typing import Callable

from aiohttp import web

BACKLOG = 64             # the listen queue, and so the most connections asyncio accepts in one go
REFUSING_MAX = 64        # refused connections being closed at one time; past it one is dropped without a word
REFUSE_LINGER_S = 1.0    # how long a refused connection may take to send its request (then it is closed)
PENDING_S = 1.0          # an accepted connection not registered by then never will be (its accept failed)
# Descriptors kept out of the cap: the process's own (exporters, census files, the loop) and, at most, a
# burst being accepted and the refused connections being closed.
FD_RESERVE = 64 + BACKLOG + REFUSING_MAX
OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

_BODY = json.dumps({"error": {"code": 503, "message": "the proxy serves as many connections as its file "
                              "descriptors allow; try again", "type": "unavailable_error"}}).encode()
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(_BODY)) + _BODY


def descriptor_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


def connection_cap(limit: int = 0) -> int:
    """How many client connections the proxy serves at once under a descriptor limit (default: its own)."""
    return max(8, ((limit or descriptor_limit()) - FD_RESERVE) // 2)


class _Refused(asyncio.Protocol):
    """A connection over the cap: 503 and our side shut at once; closed when its request has come (and
    been dropped: a close with a request unread resets the connection, and the client never reads the
    503), when it closes, or after REFUSE_LINGER_S."""

    def __init__(self, site: "CappedSite"):
        self.site = site
        self.timer = None
        self.transport = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.site.refusing += 1
        if self.site.refusing > REFUSING_MAX:
            transport.abort()
            return
        try:
            transport.write(BUSY)
            if transport.can_write_eof():
                transport.write_eof()
        except OSError:               # it went already
            transport.abort()
            return
        self.timer = asyncio.get_running_loop().call_later(REFUSE_LINGER_S, transport.abort)

    def data_received(self, data: bytes) -> None:
        self.transport.close()

    def eof_received(self) -> bool:
        return False                  # close

    def connection_lost(self, exc) -> None:
        self.site.refusing -= 1
        if self.timer is not None:
            self.timer.cancel()


class CappedSite(web.TCPSite):
    """aiohttp's TCP site, serving at most `cap` connections at once; `on_refused(open)` is told of each
    connection refused."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, cap: int,
                 on_refused: Callable[[int], None]):
        super().__init__(runner, host, port, reuse_address=True)
        self.cap, self.on_refused, self.refusing = cap, on_refused, 0
        # connections accepted whose handler is not among the server's connections yet: (handler, deadline),
        # in accept order (the order asyncio runs their connection_made in)
        self.pending: collections.deque = collections.deque()

    async def start(self) -> None:
        await web.BaseSite.start(self)            # registers the site with its runner
        server = self._runner.server
        cap = self.cap
        loop = asyncio.get_running_loop()

        pending = self.pending

        def protocol() -> asyncio.Protocol:
            # asyncio accepts a burst of connections (up to the backlog) before their handlers'
            # connection_made runs (call_soon, after this), so the server's connections alone lag behind:
            # a handler counts as pending until it is among them, and never as both (counted twice, the
            # last of a burst that fits was refused).
            registered = getattr(server, "_connections", None)     # aiohttp's dict of handlers, else a copy
            if registered is None:
                registered = set(server.connections)
            now = loop.time()
            while pending and (pending[0][0] in registered or pending[0][1] < now):
                pending.popleft()
            n = len(registered) + len(pending)
            if n < cap:
                handler = server()
                pending.append((handler, now + PENDING_S))
                return handler
            self.on_refused(n)
            return _Refused(self)
        self._server = await loop.create_server(protocol, self._host, self._port, backlog=BACKLOG,
                                                reuse_address=True)
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port


def loop_error_line(context: dict) -> str:
    """One line for what the event loop reports (asyncio's own handler logs a traceback each time)."""
    exc = context.get("exception")
    if isinstance(exc, OSError) and exc.errno in OUT_OF_DESCRIPTORS:
        return (f"cannot accept connections: {exc.strerror} (descriptor limit {descriptor_limit()}; "
                "`ulimit -n` raises it); retrying")
    what = context.get("message") or "event loop error"
    if exc is not None:
        what = f"{what}: {type(exc).__name__}: {exc}"
    return what


TRIM_AFTER_CONNECTIONS = 64      # a burst at least this large gives its memory back once half of it has gone


class MemoryGiveBack:
    """Gives the heap memory of a burst of connections back to the system once they have gone.

    Each connection's buffers are freed when it closes, but glibc keeps freed blocks of a few hundred
    KiB in its heap, so a burst of hundreds of slow clients would leave the process that much larger
    for good. `seen(open_now)` is called periodically; when the connections open fell to half of their
    peak since the last give-back (a peak of TRIM_AFTER_CONNECTIONS or more), malloc_trim runs once."""

    def __init__(self):
        self.peak = 0
        try:
            import ctypes
            self._trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):      # not glibc: nothing to call
            self._trim = None

    def seen(self, open_now: int) -> bool:
        self.peak = max(self.peak, open_now)
        if self._trim is None or self.peak < TRIM_AFTER_CONNECTIONS or open_now > self.peak // 2:
            return False
        self.peak = open_now
        self._trim(0)
        return True
