"""Settling in a process of its own: the engine's loop keeps its GIL.

The split of every step among its requests, the spans, the metrics and their export are Python that,
in a thread inside the engine, holds the GIL the engine's loop needs: about a millisecond of CPU a
request, several per cent of a core at tens of requests a second. So by default an engine keeps
only what must happen on its own thread (step ids pushed and popped, the step's tokens, request
boundaries, all recorded as plain tuples) and a child process does the rest: it replays those records
into the same :class:`~otel_gpu_census.integrations.engine.steps.StepEngine` subclass, which reads the engine's
census segment, settles, writes the request log and exports, exactly as the thread did.

The engine side (:class:`Remote`): calls append one tuple to a deque (atomic under the GIL); a shipper
thread takes what is there every SHIP_PERIOD_S, pickles it (one pickle per batch, so a request id repeated
in every step is written once) and writes it, length-prefixed, to the child's stdin. Bounded: at most
MAX_EVENTS wait; beyond that they are dropped and counted (a request whose start was dropped gets no
span: counted as dropped). The child is started once, at the engine's first settling (its first step,
or its shutdown if requests came and no step ran); if it cannot start, the engine applies what it
recorded itself and settles in a thread as before (one log line). The child acknowledges on its stdout
how many requests it has settled and exported (a flush of its spans every ACK_PERIOD_S at most). If it dies, a new one takes over (at most MAX_RESTARTS times; one
log line each): the requests in flight are announced to it again, partial (the steps the dead one
knew are lost), and the requests that had ended and were not acknowledged are counted as dropped
(``gpu_census.requests.dropped``, the request log's summary), an upper bound: the dead child may have
exported some of them. After that the engine settles in a thread itself. The engine is never blocked.

The child (``python -m otel_gpu_census.integrations.engine.settle_process``, NICE steps nicer than the engine, whose
CPUs it shares): reads batches, applies them,
settles every settle period; the final settle, the request log's summary and the export flush come
when the engine's census has ended (``census=finish``: a stopping manager waits for that summary) and
again, for anything after it, when the engine says shutdown or its stdin closes (the engine exited or
was killed: what the census had counted is still settled). Then it exits.
Its stdin is a pipe only its parent holds, so the pickles it reads are the engine's own.
"""
from __future__ import annotations

import importlib
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from typing import List, Optional, Tuple

log = logging.getLogger("otel_gpu_census.engine")

SETTLE_ENV = "OTEL_GPU_CENSUS_SETTLE"     # process (default) | thread
SHIP_PERIOD_S = 0.1
MAX_EVENTS = 1_000_000
MAX_RESTARTS = 5
ACK_PERIOD_S = 1.0                  # the child exports and acknowledges what it settled at most this often
NICE = 10                           # the child's niceness over the engine's: on CPUs they share, the engine goes first
_HEADER = struct.Struct("<I")
_ACK = struct.Struct("<Q")          # the child's count of requests settled, cumulative
RESTARTED = ("its settling process was replaced while it was in flight: the steps before that are "
             "missing from its share")


def settle_mode(env=os.environ) -> str:
    """Where an engine settles: "process" (default) or "thread" (OTEL_GPU_CENSUS_SETTLE=thread)."""
    v = (env.get(SETTLE_ENV) or "process").strip().lower()
    if v not in ("process", "thread"):
        log.warning("otel-gpu-census: %s=%r is neither process nor thread; settling in a process", SETTLE_ENV, v)
        return "process"
    return v


class LedgerRecorder:
    """The StepLedger's engine-thread methods, recorded for the settling process instead of applied."""

    def __init__(self, remote: "Remote"):
        self._remote = remote
        self.read = None                     # where a ledger reads its census: the child's business

    def step_opened(self, *args, **kw):
        self._remote.record(("L", "step_opened", args, kw))

    def step_touched(self, *args):
        self._remote.record(("L", "step_touched", args, None))

    def step_claimed(self, *args):
        self._remote.record(("L", "step_claimed", args, None))

    def request_started(self, *args):
        self._remote.record(("L", "request_started", args, None))

    def first_token(self, *args):
        self._remote.record(("L", "first_token", args, None))

    def request_done(self, *args, **kw):
        self._remote.record(("L", "request_done", args, kw))

    def note(self, *args):
        self._remote.record(("L", "note", args, None))

    def set_shape(self, *args):
        self._remote.record_sticky(("L", "set_shape", args, None))

    def pending(self) -> int:                # the child knows; the engine waits for it instead
        return 0


class Remote:
    """The engine side: records, the shipper thread, the child process."""

    def __init__(self, engine, segment_path, period_s: Optional[float] = None):
        self._engine = engine
        self._segment_path = segment_path    # the engine's segment path now ("" until it exists)
        self._period = SHIP_PERIOD_S if period_s is None else period_s
        self._events: deque = deque()      # appended by the engine's thread, popped by the shipper
        self._lock = threading.Lock()        # the shipper and finish() take turns writing
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._sent_segment = ""
        self._sticky: dict = {}              # records every child must have first (shape, tagging, ranks): the last
                                             # of each kind
        self.dropped = 0                     # records dropped (MAX_EVENTS)
        self.dead = False
        self.closed = False
        self.ledger = LedgerRecorder(self)
        self.proc: Optional[subprocess.Popen] = None
        self._tried = False
        self.restarts = 0
        self._sent_done = 0                  # "done" records the current child took
        self._acked = 0                      # ... and requests it says it settled
        self._ack_buf = b""
        self._lost_unsent = 0                # requests dropped, not yet told to a child

    # -- the child --------------------------------------------------------------------------------
    def _start(self) -> Optional[subprocess.Popen]:
        env = {k: v for k, v in os.environ.items() if k != "CUDA_INJECTION64_PATH"}   # it has no GPU work
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cls = type(self._engine)
        try:
            hello = {"engine": f"{cls.__module__}:{cls.__qualname__}", "pid": os.getpid(),
                     "period_s": self._engine._period, "exports": self._engine.exports()}
            # a session of its own: a Ctrl-C or a stop sent to the engine's process group leaves it to
            # settle the engine's last requests (it ends when its stdin does)
            proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    env=env, close_fds=True, start_new_session=True)
            os.set_blocking(proc.stdout.fileno(), False)     # acknowledgements, read when there are any
        except Exception as e:
            log.warning("otel-gpu-census: no settling process (%s); settling in a thread of the engine", e)
            return None
        try:
            self._write(proc, [("hello", hello)])
        except Exception as e:
            log.warning("otel-gpu-census: the settling process did not take its first message (%s); settling in "
                        "a thread of the engine", e)
            _reap(proc)
            return None
        self._sent_done = self._acked = 0
        self._ack_buf = b""
        self._sent_segment = ""
        return proc

    # -- the engine's thread ------------------------------------------------------------------------
    def record(self, event: tuple) -> None:
        if self.closed:
            return
        if len(self._events) >= MAX_EVENTS:
            self.dropped += 1
            if event[0] == "start":          # that request will have no span
                self._lost_unsent += 1
            return
        self._events.append(event)

    def record_sticky(self, event: tuple) -> None:
        """A record every child needs (a new one gets the last of its kind again before anything else)."""
        self._sticky[event[:2] if event[0] in ("L", "call") else event[0]] = event
        self.record(event)

    def ensure(self) -> bool:
        """The child and the shipper running (started by the first call, from the engine's first
        settling: its subclass is set up by then). False: no child could start (settle in the engine)."""
        if not self._tried:
            self._tried = True
            self.proc = self._start()
        if self.proc is None:
            return False
        if self._thread is None and not self.closed:
            self._thread = threading.Thread(target=self._run, name="otel-gpu-census-ship", daemon=True)
            self._thread.start()
        return True

    def pending(self) -> bool:
        """Records wait and no child has been asked for yet."""
        return bool(self._events) and not self._tried

    def take_all(self) -> List[tuple]:
        """What was recorded and not sent (for the engine to apply itself when no child started)."""
        ev = self._events
        return [ev.popleft() for _ in range(len(ev))]

    # -- the shipper --------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self.closed and not self.dead:
            self._wake.wait(self._period)
            self._wake.clear()
            self.ship()

    def _take(self) -> List[tuple]:
        batch = self.take_all()              # (the engine may append meanwhile: those wait)
        seg = self._segment_path()
        if seg and seg != self._sent_segment:
            self._sent_segment = seg
            batch.insert(0, ("segment", seg))
        if self._lost_unsent:
            batch.append(("dropped", self._lost_unsent))
            self._lost_unsent = 0
        return batch

    def _read_acks(self) -> None:
        """The child's latest count of requests settled (what it wrote to its stdout so far)."""
        try:
            data = os.read(self.proc.stdout.fileno(), 1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except (OSError, ValueError, AttributeError):
            return
        buf = self._ack_buf + data
        whole = len(buf) - len(buf) % _ACK.size
        if whole:
            self._acked = _ACK.unpack_from(buf, whole - _ACK.size)[0]
        self._ack_buf = buf[whole:]

    def ship(self, extra: Tuple = ()) -> bool:
        """Send what was recorded (and `extra`); False once no child can take it."""
        with self._lock:
            if self.dead or self.proc is None:
                return False
            self._read_acks()
            batch = self._take() + list(extra)
            if not batch:
                return True
            while True:
                try:
                    self._write(self.proc, batch)
                except Exception as e:      # (a broken pipe, or closed under us: never the engine's problem)
                    last = [ev for ev in batch if ev[0] == "shutdown"]
                    batch = self._replace([ev for ev in batch if ev[0] != "shutdown"], e)
                    if batch is None:
                        return False
                    batch += last
                    continue
                self._sent_done += sum(1 for ev in batch if ev[0] == "done")
                return True

    def _replace(self, lost: List[tuple], err: Exception) -> Optional[List[tuple]]:
        """The child is gone: a new one, and what it must be sent first (None: no more children)."""
        self._read_acks()
        started = {ev[1] for ev in lost if ev[0] == "start"}
        dropped = max(0, self._sent_done - self._acked) + sum(1 for ev in lost if ev[0] == "done" and ev[1] not in started)
        dropped += sum(ev[1] for ev in lost if ev[0] == "dropped")
        old, self.proc = self.proc, None
        if old is not None:
            _reap(old)
        lost = [ev for ev in lost if ev[0] not in ("segment", "dropped")]
        work = self._engine.in_flight() or self._events or any(ev[0] != "tagging" for ev in lost)
        proc = self._start() if self.restarts < MAX_RESTARTS and not self.closed and work else None
        self._lost_unsent += dropped
        self._events.extendleft(reversed(lost))   # (the engine's thread appends on the other end)
        if proc is None:
            self.dead = True
            if work:
                log.warning("otel-gpu-census: the settling process is gone (%s) and no other takes over; the engine "
                            "settles its requests itself from now on", err)
            return None
        self.restarts += 1
        self.proc = proc
        out = self.take_over()
        log.warning("otel-gpu-census: the settling process is gone (%s); a new one takes over (%d of %d): %d requests "
                    "in flight are partial, %d that had ended may have no span (gpu_census.requests.dropped)",
                    err, self.restarts, MAX_RESTARTS, sum(1 for ev in out if ev[0] == "start" and ev[2].get("note") ==
                                                          RESTARTED), dropped)
        seg = self._segment_path()
        if seg:
            self._sent_segment = seg
            out.insert(0, ("segment", seg))
        return out

    def take_over(self) -> List[tuple]:
        """What a new settler (a new child, or the engine itself) is told, in order: what every settler
        needs, the requests the dead one followed (partial: the steps it knew are lost), the requests
        dropped, then everything not sent yet (a request started there is not partial)."""
        pending = self.take_all()
        if self.restarts == 0 and not self.dead:
            return pending                   # nobody settled before: everything is in `pending`
        unsent = {ev[1] for ev in pending if ev[0] == "start"}
        out = list(self._sticky.values())
        for key, start, first_ns in self._engine.in_flight():
            if key in unsent:
                continue
            out.append(("start", key, dict(start, note=RESTARTED)))
            if first_ns is not None:
                out.append(("first", key, first_ns, None))
        if self._lost_unsent:
            out.append(("dropped", self._lost_unsent))
            self._lost_unsent = 0
        return out + pending

    @staticmethod
    def _write(proc, batch) -> None:
        data = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
        proc.stdin.write(_HEADER.pack(len(data)) + data)
        proc.stdin.flush()

    # -- the end ------------------------------------------------------------------------------------
    def finish(self, timeout_s: float) -> bool:
        """Everything recorded, then shutdown; wait up to timeout_s for the child to settle, write its
        summary and flush its export. True when it did."""
        if self.closed:
            return True
        ok = self.ship((("shutdown", timeout_s, self.dropped),))
        self.closed = True
        self._wake.set()
        proc = self.proc
        if proc is None:
            return False
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("otel-gpu-census: the settling process is still flushing after %.1f s; leaving it to finish",
                        timeout_s)
            return False
        return ok and proc.returncode == 0


def _reap(proc) -> None:
    try:
        proc.kill()
        proc.wait(1)
    except Exception:
        pass


# -- the child ----------------------------------------------------------------------------------------

def _read_exact(fd: int, n: int) -> Optional[bytes]:
    parts, got = [], 0
    while got < n:
        b = os.read(fd, n - got)
        if not b:
            return None
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def apply(eng, event: tuple) -> Optional[tuple]:
    """One record from the engine, applied to this process's StepEngine; a shutdown is returned."""
    kind = event[0]
    if kind == "L":
        _, name, args, kw = event
        getattr(eng.ledger, name)(*args, **(kw or {}))
    elif kind == "start":
        eng.start_request(event[1], **event[2])
    elif kind == "first":
        eng.first_token(*event[1:])
    elif kind == "done":
        _, key, facts, error_type, awaiting, end_ns, note = event
        eng.request_done(key, facts, error_type, awaiting=awaiting, end_ns=end_ns, note=note)
    elif kind == "dropped":
        eng.dropped(event[1])
    elif kind == "tagging":
        eng.tagging = bool(event[1])
    elif kind == "segment":
        eng.settling_segment = event[1]
    elif kind == "call":                     # a subclass's own record (vLLM's ranks)
        getattr(eng, "remote_" + event[1])(*event[2])
    elif kind == "shutdown":
        return event
    return None


def _ack(fd: Optional[int], n: int) -> None:
    """Tell the engine how many requests this process has settled (never blocks; lost if it cannot)."""
    if fd is None:
        return
    try:
        os.write(fd, _ACK.pack(n))
    except OSError:
        pass


def serve(fd: int, ack_fd: Optional[int] = None) -> int:
    """The child's loop on `fd` (its stdin; acknowledgements to `ack_fd`). Returns its exit code."""
    first = _read_frame(fd)
    if not first or first[0][0] != "hello":
        log.warning("otel-gpu-census settling process: no hello from the engine; exiting")
        return 2
    hello = first[0][1]
    eng = _engine_from(hello)
    period = float(hello.get("period_s") or 0.25)
    engine_pid = int(hello["pid"])
    shutdown = None
    acked = 0
    next_ack = 0.0
    next_settle = time.monotonic() + period
    try:
        while True:
            wait = max(0.0, next_settle - time.monotonic())
            ready, _, _ = select.select([fd], [], [], wait)
            if ready:
                batch = _read_frame(fd)
                if batch is None:            # the engine exited or was killed: settle what was counted
                    break
                for ev in batch:
                    shutdown = apply(eng, ev) or shutdown
                if shutdown:
                    break
            elif os.getppid() != engine_pid:   # the engine is gone though a child of its holds our pipe
                break
            if time.monotonic() >= next_settle:
                next_settle = time.monotonic() + period
                eng.settle_once()            # (census=finish: the final outputs; the engine may go on a little)
                if eng.settled_requests != acked and time.monotonic() >= next_ack:
                    # acknowledged once exported: a child killed after this loses none of them
                    next_ack = time.monotonic() + ACK_PERIOD_S
                    n = eng.settled_requests
                    if eng.flush_spans(ACK_PERIOD_S):
                        acked = n
                        _ack(ack_fd, acked)
                    else:                    # the collector is slow or away: flush (and block) less often
                        next_ack += 9 * ACK_PERIOD_S
    except Exception:
        log.exception("otel-gpu-census settling process: failed; settling what there is")
    timeout_s = float(shutdown[1]) if shutdown else 3.0
    if shutdown and shutdown[2]:
        log.warning("otel-gpu-census: %d engine records were dropped (the settling process fell behind)", shutdown[2])
    summarised_before = eng.summarised()     # (census=finish: the final outputs were written already)
    eng.close_open()                         # what the engine never said ended: it has
    eng.settle_to_end(timeout_s)
    if summarised_before:                    # requests that ended after that summary
        if eng.has_scheduler:
            eng.settle(final=True)
        eng.flush_telemetry(timeout_s)
    if eng.flush_spans(timeout_s):
        _ack(ack_fd, eng.settled_requests)
    return 0


def _read_frame(fd: int) -> Optional[List[tuple]]:
    head = _read_exact(fd, _HEADER.size)
    if head is None:
        return None
    data = _read_exact(fd, _HEADER.unpack(head)[0])
    return None if data is None else pickle.loads(data)


def _engine_from(hello: dict):
    mod, _, cls = hello["engine"].partition(":")
    eng = getattr(importlib.import_module(mod), cls)(settle_in="child")
    eng.census_pid = int(hello["pid"])
    if not hello.get("exports", True):
        eng.export_nothing()
    return eng


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    # it inherits the engine's CPUs (a taskset, a container's cpuset): there its settling, which can wait a settle
    # period, must not take a CPU the engine's loop is ready to run on. Before any thread starts: threads inherit it.
    try:
        os.nice(NICE)
    except OSError:
        pass
    # a stop sent to this process too: the engine's shutdown (or its death, our stdin's end) tells
    # this process to finish, so that the last requests are still settled
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # stdout is the acknowledgements' pipe: keep it to ourselves (a console exporter prints to fd 1)
    ack_fd = os.dup(1)
    os.dup2(2, 1)
    os.set_blocking(ack_fd, False)
    return serve(sys.stdin.fileno(), ack_fd)


if __name__ == "__main__":
    sys.exit(main())
