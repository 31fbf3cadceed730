"""The client side of the proxy's tests: a raw socket read until the proxy closes it, and the spans an
in-thread proxy (proxy_process.in_thread_proxies) has ended, waited for."""
from __future__ import annotations

import socket
import time


def read_until_closed(s: socket.socket, timeout: float) -> bytes:
    """All the bytes until the peer closes; an AssertionError if it is still open after `timeout` s of silence."""
    s.settimeout(timeout)
    out = b""
    while True:
        try:
            d = s.recv(65536)
        except socket.timeout:
            raise AssertionError(f"still open after {timeout} s; got {out[:200]!r}")
        if not d:
            return out
        out += d


def send_raw(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """`data` as it is, to the proxy on `port`, and all it answers until it closes the connection."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        s.sendall(data)
        return read_until_closed(s, timeout)
    finally:
        s.close()


def finished_spans(h, n: int = 1, timeout: float = 10.0):
    """The in-thread proxy `h`'s finished spans, once there are at least `n`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = h.spans.get_finished_spans()
        if len(got) >= n:
            return got
        time.sleep(0.02)
    raise AssertionError(f"{len(h.spans.get_finished_spans())} spans, wanted {n}")


def last_span(h, timeout: float = 10.0):
    """The latest span `h` has finished, once there is one."""
    return finished_spans(h, 1, timeout)[-1]
