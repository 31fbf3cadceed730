"""Connections to the upstream: kept alive where that is safe, checked before reuse, retried once.

A new connection costs a request a few hundred µs of the proxy's time before the upstream sees a
byte, so connections are pooled (``--upstream-keepalive``, below llama-server's own 5 s keep-alive, so
the proxy lets go first). Three rules keep reuse from ever costing a request:

- A connection that carried a chunked (streamed) answer is not reused: llama-server closes it some
  tens of µs after the answer's last byte without announcing it (its headers say ``Keep-Alive``), and
  a request sent in between would meet the close.
- An idle connection is checked before it is handed out: it has nothing to say between answers, so
  if it is readable the upstream closed it (or sent stray bytes); it is dropped and another taken.
- A request on a reused connection that the upstream resets before any answer (RST: the upstream's
  socket was closed before our request arrived, or with it unread) is sent once more, on a new
  connection, when its body was read whole (up to 1 MiB with a Content-Length; a streamed body is
  gone). A clean close (FIN) is not retried: the upstream may have read the request and started it.
"""
from __future__ import annotations

import contextvars
import errno
import select
import weakref
from typing import Any, Optional

import aiohttp

RESET_ERRNOS = frozenset({errno.ECONNRESET, errno.EPIPE, errno.ECONNABORTED})


class Attempt:
    """What the connector did for one try of one request (shared through a context variable)."""

    __slots__ = ("fresh_only", "reused", "protocol")

    def __init__(self, fresh_only: bool = False):
        self.fresh_only = fresh_only      # a retry: only a new connection will do
        self.reused = False               # the connection came from the pool
        self.protocol: Any = None


ATTEMPT: "contextvars.ContextVar[Optional[Attempt]]" = contextvars.ContextVar("gc_upstream_attempt",
                                                                                 default=None)


def _closed_while_idle(protocol) -> bool:
    """Whether an idle pooled connection has been closed (or written to) by the upstream."""
    transport = protocol.transport
    if transport is None or transport.is_closing():
        return True
    sock = transport.get_extra_info("socket")
    if sock is None or not hasattr(select, "poll"):
        return False
    try:
        p = select.poll()
        p.register(sock.fileno(), select.POLLIN | select.POLLPRI)
        return bool(p.poll(0))
    except (OSError, ValueError):
        return True


class _Reuse:
    """Mixin for an aiohttp connector: marks reused connections, drops dead or spent ones."""

    read_bytes = 0                        # the most one read of a connection takes (0: asyncio's own)

    def _reuse_init(self) -> None:
        self._handed_out: "weakref.WeakSet" = weakref.WeakSet()
        self._spent: "weakref.WeakSet" = weakref.WeakSet()

    def spend(self, protocol) -> None:
        """This connection must not carry another request (it carried a streamed answer)."""
        if protocol is not None:
            self._spent.add(protocol)

    async def connect(self, req, traces, timeout):
        attempt = ATTEMPT.get()
        while True:      # ends: every pass takes one connection out of a finite pool, then a new one
            conn = await super().connect(req, traces, timeout)
            proto = conn.protocol
            if proto is None:
                return conn
            if proto not in self._handed_out:
                self._handed_out.add(proto)
                bound_reads(proto.transport, self.read_bytes)
                if attempt is not None:
                    attempt.protocol = proto
                return conn
            if (attempt is None or not attempt.fresh_only) and proto not in self._spent \
                    and not _closed_while_idle(proto):
                if attempt is not None:
                    attempt.reused, attempt.protocol = True, proto
                return conn
            conn.close()


class TCPConnector(_Reuse, aiohttp.TCPConnector):
    def __init__(self, **kw):
        super().__init__(**kw)
        self._reuse_init()


class UnixConnector(_Reuse, aiohttp.UnixConnector):
    def __init__(self, path: str, **kw):
        super().__init__(path=path, **kw)
        self._reuse_init()


def bound_reads(transport, read_bytes: int) -> None:
    """Make one read of `transport` take at most `read_bytes`: asyncio's socket transports read up to
    256 KiB at a time, whatever the reader's own buffer limit, and a connection whose reader is held
    (its client reads nothing) would hold that much again each time its reader takes a chunk."""
    if read_bytes > 0 and transport is not None and isinstance(getattr(transport, "max_size", None), int):
        transport.max_size = min(transport.max_size, read_bytes)


def connector(unix_socket: Optional[str], keepalive_s: float, limit: int = 0, read_bytes: int = 0):
    """A connector for the upstream; keepalive_s 0: a new connection for every request; at most `limit`
    connections at once (0: no limit), a request past it waits for one; reads of at most `read_bytes`."""
    kw: dict = {"limit": limit}
    if keepalive_s > 0:
        kw["keepalive_timeout"] = keepalive_s
    else:
        kw["force_close"] = True
    c = UnixConnector(unix_socket, **kw) if unix_socket is not None else TCPConnector(**kw)
    c.read_bytes = read_bytes
    return c


def retryable(attempt: Attempt, error: BaseException, body_buffered: bool) -> bool:
    """Whether a request that failed before any answer may be sent again, on a new connection: only
    on a reused connection, with the body at hand, after a reset (the upstream's socket was closed
    when the request reached it, or aiohttp found the transport closing before writing)."""
    if not (attempt.reused and body_buffered) or isinstance(error, aiohttp.ClientConnectorError):
        return False
    if isinstance(error, ConnectionResetError):
        return True
    return isinstance(error, OSError) and error.errno in RESET_ERRNOS
