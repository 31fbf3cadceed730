#!/usr/bin/env python3
"""A user's own serving loop in torch, whose host buffers are the user's: the report's pageable-copy case.

  python bench/server/own_program.py --request-log requests.jsonl [--requests 24] [--steps 32] [--pinned]

Start-up: 1 GB of weights copied in from pageable host memory, a warm-up, then a pause (a server waiting
for its first request). Serving: `--requests` requests of `--steps` decode steps each, every step copying its
logits (16 x 32,000 float32, 2 MB) to the host: with `.cpu()` into fresh pageable memory (what the report
should name, with pin_memory as the cure), or with `--pinned` into one page-locked buffer (what it should
not). Writes the requests as JSON lines of start_time_unix_nano / end_time_unix_nano.
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--pinned", action="store_true", help="copy the logits into a page-locked buffer")
    ap.add_argument("--request-log", required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    weights = [torch.randn(4096, 4096, dtype=torch.float16) for _ in range(32)]      # pageable, 1 GB
    head_w = torch.randn(4096, 32000, dtype=torch.float16)
    layers = [w.to(dev) for w in weights]                                              # copied in back to back
    head = head_w.to(dev)
    x = torch.randn(16, 4096, device=dev, dtype=torch.float16)
    for m in layers[:2]:
        x = torch.tanh(x @ m)
    torch.cuda.synchronize()
    time.sleep(0.6)                                                                    # waiting for requests
    out = torch.empty(16, 32000, dtype=torch.float32, pin_memory=True) if args.pinned else None
    log = []
    for _ in range(args.requests):
        start = time.time_ns()
        for _ in range(args.steps):
            h = x
            for m in layers[:8]:
                h = torch.tanh(h @ m)
            logits = (h @ head).float()
            if args.pinned:
                out.copy_(logits, non_blocking=True)
                torch.cuda.current_stream().synchronize()
            else:
                logits.cpu()
            time.sleep(0.004)                                                          # the client's turn
        log.append({"start_time_unix_nano": start, "end_time_unix_nano": time.time_ns()})
    with open(args.request_log, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in log))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
