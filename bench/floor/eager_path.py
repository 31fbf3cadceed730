"""What the preloaded census adds to one eager cuLaunchKernel, on a CPU (bench/floor/eager_path.c against the mock
driver, native/tests/mock_cuda.c), per census mode, with every counting mode's segment checked against the launches
made.

    PYTHONPATH=src python bench/floor/eager_path.py [--lib libotel_gpu_census.so] [--build DIR] [--n 2000000]
        [--rounds 7] [--reps 3] [--modes plain,preload,paused,off,events0,events] [--threads 1] [--out FILE]

Each mode runs in its own process, REPS processes a mode, modes rotated; a process times ROUNDS rounds of N launches
through the census's wrapper and N straight to the mock (alternating), so `added` (wrapped - direct, per round) is
what the wrapper costs in that mode, the mock's own launch (~85 ns, two mutex pairs and four clock reads) taken out.
Modes:
    plain     no census at all: wrapped and direct are the same function (the method's own zero)
    preload   the census preloaded, never initialised: the wrapper only passes the call on
    paused    OTEL_GPU_CENSUS_ACTIVITY=events, OTEL_GPU_CENSUS_START=paused: initialised, counting nothing
    off       OTEL_GPU_CENSUS_ACTIVITY=off: every launch counted, no durations
    events0   ACTIVITY=events, EVENT_EVERY=0: counted, each launch asks whether it is sampled, none is
    events    ACTIVITY=events, the defaults (EVENT_EVERY=128/1, gated): counted, ~1/128 get an event pair (the
              mock's; the flusher reads pairs every 20 ms, so at the mock's launch rate most samples find the
              pool full: `missed`, the cheap way out)
Exactness: in off, events0 and events the segment's eager launches (device 0's, and the windows' sum) equal the
wrapped calls that succeeded, none lost, every window inside the process's life; paused counts none. And placement
(--placement K, ACTIVITY=off, once): K bursts of 50 launches, each at a known phase of its own 20 ms window of the census
clock (its first and last ms included), must each be in that window of the segment, no launch elsewhere.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

MODES = {
    "plain": (False, False, {}),
    "preload": (True, False, {}),
    "paused": (True, True, {"OTEL_GPU_CENSUS_ACTIVITY": "events", "OTEL_GPU_CENSUS_START": "paused"}),
    "off": (True, True, {"OTEL_GPU_CENSUS_ACTIVITY": "off"}),
    "events0": (True, True, {"OTEL_GPU_CENSUS_ACTIVITY": "events", "OTEL_GPU_CENSUS_EVENT_EVERY": "0"}),
    "events": (True, True, {"OTEL_GPU_CENSUS_ACTIVITY": "events"}),
}
COUNTING = ("off", "events0", "events")


def build(build_dir: Path, lib: str | None) -> tuple[str, str, str]:
    """(census library, mock libcuda.so.1, eager_path): the library built from native/ unless given."""
    cc = os.environ.get("CC", "cc")
    build_dir.mkdir(parents=True, exist_ok=True)
    if not lib:
        subprocess.run(["make", "-s", "-C", str(REPO / "native"), f"BUILD={build_dir / 'native'}",
                        f"PYTHON={sys.executable}"], check=True)
        lib = str(build_dir / "native" / "libotel_gpu_census.so")
    mock = build_dir / "mock" / "libcuda.so.1"
    mock.parent.mkdir(exist_ok=True)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-Wl,-soname,libcuda.so.1",
                    str(REPO / "native" / "tests" / "mock_cuda.c"), "-o", str(mock)], check=True)
    subprocess.run(["make", "-s", "-C", str(REPO / "bench" / "floor"), "eager_path", f"BUILD={build_dir}"], check=True,
                   stdout=subprocess.DEVNULL)
    return lib, str(mock), str(build_dir / "eager_path")


def census_of(census_dir: Path) -> dict | None:
    """The process's segment as the reader sees it (None: no segment)."""
    from otel_gpu_census.census.reader import read_segment
    segs = sorted(census_dir.glob("*.seg"))
    if not segs:
        return None
    p = read_segment(str(segs[0]))
    lo = p.wall_start_ns - 20_000_000 - p.clock_ref_wall_ns + p.clock_ref_gpu_ns
    hi = p.wall_update_ns + 20_000_000 - p.clock_ref_wall_ns + p.clock_ref_gpu_ns
    dev = p.devices.get(0)   # a census that counted nothing has no device
    return {"segments": len(segs), "eager_launches": dev.eager_launches if dev else 0,
            "window_launches": sum(w.eager_launches for w in p.windows),
            "windows_outside": sum(1 for w in p.windows if w.eager_launches and not lo <= w.start_ns < hi),
            "launches_lost": p.launches_lost, "state": p.state_name,
            "events_timed": p.kernels.events_timed, "events_missed": p.kernels.events_missed}


def run_one(mode: str, lib: str, mock: str, prog: str, n: int, rounds: int, threads: int, work: Path) -> dict:
    preload, init, env_add = MODES[mode]
    census_dir = work / "census"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_GPU_CENSUS_") and k != "LD_PRELOAD"}
    env.update(OTEL_GPU_CENSUS_DIR=str(census_dir), **env_add)
    if preload:
        env["LD_PRELOAD"] = lib
    cmd = [prog, mock, str(n), str(rounds), "--threads", str(threads)] + (["--init"] if init else [])
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        return {"mode": mode, "error": f"rc {p.returncode}: {p.stderr[-2000:]}"}
    res = json.loads(next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))[7:])
    res.update(mode=mode, stderr=p.stderr, census=census_of(census_dir))
    res["added_ns"] = [w - d for w, d in zip(res["wrapped_ns"], res["direct_ns"])]
    res["exact"] = exact(mode, res)
    return res


def exact(mode: str, res: dict) -> bool:
    """The census counted exactly what the mode must: every wrapped launch that succeeded, or none."""
    c = res["census"]
    if mode in COUNTING:
        return bool(c) and c["segments"] == 1 and c["eager_launches"] == res["wrapped_ok"] == \
            c["window_launches"] and c["launches_lost"] == 0 and c["windows_outside"] == 0
    if mode == "paused":
        return c is None or (c["eager_launches"] == 0 and c["window_launches"] == 0)
    return c is None and res["wrapped_is_direct"] == (mode == "plain")


def run_placement(lib: str, mock: str, prog: str, bursts: int, work: Path, burst: int = 50) -> dict:
    """K bursts at known phases of their windows (eager_path.c --placement): each in its window of the segment."""
    work.mkdir(parents=True, exist_ok=True)
    census_dir = work / "census"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_GPU_CENSUS_") and k != "LD_PRELOAD"}
    env.update(OTEL_GPU_CENSUS_DIR=str(census_dir), OTEL_GPU_CENSUS_ACTIVITY="off", LD_PRELOAD=lib)
    p = subprocess.run([prog, mock, str(burst), "1", "--init", "--placement", str(bursts)], env=env,
                       capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        return {"bursts": bursts, "exact": False, "error": f"rc {p.returncode}: {p.stderr[-2000:]}"}
    res = json.loads(next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))[7:])
    from otel_gpu_census.census.reader import read_segment
    segs = sorted(census_dir.glob("*.seg"))
    want: dict[int, int] = {}
    for idx, n in res["placement"]:
        want[idx] = want.get(idx, 0) + n
    got = {}
    if len(segs) == 1:
        seg = read_segment(str(segs[0]))
        got = {w.start_ns // (w.end_ns - w.start_ns): w.eager_launches for w in seg.windows if w.eager_launches}
    misplaced = sorted(set(want) ^ set(got) | {i for i in want if got.get(i) != want[i]})
    return {"bursts": bursts, "burst": burst, "exact": len(segs) == 1 and got == want, "misplaced_windows": misplaced,
            "stderr": p.stderr}


def summarise(runs: list[dict]) -> dict:
    out = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        ok = [r for r in runs if r["mode"] == mode and "error" not in r]
        added = [a for r in ok for a in r["added_ns"]]
        per_proc = [statistics.median(r["added_ns"]) for r in ok]
        q = statistics.quantiles(added, n=4) if len(added) > 1 else added * 3
        out[mode] = {
            "processes": len(ok), "errors": sum(1 for r in runs if r["mode"] == mode and "error" in r),
            "exact": all(r["exact"] for r in ok) and len(ok) > 0,
            "direct_ns": statistics.median([d for r in ok for d in r["direct_ns"]]) if ok else None,
            "wrapped_ns": statistics.median([w for r in ok for w in r["wrapped_ns"]]) if ok else None,
            "added_ns": statistics.median(added) if added else None,
            "added_p25_p75": [q[0], q[2]] if added else None,
            "added_min_max": [min(added), max(added)] if added else None,
            "added_per_process": per_proc,
        }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", help="libotel_gpu_census.so (default: built from native/ into --build)")
    ap.add_argument("--build", default=str(Path(tempfile.gettempdir()) / "eager-path-build"))
    ap.add_argument("--n", type=int, default=2_000_000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--placement", type=int, default=24, help="bursts of the placement check (0: none)")
    ap.add_argument("--out", help="write every run and the summary here (JSON)")
    a = ap.parse_args(argv)
    modes = a.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown modes {unknown}; known: {list(MODES)}")
    lib, mock, prog = build(Path(a.build), a.lib)
    runs = []
    with tempfile.TemporaryDirectory(prefix="eager-path-") as tmp:
        for rep in range(a.reps):
            for i in range(len(modes)):
                mode = modes[(i + rep) % len(modes)]   # rotated: no mode always first or last
                work = Path(tmp) / f"{mode}-{rep}"
                work.mkdir()
                runs.append(run_one(mode, lib, mock, prog, a.n, a.rounds, a.threads, work))
        placed = run_placement(lib, mock, prog, a.placement, Path(tmp) / "placement") if a.placement > 0 else None
    summary = summarise(runs)
    result = {"n": a.n, "rounds": a.rounds, "reps": a.reps, "threads": a.threads, "lib": lib, "summary": summary,
              "placement": placed, "runs": runs}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"{'mode':8} {'direct':>8} {'wrapped':>8} {'added':>7}  {'p25..p75':>13}  {'min..max':>13}  exact")
    for mode, s in summary.items():
        if s["added_ns"] is None:
            print(f"{mode:8} failed: {next(r['error'] for r in runs if r['mode'] == mode)}")
            continue
        print(f"{mode:8} {s['direct_ns']:8.1f} {s['wrapped_ns']:8.1f} {s['added_ns']:7.1f}  "
              f"{s['added_p25_p75'][0]:6.1f}..{s['added_p25_p75'][1]:<6.1f} "
              f"{s['added_min_max'][0]:6.1f}..{s['added_min_max'][1]:<6.1f} {s['exact']}")
    if placed:
        print(f"placement: {placed['bursts']} bursts, each in its window: {placed['exact']}"
              + (f" (misplaced: {placed.get('misplaced_windows') or placed.get('error')})" if not placed["exact"] else ""))
    print("RESULT " + json.dumps({"summary": summary, "placement": placed}))
    ok = all(s["exact"] and not s["errors"] for s in summary.values()) and (placed is None or placed["exact"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
