"""An upstream server at the socket level, for the proxy's tests of upstreams that misbehave (broken
chunked encodings, answers that never end, connections reset): what a real HTTP server will not do."""
from __future__ import annotations

import socket
import threading
from typing import Callable, List


class SocketUpstream:
    """Listens on 127.0.0.1; each connection it accepts runs `handle(conn, i)` (i: its number, from 0) on a
    thread of its own, and is closed when that returns, or, with `keep_open`, only by close()."""

    def __init__(self, handle: Callable[[socket.socket, int], None], backlog: int = 16, keep_open: bool = False):
        self.handle, self.keep_open = handle, keep_open
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(backlog)
        self.port = self.srv.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.conns = 0                  # connections accepted
        self.closed = 0                 # ... and closed after their handle returned
        self._open: List[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.srv.accept()
            except OSError:
                return
            i, self.conns = self.conns, self.conns + 1
            if self.keep_open:
                self._open.append(c)
            threading.Thread(target=self._one, args=(c, i), daemon=True).start()

    def _one(self, c: socket.socket, i: int) -> None:
        try:
            self.handle(c, i)
        except OSError:
            pass
        finally:
            if not self.keep_open:
                self.closed += 1
                c.close()

    def close(self) -> None:
        self.srv.close()
        for c in self._open:
            c.close()
