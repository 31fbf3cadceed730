"""Synthetic serving runs for the diagnosis tests: the CUPTI records a server's GPU would produce
while it serves a closed loop of clients, and the request log its clients would write.

Times are CUPTI ns; the segment maps them to wall time with clock_ref_gpu_ns = GPU0 and
clock_ref_wall_ns = WALL0 (``clocks``), so the log's wall times line up exactly. The "GPU" steps
every ``step_ns`` while any request is in flight: a kernel of ``kernel_ns``, then one logits copy
device-to-host for the requests decoding (a row of ``logits_bytes`` each), as llama-server copies
a batch's logits. Optional per request, right after it arrives: a state save (``save_bytes``
device-to-host in ``save_copies`` pageable copies: llama-server's prompt cache saving the slot it
takes) and a weight upload (``htod_bytes`` host-to-device, pinned); during its prompt steps,
``checkpoints`` context checkpoints of ``checkpoint_bytes`` each (a hybrid model's recurrent state).

``model_load`` is a server's start-up before that: weights copied in, a warm-up, then a pause.
``counted_at_calls`` turns a census read from such records into what the default census (the
library preloaded, copies counted at their calls) would have: the same counts and bytes, no copy time.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

MS = 1_000_000
MB_ = 1_000_000
S = 1_000_000_000
GPU0 = 5_000 * S            # CUPTI clock at the reference point
WALL0 = 1_764_400_000 * S   # the wall clock read with it


def to_wall(gpu_ns: int) -> int:
    return gpu_ns - GPU0 + WALL0


@dataclass
class Serving:
    records: list = field(default_factory=list)
    log: List[Tuple[int, int, int]] = field(default_factory=list)   # (start, end, first token), wall ns

    def log_lines(self) -> List[str]:
        return [json.dumps({"start_time_unix_nano": s, "end_time_unix_nano": e, "first_token_time_unix_nano": f})
                for s, e, f in self.log]

    def write_log(self, path) -> str:
        path.write_text("\n".join(self.log_lines()) + "\n")
        return str(path)


def serve(rec, clients: int = 1, requests: int = 8, start_ns: int = GPU0 + S, step_ns: int = 10 * MS,
          kernel_ns: int = 8 * MS, prefill_steps: int = 10, tokens: int = 64, gap_ns: int = 2 * MS,
          logits_bytes: int = 513_000, logits_mem: str = "pageable", save_bytes: int = 0, save_copies: int = 64,
          htod_bytes: int = 0, htod_chunk: int = 40 * MB_, stagger_ns: Optional[int] = None,
          checkpoints: int = 0, checkpoint_bytes: int = 0, checkpoint_copies: int = 72) -> Serving:
    """A closed loop: each client sends its next request `gap_ns` after its last one ended."""
    out = Serving()
    length = (prefill_steps + tokens) * step_ns
    stagger = step_ns * 3 + 1 * MS if stagger_ns is None else stagger_ns
    reqs = []   # (start, end, decode_from) in CUPTI ns
    per_client = [requests // clients + (1 if c < requests % clients else 0) for c in range(clients)]
    for c, n in enumerate(per_client):
        t = start_ns + c * stagger
        for _ in range(n):
            reqs.append((t, t + length, t + prefill_steps * step_ns))
            t += length + gap_ns
    reqs.sort()
    corr = 1
    def state(t: int, nbytes: int, copies: int) -> int:
        nonlocal corr
        each = nbytes // copies
        for i in range(copies):
            n = each + (nbytes - each * copies if i == 0 else 0)
            d = max(1, n // 10)        # 10 GB/s = 10 bytes/ns
            out.records.append(rec.memcpy("dtoh", n, t, t + d, src="device", dst="pageable", corr=corr))
            corr += 1
            t += d
        return t

    for s, e, first in reqs:
        out.log.append((to_wall(s), to_wall(e), to_wall(first)))
        t = s + 2 * MS
        if save_bytes:
            t = state(t, save_bytes, save_copies)
        for k in range(checkpoints):
            state(s + (k + 1) * (first - s) // (checkpoints + 1), checkpoint_bytes, checkpoint_copies)
        left = htod_bytes
        while left > 0:
            n = min(htod_chunk, left)
            d = max(1, n // 25)            # 25 GB/s pinned
            out.records.append(rec.memcpy("htod", n, t, t + d, src="pinned", dst="device", corr=corr))
            corr += 1
            t += d
            left -= n
    lo, hi = min(r[0] for r in reqs), max(r[1] for r in reqs)
    t = lo
    while t < hi:
        live = [r for r in reqs if r[0] <= t < r[1]]
        if live:
            out.records.append(rec.kernel(t, t + kernel_ns, corr=corr))
            corr += 1
            decoding = sum(1 for r in live if t >= r[2])
            if decoding and logits_bytes:
                n = logits_bytes * decoding
                c0 = t + kernel_ns
                out.records.append(rec.memcpy("dtoh", n, c0, c0 + max(1, n // 20), src="device", dst=logits_mem,
                                              corr=corr))
                corr += 1
        t += step_ns
    return out



def clocks(wall_start_ns: int = WALL0, wall_update_ns: int = WALL0 + 600 * S):
    """An edit(seg) for SegmentWriter.segment: the clock reference this module's times assume."""
    def edit(seg):
        seg.clock_ref_gpu_ns, seg.clock_ref_wall_ns = GPU0, WALL0
        seg.wall_start_ns, seg.wall_update_ns = wall_start_ns, wall_update_ns
    return edit


def model_load(rec, n: int = 300, each: int = 50 * MB_, start: int = GPU0 + S // 2, mem: str = "pageable",
               pause_ns: int = 500 * MS) -> Tuple[list, int]:
    """A server's start-up: n host->device copies of `each` bytes back to back (the weights), a warm-up
    step (a kernel and a logits copy), then `pause_ns` of nothing. (records, when serving may start)."""
    out, t = [], start
    for i in range(n):
        d = each // 5
        out.append(rec.memcpy("htod", each, t, t + d, src=mem, dst="device", corr=100_000 + i))
        t += d
    out.append(rec.kernel(t, t + 5 * MS, corr=200_000))
    out.append(rec.memcpy("dtoh", 513_000, t + 5 * MS, t + 6 * MS, src="device", dst="pageable", corr=200_001))
    return out, t + 6 * MS + pause_ns


def counted_at_calls(c):
    """The census `c` as the default census would have written it: every launch, copy and memset counted
    at its call by the library preloaded, kernel time from event pairs (here: every kernel's own, as
    a sample of one), no copy or memset time, no busy time."""
    import dataclasses as dc

    from otel_gpu_census.census import KERNELS_COUNTED, CopyTable, KernelTracing, Stat

    def untimed(st):
        return Stat(st.count, st.bytes, 0)

    devices = {k: dc.replace(d, copies=CopyTable({key: untimed(st) for key, st in d.copies.cells.items()}),
                             memset=untimed(d.memset), busy_ns=0, eager_launches=d.kernel_count,
                             eager_traced=d.kernel_count, eager_traced_ns=d.kernel_ns)
               for k, d in c.devices.items()}
    # a window's sample: the kernels launched in it, with the part of their time that fell inside it; the rest of
    # a kernel's time, in the windows after, stays their measured time
    windows = [dc.replace(w, copies={k: untimed(st) for k, st in w.copies.items()}, memset=untimed(w.memset),
                          eager_launches=w.kernel_count, eager_traced=w.kernel_count,
                          eager_traced_ns=w.kernel_ns if w.kernel_count else 0)
               for w in c.windows]
    kernels = KernelTracing(mode=KERNELS_COUNTED, preloaded=True, events=True, events_every_eager=1,
                            events_every_graph=1)
    return dc.replace(c, devices=devices, windows=windows, kernels=kernels)


# llama-server's saves as a GPU showed them: the dense 8B's prompt cache saves ~225 MB a request
# in 48 pageable copies; the hybrid's ~185 MB (147.5 MiB of recurrent state, the attention KV) and two
# context checkpoints of the recurrent state during its prompt (~155 MB each, one copy per tensor).
DENSE = dict(save_bytes=225 * MB_, save_copies=48)
HYBRID = dict(save_bytes=185 * MB_, save_copies=80, checkpoints=2, checkpoint_bytes=155 * MB_, checkpoint_copies=72)


def llama_run(rec, save: dict, clients: int) -> Tuple[Serving, list]:
    """A llama-server's run: start-up (weights, warm-up, a pause), then a closed loop of `clients` clients
    (16 and more: slower, fuller steps) with `save` (DENSE, HYBRID or {}). (serving, start-up records)."""
    load, start = model_load(rec)
    kw = dict(requests=8) if clients == 1 else dict(requests=2 * clients, step_ns=40 * MS, kernel_ns=30 * MS,
                                                     stagger_ns=150 * MS)
    return serve(rec, clients=clients, start_ns=start, **kw, **save), load
