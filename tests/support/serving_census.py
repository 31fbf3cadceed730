"""Synthetic serving runs for the diagnosis tests: the CUPTI records a server's GPU would produce
while it serves a closed loop of clients, and the request log its clients would write.

Times are CUPTI ns; the segment maps them to wall time with clock_ref_gpu_ns = GPU0 and
clock_ref_wall_ns = WALL0 (``clocks``), so the log's wall times line up exactly. The "GPU" steps
every ``step_ns`` while any request is in flight: a kernel of ``kernel_ns``, then, per request
decoding, a logits copy device-to-host. Optional per request, right after it arrives: a state save
(``save_bytes`` device-to-host in ``save_copies`` pageable copies) and a weight upload
(``htod_bytes`` host-to-device, pinned).
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
          htod_bytes: int = 0, htod_chunk: int = 40 * MB_, stagger_ns: Optional[int] = None) -> Serving:
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
    for s, e, first in reqs:
        out.log.append((to_wall(s), to_wall(e), to_wall(first)))
        t = s + 2 * MS
        if save_bytes:
            each = save_bytes // save_copies
            for i in range(save_copies):
                n = each + (save_bytes - each * save_copies if i == 0 else 0)
                d = max(1, n // 10)        # 10 GB/s = 10 bytes/ns
                out.records.append(rec.memcpy("dtoh", n, t, t + d, src="device", dst="pageable", corr=corr))
                corr += 1
                t += d
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
