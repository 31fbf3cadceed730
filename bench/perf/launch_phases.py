"""The census's price a launch inside one process: its modes switched between rounds through the control file.

Processes side by side cannot resolve it: a C process's own launch time moved ±12 % from one process to the next
on the GPU machine, more than the tens of ns the census adds a launch. Here one launch_price process
(bench/floor/launch_price.cu --serve), preloaded with the census and pinned to one core, runs round after round;
between rounds the census is switched (control_phases.Phases: `off`, its wrappers passing every call through,
or `events`, counting and pairing as it runs by default), in ABBA order. Each round pair's events figure minus
its off figure (`events-off`, ns a call) is what the census adds, with no process-to-process spread in it. A flusher wake (1 s) separates rounds, so that the event-pair pool (256 a context) is read
between them and no sampled launch goes unpaired for want of a pair.

At the end, what the census counted must be exactly what the process did in its counting rounds and warm-up
(counting from its start): a paused census counts nothing, a counting one every launch and copy.

    python3 bench/perf/launch_phases.py --binary /tmp/floor/launch_price --rounds 40 --out phases.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "server"))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ratio_interval import interval  # noqa: E402  (bench/ratio_interval.py: one seeded bootstrap)
KEYS = ("eager_ns", "graph_issue_ns", "graph_ns", "copy_pair_ns", "control_ms")
MODES = ("off", "events")
WARMUP_ROUNDS = 2         # launch_price's own, before READY, the census counting from the process's start


def census_fields(segment: str) -> dict:
    """What the census counted (its segment, read after its final flush): counts and bytes, and the event pairs'
    accounting (timed, missed, failed, graph launches untimed, eager pairs and their ns, idle, idle ns)."""
    from otel_gpu_census.census.reader import read_segment
    c = read_segment(segment)
    dv = c.devices[0]
    return {"eager_launches": dv.eager_launches, "kernel_count": dv.kernel_count,
            "graph_launches": dv.graph_launches, "graph_kernel_count": dv.graph_kernel_count,
            "htod_pinned": [dv.copies.get("htod", "pinned").count, dv.copies.get("htod", "pinned").bytes],
            "dtoh_pinned": [dv.copies.get("dtoh", "pinned").count, dv.copies.get("dtoh", "pinned").bytes],
            "events": [c.kernels.events_timed, c.kernels.events_missed, c.kernels.events_failed,
                       c.kernels.graph_untimed, dv.eager_traced, dv.eager_traced_ns, c.kernels.events_idle,
                       c.kernels.events_idle_ns],
            "kernel_time_ns": c.kernel_time(dv).ns, "launches_lost": c.launches_lost, "calls_lost": c.calls_lost}


def census_did(did: dict, c: dict) -> bool:
    """The census counted exactly what launch_price did: its eager launches, graph launches and their kernels,
    and its pinned copies each way (count and bytes)."""
    return (c.get("eager_launches") == did["eager_launches"] and c.get("graph_launches") == did["graph_launches"]
            and c.get("graph_kernel_count") == did["graph_kernels"]
            and c.get("kernel_count") == did["eager_launches"] + did["graph_kernels"]
            and list(c.get("htod_pinned", ())) == did["htod_pinned"] and list(c.get("dtoh_pinned", ())) == did["dtoh_pinned"])


def abba(rounds: int):
    """Mode order round by round: off, events, events, off, off, events, ... (each mode first as often)."""
    return [MODES if i % 2 == 0 else MODES[::-1] for i in range(rounds)]


def paired(rows: list, key: str) -> list:
    """Per round pair (both modes ran in it): events' figure minus off's, in the figure's own unit."""
    return [r["events"][key] - r["off"][key] for r in rows if "events" in r and "off" in r]


def summarise(rows: list) -> dict:
    out: dict = {"rounds": len(rows)}
    for k in KEYS:
        d = paired(rows, k)
        if not d:
            continue
        mean, (lo, hi) = statistics.fmean(d), interval(d, stat=statistics.fmean)   # bootstrap, fixed seed
        off = statistics.median(r["off"][k] for r in rows if "off" in r and "events" in r)
        out[f"events-off {k}"] = {"median": round(statistics.median(d), 2), "mean": round(mean, 2),
                                  "mean_95": [round(lo, 2), round(hi, 2)], "off_median": round(off, 2),
                                  "ratio": round((off + statistics.median(d)) / off, 4) if off else None}
    return out


def expected(did: dict, counting_rounds: int, total_rounds: int) -> dict:
    """What the census should have counted: the process's work (DID, warm-up included) times the share of
    its rounds that ran counting (every round does the same work)."""
    runs = total_rounds + WARMUP_ROUNDS
    share = counting_rounds + WARMUP_ROUNDS
    return {k: ([v[0] * share // runs, v[1] * share // runs] if isinstance(v, list) else v * share // runs)
            for k, v in did.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--binary", default="/tmp/floor/launch_price")
    ap.add_argument("--rounds", type=int, default=40, help="round pairs (each mode once a pair)")
    ap.add_argument("--adds", type=int, default=20000)
    ap.add_argument("--replays", type=int, default=64, help="graph launches a round (each one paired: <= ~90 "
                                                            "with 1/128 of the adds, for the 256-pair pool)")
    ap.add_argument("--pairs", type=int, default=1000)
    ap.add_argument("--core", type=int, default=3)
    ap.add_argument("--event-every", default="", help="OTEL_GPU_CENSUS_EVENT_EVERY (default: the census's, 128/1)")
    ap.add_argument("--settle-s", type=float, default=1.1, help="pause after each switch: one flusher wake")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    lib = os.environ.get("OTEL_GPU_CENSUS_LIB")
    if not lib:
        raise SystemExit("OTEL_GPU_CENSUS_LIB: the built injector (bench/device/run.sh setup sets it)")
    from control_phases import Phases
    from otel_gpu_census.census.reader import segment_paths
    res: dict = {"args": vars(a)}
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, CUDA_INJECTION64_PATH=lib, LD_PRELOAD=lib, OTEL_GPU_CENSUS_DIR=d,
                   OTEL_GPU_CENSUS_COLLECTOR="default")
        if a.event_every:
            env["OTEL_GPU_CENSUS_EVENT_EVERY"] = a.event_every
        p = subprocess.Popen(["taskset", "-c", str(a.core), a.binary, "--serve", str(a.adds), str(a.replays),
                              str(a.pairs)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        rows, counting, total = [], 0, 0
        try:
            if p.stdout.readline().strip() != "READY":
                raise SystemExit(f"launch_price did not start (rc {p.poll()})")
            ph = Phases(d)
            for order in abba(a.rounds):
                row: dict = {"order": list(order)}
                for mode in order:
                    if not ph.set(mode):
                        raise SystemExit(f"the census did not switch to {mode}")
                    time.sleep(a.settle_s)
                    p.stdin.write("round\n")
                    p.stdin.flush()
                    line = p.stdout.readline()
                    if not line.startswith("RESULT "):
                        raise SystemExit(f"launch_price stopped: {line!r} (rc {p.poll()})")
                    row[mode] = json.loads(line[7:])
                    total += 1
                    counting += mode != "off"
                rows.append(row)
            ph.set("events")          # its last words counted from here on: nothing more is launched
            p.stdin.close()
            did_line = p.stdout.readline()
            p.wait(60)
        finally:
            if p.poll() is None:
                p.kill()
        did = json.loads(did_line[4:]) if did_line.startswith("DID ") else {}
        segs = segment_paths(d)
        census = census_fields(str(segs[0])) if len(segs) == 1 else {"segments": len(segs)}
    want = expected(did, counting, total) if did else {}
    # "counted exactly what launch_price did", against the counting rounds' share of it
    exact = bool(want) and census_did(want, census)
    res.update(rows=rows, did=did, census=census, counted_expected=want, exact=exact, summary=summarise(rows))
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps({**res["summary"], "exact": res["exact"], "events": census.get("events")}, indent=1))
    return 0 if res["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
