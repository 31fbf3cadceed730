#!/usr/bin/env python3
"""Reliability suite: the census must never take a process down, whatever happens around it.

  python bench/reliability/run.py --out DIR --server llama-server [--vocab VOCAB.gguf | --model tiny.gguf]
         [--budget-s 500] [--cycles 200] [--parallel 4] [--only a,b] [--skip a,b]

Cases (each bounded in time; one failing case is recorded and the rest still run):
  sigterm_midload   SIGTERM llama-server under load: bounded exit, segment complete, readers cope
  sigkill_midload   SIGKILL under load: segment of a dead process, readers and `report` cope
  fork_no_exec      fork after CUDA init, child exits (atexit and _exit): parent unaffected, no junk
  exit_no_sync      a CUDA program returns (or _exits) with a kernel and a copy still in flight
  short_lived       many short CUDA processes, census vs plain: time added, segment files left
  dir_removed       census folder deleted while a process writes its segment
  dir_unusable      census folder a file / read-only / full (tmpfs; needs root, else skipped)
  reader_killed     reader processes SIGKILLed while reading a live segment
  torch_profiler    torch.profiler inside a censused process: both tools' counts, and recovery
  server_cycles     start -> load -> stop of llama-server (tiny model) under the census, as many
                    as the budget allows up to --cycles, several in parallel; a reader polls every
                    segment during load; greedy answers are compared with a run without the census

Writes <date>-<device>-reliability.json and reliability.md (a table) into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "server"))
import benchlib as bl  # noqa: E402

CASES = ("sigterm_midload", "sigkill_midload", "fork_no_exec", "exit_no_sync", "short_lived",
         "dir_removed", "dir_unusable", "reader_killed", "torch_profiler", "server_cycles")
ANSWER_PROMPT = list(range(1000, 1064))


def result(case: str, checks: Dict[str, Optional[bool]], details: Dict[str, Any]) -> Dict[str, Any]:
    """passed: no check failed and at least one ran (None = could not be checked here)."""
    ran = [v for v in checks.values() if v is not None]
    return {"case": case, "passed": bool(ran) and all(ran), "checks": checks, "details": details}


class Suite:
    def __init__(self, a: argparse.Namespace, log: bl.Log, work: Path):
        self.a, self.log, self.work = a, log, work
        self.lib = bl.census_lib(a.census_lib)
        self.prog: Optional[Path] = None
        self.prog_why = ""
        self.pkg, self.pkg_why = bl.import_package()
        self.port = a.port
        self.port_lock = threading.Lock()
        # Without a GPU the injector is loaded but never starts (no CUDA): no segment to check.
        self.segments_expected = a.expect_segments != "no"

    # ---- helpers -------------------------------------------------------------------------------

    def next_port(self) -> int:
        with self.port_lock:
            self.port += 1
            if self.port > self.a.port + 2000:
                self.port = self.a.port
            return self.port

    def time_left(self) -> float:
        return self.a.budget_s - self.log.elapsed()

    def build_prog(self) -> None:
        out = self.work / "cuda_prog"
        d = bl.run(["nvcc", "-O2", f"-arch=sm_{self.a.arch}", "-o", str(out), str(HERE / "cuda_prog.cu")],
                   timeout=120)
        if d.ok and out.is_file():
            self.prog = out
            self.log(f"built cuda_prog in {d.wall_s:.1f} s")
        else:
            self.prog_why = f"nvcc failed (rc={d.rc}): {d.tail(400)}"
            self.log(self.prog_why)

    def census_env(self, cdir: Optional[Path], **extra: str) -> Dict[str, str]:
        env = bl.injected_env(self.lib, cdir, **extra)
        return env

    def run_prog(self, args: List[str], env: Dict[str, str], timeout: float = 30) -> Dict[str, Any]:
        d = bl.run([str(self.prog)] + args, timeout=timeout, env=env)
        out: Dict[str, Any] = {"rc": d.rc, "wall_s": round(d.wall_s, 3), "timed_out": d.timed_out}
        line = next((ln for ln in d.out.splitlines() if ln.startswith("{")), None)
        if line:
            out["printed"] = json.loads(line)
        census_lines = [ln for ln in d.err.splitlines() if "census" in ln.lower()]
        if census_lines:
            out["census_log"] = census_lines[-3:]
        if d.rc != 0:
            out["stderr"] = d.tail(400)
        return out

    def read_dir(self, cdir: Path) -> Dict[str, Any]:
        seg = bl.read_segments(cdir)
        if "error" in seg:
            return {"error": seg["error"]}
        return {"segments": [bl.census_summary(p) for p in seg["processes"]], "errors": seg["errors"],
                "files": len(bl.segment_files(cdir))}

    def report_cli(self, cdir: Path) -> Dict[str, Any]:
        """`otel-gpu-census report DIR --json` must exit 0 with JSON, whatever the segments hold."""
        env = bl.plain_env()
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(bl.REPO / "src"), env.get("PYTHONPATH")]))
        d = bl.run([bl.python(), "-m", "otel_gpu_census.cli", "report", str(cdir), "--json"], timeout=60, env=env)
        try:
            json.loads(d.out)
            parsed = True
        except ValueError:
            parsed = False
        return {"rc": d.rc, "json": parsed, "traceback": "Traceback" in d.err, "stderr": d.tail(300)}

    # ---- llama-server ------------------------------------------------------------------------------

    def start_server(self, census: bool, cdir: Path, logf: Path):
        port = self.next_port()
        cmd = [self.a.server, "-m", str(self.a.model), "-ngl", "99", "-np", "4", "-c", "4096",
               "--host", "127.0.0.1", "--port", str(port)]
        env = self.census_env(cdir) if census else bl.plain_env()
        f = open(logf, "w")
        try:
            p = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            f.close()
        return p, f"http://127.0.0.1:{port}"

    @staticmethod
    def wait_health(url: str, p: subprocess.Popen, timeout: float) -> Optional[float]:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if p.poll() is not None:
                return None
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        return None

    @staticmethod
    def answer(url: str) -> Dict[str, Any]:
        """A greedy completion of a fixed prompt: must be the same with and without the census."""
        body = json.dumps({"prompt": ANSWER_PROMPT, "n_predict": 16, "temperature": 0, "seed": 1,
                           "ignore_eos": True, "return_tokens": True, "cache_prompt": False}).encode()
        req = urllib.request.Request(url + "/completion", data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                j = json.loads(r.read())
            return {"tokens": j.get("tokens") or [], "content": j.get("content", "")}
        except (urllib.error.URLError, OSError, ValueError) as e:
            return {"error": f"{type(e).__name__}: {e}"}

    def poll_reader(self, cdir: Path, stop: threading.Event, stats: Dict[str, Any]) -> None:
        """Read every segment of cdir in a loop; totals must never go backwards."""
        if self.pkg is None:
            stats["skipped"] = self.pkg_why
            return
        from otel_gpu_census.census import reader
        last: Dict[str, tuple] = {}
        while not stop.is_set():
            for path in bl.segment_files(cdir):
                try:
                    pc = reader.read_segment(path)
                except reader.SegmentError as e:
                    if not e.unpublished:
                        stats["errors"] = stats.get("errors", 0) + 1
                        stats["last_error"] = str(e)[:200]
                    continue
                except Exception as e:
                    stats["crashes"] = stats.get("crashes", 0) + 1
                    stats["last_error"] = f"{type(e).__name__}: {e}"[:200]
                    continue
                stats["reads"] = stats.get("reads", 0) + 1
                stats["torn"] = stats.get("torn", 0) + int(pc.torn)
                t = pc.totals()
                now = (pc.records, t.kernel_count, t.copies.get("dtoh").bytes, t.kernel_ns)
                prev = last.get(str(path))
                if prev and any(n < p for n, p in zip(now, prev)):
                    stats["backwards"] = stats.get("backwards", 0) + 1
                last[str(path)] = now
            stop.wait(0.1)   # ~6 ms a read: four pollers must leave the load clients their GIL

    def server_cycle(self, i: int, census: bool, baseline: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        cdir = self.work / "cycles" / f"c{i:04d}"
        logf = self.work / "cycles" / f"c{i:04d}.log"
        logf.parent.mkdir(parents=True, exist_ok=True)
        rec: Dict[str, Any] = {"i": i, "census": census}
        t0 = time.monotonic()
        p, url = self.start_server(census, cdir, logf)
        stop = threading.Event()
        stats: Dict[str, Any] = {}
        poller = threading.Thread(target=self.poll_reader, args=(cdir, stop, stats), daemon=True)
        try:
            up = self.wait_health(url, p, self.a.startup_timeout)
            if up is None:
                rec["failure"] = "crash" if p.poll() is not None else "hang"
                rec["why"] = f"no /health (rc={p.poll()})"
                return rec
            rec["startup_s"] = round(up, 2)
            rec["answer"] = self.answer(url)
            if census:
                poller.start()
            import load
            ld = load.run_load(url, clients=4, requests=8, prompt_tokens=256, n_predict=16, seed=i,
                               request_timeout_s=30, total_timeout_s=60)
            rec["load_ok"] = ld["ok"]
            if ld["ok"] != ld["requests"]:
                rec["failure"] = "load"
                rec["why"] = "; ".join(ld.get("first_errors", []))[:300]
        finally:
            rec["stop"] = bl.stop(p, signal.SIGTERM, grace_s=15)
            stop.set()
            if poller.is_alive():
                poller.join(5)
        rec["cycle_s"] = round(time.monotonic() - t0, 2)
        if rec["stop"].get("hang"):
            rec["failure"] = "hang"
            rec["why"] = "SIGTERM did not stop the server within 15 s"
        elif rec["stop"]["rc"] != 0 and "failure" not in rec:
            rec["failure"] = "crash"
            rec["why"] = f"exit status {rec['stop']['rc']} after SIGTERM"
        if baseline and "tokens" in rec.get("answer", {}) and "failure" not in rec:
            if rec["answer"]["tokens"] != baseline["tokens"] or rec["answer"]["content"] != baseline["content"]:
                rec["failure"] = "answer"
                rec["why"] = "greedy answer differs from the run without the census"
        if census:
            rec["reader"] = stats
            if stats.get("backwards") or stats.get("crashes"):
                rec.setdefault("failure", "reader")
                rec.setdefault("why", f"reader: {stats}")
            seg = self.read_dir(cdir)
            segs = seg.get("segments", [])
            rec["segment"] = segs[0] if len(segs) == 1 else {"count": len(segs), **{k: v for k, v in seg.items() if k != "segments"}}
            if "error" not in seg and "failure" not in rec and self.segments_expected:
                s0 = segs[0] if segs else None
                if not s0 or s0["state"] != "exited" or s0["torn"] or not s0["kernels"]:
                    rec["failure"] = "segment"
                    rec["why"] = f"segment after SIGTERM: {s0 and {k: s0[k] for k in ('state', 'torn', 'kernels')}}"
        if census and "failure" not in rec:
            rec.pop("answer", None)   # kept only where it explains a failure, and for the baselines
        if "failure" not in rec:
            bl.rm_tree(cdir)
            logf.unlink(missing_ok=True)
        return rec

    # ---- cases -------------------------------------------------------------------------------------

    def signal_run(self, name: str, k: int, sig: int, census: bool) -> Dict[str, Any]:
        """Start a server, load it, send sig after 1-2 s; what happened and what the segment says.

        llama-server waits for open streams after SIGTERM, so clients give up after 6 s: the exit
        then depends on the server and the census, not on how patient the clients are."""
        tag = f"{name}-{k}{'' if census else '-plain'}"
        cdir = self.work / tag
        p, url = self.start_server(census, cdir, self.work / f"{tag}.log")
        rec: Dict[str, Any] = {"census": census}
        th = None
        try:
            up = self.wait_health(url, p, self.a.startup_timeout)
            if up is None:
                rec["error"] = f"server did not come up (rc={p.poll()})"
                return rec
            import load
            box: Dict[str, Any] = {}
            th = threading.Thread(target=lambda: box.update(load.run_load(
                url, clients=8, requests=48, prompt_tokens=512, n_predict=384, seed=k,
                request_timeout_s=6, total_timeout_s=40)), daemon=True)
            th.start()
            time.sleep(1.0 + random.random())
        finally:
            rec["stop"] = bl.stop(p, sig, grace_s=20)
        if th is not None:
            th.join(45)
            rec["load_finished"] = not th.is_alive()
            rec["requests_ok_before_signal"] = box.get("ok")
        if census:
            rec["segments"] = self.read_dir(cdir)
            rec["report"] = self.report_cli(cdir) if self.pkg else {"skipped": self.pkg_why}
        return rec

    def case_signal_midload(self, sig: int) -> Dict[str, Any]:
        name = "sigterm_midload" if sig == signal.SIGTERM else "sigkill_midload"
        control = self.signal_run(name, 0, sig, census=False)
        runs = [self.signal_run(name, k, sig, census=True) for k in range(self.a.signal_repeats)]
        up = [r for r in runs if "error" not in r]
        checks: Dict[str, Optional[bool]] = {
            "server_came_up": len(up) == len(runs) and "error" not in control,
            "bounded_exit": all(not r["stop"].get("hang") for r in up),
            # Whatever llama-server itself does on this signal, the census must not change it.
            "exit_as_without_census": all(r["stop"].get("rc") == control.get("stop", {}).get("rc")
                                          and bool(r["stop"].get("hang")) == bool(control.get("stop", {}).get("hang"))
                                          for r in up),
        }
        segs = [r["segments"] for r in up]
        if not segs or all("error" in s for s in segs):
            checks["segment_readable"] = None
        else:
            one = [s.get("segments", []) for s in segs]
            checks["segment_readable"] = all(len(x) == 1 and not s.get("errors") for x, s in zip(one, segs))
            if sig == signal.SIGTERM:
                checks["segment_complete"] = all(x and x[0]["state"] == "exited" for x in one)
            else:
                checks["segment_marked_dead"] = all(x and not x[0]["alive"] for x in one)
            checks["kernels_counted"] = all(x and x[0]["kernels"] > 0 for x in one)
        if self.pkg:
            checks["report_cli_ok"] = all(r["report"].get("rc") == 0 and r["report"].get("json")
                                          and not r["report"].get("traceback") for r in up)
        return result(name, checks, {"control_without_census": control, "runs": runs})

    def case_fork(self) -> Dict[str, Any]:
        runs = {}
        for how in ("sys", "os"):
            cdir = self.work / f"fork-{how}"
            d = bl.run([bl.python(), str(HERE / "workloads.py"), "fork", "--child-exit", how],
                       timeout=120, env=self.census_env(cdir))
            r: Dict[str, Any] = {"rc": d.rc, "timed_out": d.timed_out, "wall_s": round(d.wall_s, 2)}
            line = next((ln for ln in d.out.splitlines() if ln.startswith("RESULT ")), None)
            r["result"] = json.loads(line[7:]) if line else None
            if not line:
                r["stderr"] = d.tail(500)
            r["census"] = self.read_dir(cdir)
            runs[how] = r
        checks: Dict[str, Optional[bool]] = {}
        for how, r in runs.items():
            res = r["result"] or {}
            checks[f"{how}_exit_parent_ok"] = r["rc"] == 0 and bool(res.get("value_ok"))
            checks[f"{how}_exit_child_ok"] = res.get("child_rc") == 0 and not res.get("child_hang")
            c = r["census"]
            if "error" in c:
                checks[f"{how}_exit_segments"] = None
                continue
            segs = c["segments"]
            parent = [s for s in segs if s["pid"] == res.get("parent_pid")]
            others = [s for s in segs if s["pid"] != res.get("parent_pid")]
            # The child may own a segment only under its own pid; the parent's must be whole.
            checks[f"{how}_exit_segments"] = (len(parent) == 1 and parent[0]["state"] == "exited"
                                              and parent[0]["kernels"] >= res.get("adds", 1)
                                              and all(s["pid"] == res.get("child_pid") for s in others))
        return result("fork_no_exec", checks, runs)

    def case_exit_no_sync(self) -> Dict[str, Any]:
        if not self.prog:
            return result("exit_no_sync", {"built": None}, {"skipped": self.prog_why})
        runs = {}
        for mode in ("nosync", "nosync_exit"):
            cdir = self.work / f"exit-{mode}"
            r = self.run_prog([mode], self.census_env(cdir), timeout=30)
            r["census"] = self.read_dir(cdir)
            runs[mode] = r
        checks: Dict[str, Optional[bool]] = {
            "returns_cleanly": runs["nosync"]["rc"] == 0 and not runs["nosync"]["timed_out"],
            "_exit_cleanly": runs["nosync_exit"]["rc"] == 0 and not runs["nosync_exit"]["timed_out"],
        }
        c = runs["nosync"]["census"]
        if "error" not in c:
            segs = c["segments"]
            # A plain return runs atexit: the final flush must have marked the totals complete.
            checks["return_segment_exited"] = len(segs) == 1 and segs[0]["state"] == "exited"
        c = runs["nosync_exit"]["census"]
        if "error" not in c:
            segs = c["segments"]
            # _exit skips the flush: no segment, or one readers see as a dead process.
            checks["_exit_segment_sane"] = not c["errors"] and all(not s["alive"] for s in segs)
        return result("exit_no_sync", checks, runs)

    def case_short_lived(self) -> Dict[str, Any]:
        if not self.prog:
            return result("short_lived", {"built": None}, {"skipped": self.prog_why})
        n = self.a.short_n
        cdir = self.work / "short"
        idir = self.work / "short-init"
        times: Dict[str, List[float]] = {"plain": [], "census": [], "plain_init": [], "census_init": []}
        bad: List[Dict[str, Any]] = []
        for k in range(n):
            for variant in (("plain", "census") if k % 2 == 0 else ("census", "plain")):
                env = self.census_env(cdir) if variant == "census" else bl.plain_env()
                r = self.run_prog(["short"], env, timeout=30)
                times[variant].append(r["wall_s"])
                if r["rc"] != 0:
                    bad.append(r)
            if k < n // 2:
                for variant in ("plain", "census"):
                    env = self.census_env(idir) if variant == "census" else bl.plain_env()
                    r = self.run_prog(["init"], env, timeout=30)
                    times[variant + "_init"].append(r["wall_s"])
                    if r["rc"] != 0:
                        bad.append(r)
        files = bl.segment_files(cdir)
        init_files = bl.segment_files(idir)
        disk = sum(f.stat().st_blocks * 512 for f in files)
        details: Dict[str, Any] = {
            "processes_each": n, "failures": bad[:5],
            "median_s": {k: bl.rnd(bl.median(v), 4) for k, v in times.items()},
            "added_ms_per_process": bl.rnd((bl.median(times["census"]) - bl.median(times["plain"])) * 1e3, 1),
            "added_ms_per_init_only_process": bl.rnd(
                (bl.median(times["census_init"]) - bl.median(times["plain_init"])) * 1e3, 1),
            "segment_files_left": len(files), "segment_bytes_on_disk": disk,
            "segment_files_left_by_init_only": len(init_files),
        }
        c = self.read_dir(cdir)
        checks: Dict[str, Optional[bool]] = {"all_exit_0": not bad,
                                             "init_only_leaves_no_file": len(init_files) == 0}
        if "error" not in c:
            segs = c["segments"]
            exact = [s for s in segs if s["kernels"] == 1 and s["copies"].get("dtoh", {}).get("bytes") == 128
                     and s["memset"]["count"] == 1 and s["state"] == "exited"]
            details["segments_exact"] = f"{len(exact)}/{len(segs)}"
            checks["counts_exact"] = len(exact) == len(segs) == n
        return result("short_lived", checks, details)

    def case_dir_removed(self) -> Dict[str, Any]:
        if not self.prog:
            return result("dir_removed", {"built": None}, {"skipped": self.prog_why})
        cdir = self.work / "removed"
        cdir.mkdir(mode=0o700, exist_ok=True)
        box: Dict[str, Any] = {}
        th = threading.Thread(target=lambda: box.update(self.run_prog(["loop", "4"], self.census_env(cdir), 40)))
        th.start()
        time.sleep(1.5)
        existed = len(bl.segment_files(cdir))
        bl.rm_tree(cdir)
        th.join(60)
        details = {"segment_files_before_removal": existed, "run": box,
                   "folder_recreated": cdir.exists()}
        checks = {"process_ok": box.get("rc") == 0 and not box.get("timed_out"),
                  "loop_ran": bool(box.get("printed", {}).get("kernels"))}
        return result("dir_removed", checks, details)

    def _mount_tmpfs(self, path: Path, opts: str) -> Optional[str]:
        path.mkdir(parents=True, exist_ok=True)
        d = bl.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], timeout=20)
        return None if d.ok else f"mount -o {opts} failed: {d.tail(200).strip()}"

    def case_dir_unusable(self) -> Dict[str, Any]:
        if not self.prog:
            return result("dir_unusable", {"built": None}, {"skipped": self.prog_why})
        runs: Dict[str, Any] = {}
        checks: Dict[str, Optional[bool]] = {}
        # A file where the folder should be, and a folder that cannot be created: no root needed.
        afile = self.work / "not-a-dir"
        afile.write_text("x")
        for name, path in (("path_is_a_file", afile), ("cannot_create", Path("/proc/otel-gpu-census-test"))):
            env = bl.injected_env(self.lib, None, OTEL_GPU_CENSUS_DIR=str(path))
            r = self.run_prog(["loop", "1"], env)
            runs[name] = r
            checks[name] = r["rc"] == 0 and bool(r.get("printed", {}).get("kernels"))
        # Read-only and full file systems: tmpfs mounts (root only).
        ro = self.work / "ro"
        why = self._mount_tmpfs(ro, "size=1m")
        if why is None:
            os.chmod(ro, 0o700)
            bl.run(["mount", "-o", "remount,ro", str(ro)], timeout=20)
            r = self.run_prog(["loop", "1"], bl.injected_env(self.lib, None, OTEL_GPU_CENSUS_DIR=str(ro)))
            runs["read_only"] = r
            checks["read_only"] = r["rc"] == 0 and bool(r.get("printed", {}).get("kernels"))
            bl.run(["umount", str(ro)], timeout=20)
        else:
            runs["read_only"] = {"skipped": why}
            checks["read_only"] = None
        full = self.work / "full"
        why = self._mount_tmpfs(full, "size=64k")
        if why is None:
            os.chmod(full, 0o700)
            bl.run(["dd", "if=/dev/zero", f"of={full}/filler", "bs=4k", "count=64"], timeout=20)
            r = self.run_prog(["loop", "1"], bl.injected_env(self.lib, None, OTEL_GPU_CENSUS_DIR=str(full)))
            r["files_after"] = sorted(p.name for p in full.iterdir())
            runs["full"] = r
            # SIGBUS (rc -7) is what a store into an unbacked mapped page would do.
            checks["full"] = r["rc"] == 0 and bool(r.get("printed", {}).get("kernels"))
            bl.run(["umount", str(full)], timeout=20)
        else:
            runs["full"] = {"skipped": why}
            checks["full"] = None
        return result("dir_unusable", checks, runs)

    def case_reader_killed(self) -> Dict[str, Any]:
        if not self.prog:
            return result("reader_killed", {"built": None}, {"skipped": self.prog_why})
        if self.pkg is None:
            return result("reader_killed", {"reader": None}, {"skipped": self.pkg_why})
        cdir = self.work / "readers"
        box: Dict[str, Any] = {}
        th = threading.Thread(target=lambda: box.update(self.run_prog(["loop", "6"], self.census_env(cdir), 40)))
        th.start()
        t0 = time.monotonic()
        while not bl.segment_files(cdir) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        files = bl.segment_files(cdir)
        kills = 0
        env = bl.plain_env()
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(bl.REPO / "src"), env.get("PYTHONPATH")]))
        code = ("import sys; from otel_gpu_census.census import reader\n"
                "while True: reader.read_segment(sys.argv[1])")
        while files and th.is_alive() and kills < self.a.reader_kills:
            p = subprocess.Popen([bl.python(), "-c", code, str(files[0])], env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(0.15 + random.random() * 0.35)   # past import, somewhere inside a read loop
            p.kill()
            p.wait(10)
            kills += 1
        th.join(60)
        c = self.read_dir(cdir)
        details = {"readers_killed": kills, "run": box, "census": c}
        checks: Dict[str, Optional[bool]] = {"segment_appeared": bool(files),
                                             "process_ok": box.get("rc") == 0 and not box.get("timed_out")}
        if "error" not in c and c["segments"]:
            s = c["segments"][0]
            printed = box.get("printed", {})
            checks["segment_complete"] = s["state"] == "exited" and not s["torn"]
            checks["counts_exact"] = (s["kernels"] == printed.get("kernels")
                                      and s["copies"].get("dtoh", {}).get("bytes") == printed.get("dtoh_bytes"))
        return result("reader_killed", checks, details)

    def case_torch_profiler(self) -> Dict[str, Any]:
        cdir = self.work / "profiler"
        d = bl.run([bl.python(), str(HERE / "workloads.py"), "profiler", "--n", "2000"], timeout=180,
                   env=self.census_env(cdir))
        line = next((ln for ln in d.out.splitlines() if ln.startswith("RESULT ")), None)
        res = json.loads(line[7:]) if line else {}
        details: Dict[str, Any] = {"rc": d.rc, "timed_out": d.timed_out, "result": res,
                                   "census_log": [ln for ln in d.err.splitlines() if "census" in ln.lower()][-5:],
                                   "kineto_log": [ln for ln in d.err.splitlines() if "buffer" in ln.lower()][-3:],
                                   "census_after_exit": self.read_dir(cdir)}
        if not line:
            details["stderr"] = d.tail(800)
        n = res.get("n", 2000)
        checks: Dict[str, Optional[bool]] = {
            "process_ok": d.rc == 0 and bool(res.get("value_ok")),
            "profiler_sees_kernels": (res.get("profiler_cuda_kernels") or 0) >= n,
        }
        before, during, after = (res.get(k, {}) for k in ("census_before", "census_during", "census_after"))
        if all("kernels" in x for x in (before, during, after)):
            checks["census_counted_before"] = before["kernels"] >= n
            checks["census_recovers_after"] = after["kernels"] - during["kernels"] >= n
            details["census_kernels_while_profiling"] = during["kernels"] - before["kernels"]
        else:
            checks["census_recovers_after"] = None
        return result("torch_profiler", checks, details)

    def case_server_cycles(self) -> Dict[str, Any]:
        """Baseline answers without the census, then censused cycles until the budget or --cycles."""
        base = [self.server_cycle(10_000 + k, census=False, baseline=None) for k in range(2)]
        answers = [b.get("answer") for b in base]
        baseline = answers[0] if answers and answers[0] and "tokens" in answers[0] else None
        deterministic = bool(baseline) and answers[0] == answers[1]
        if not deterministic:
            self.log(f"baseline answers differ between two runs without the census: answer check off ({answers})")
            baseline = None
        # server_cycle drops "answer" from passing records; the baseline keeps its own copy.
        est = max([b.get("cycle_s") or 5.0 for b in base]) * 1.2
        target = self.a.cycles
        lock = threading.Lock()
        counter = iter(range(target))
        records: List[Dict[str, Any]] = []

        def worker() -> None:
            while True:
                with lock:
                    # cycles run in parallel take longer than the sequential baselines: use the slower
                    recent = [r["cycle_s"] for r in records[-self.a.parallel:] if r.get("cycle_s")]
                    need = max(est, 1.2 * max(recent, default=0.0))
                    if self.time_left() < need + self.a.reserve_s:
                        return
                    i = next(counter, None)
                if i is None:
                    return
                try:
                    r = self.server_cycle(i, census=True, baseline=baseline)
                except Exception as e:   # a bug here must not stop the other workers
                    r = {"i": i, "failure": "harness", "why": f"{type(e).__name__}: {e}"}
                with lock:
                    records.append(r)
                    if len(records) % 20 == 0 or "failure" in r:
                        self.log(f"cycles: {len(records)} done, last {r.get('cycle_s')} s"
                                 + (f", FAILURE {r['failure']}: {r.get('why')}" if "failure" in r else ""))

        threads = [threading.Thread(target=worker) for _ in range(self.a.parallel)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        fails = [r for r in records if "failure" in r]
        kinds: Dict[str, int] = {}
        for r in fails:
            kinds[r["failure"]] = kinds.get(r["failure"], 0) + 1
        reads = sum(r.get("reader", {}).get("reads", 0) for r in records)
        torn = sum(r.get("reader", {}).get("torn", 0) for r in records)
        details = {
            "cycles_target": target, "cycles_ran": len(records), "parallel": self.a.parallel,
            "failures_by_kind": kinds, "first_failures": fails[:10],
            "crashes": kinds.get("crash", 0), "hangs": kinds.get("hang", 0),
            "answer_mismatches": kinds.get("answer", 0), "answer_checked": baseline is not None,
            "baseline_runs": [{k: b.get(k) for k in ("startup_s", "cycle_s", "failure", "why")} for b in base],
            "median_cycle_s": bl.rnd(bl.median(r.get("cycle_s") for r in records), 2),
            "median_startup_s": bl.rnd(bl.median(r.get("startup_s") for r in records), 2),
            "concurrent_reads": reads, "torn_reads": torn,
        }
        checks: Dict[str, Optional[bool]] = {
            "ran_any": bool(records),
            "no_crash": kinds.get("crash", 0) == 0, "no_hang": kinds.get("hang", 0) == 0,
            "answers_unaffected": (kinds.get("answer", 0) == 0) if baseline else None,
            "segments_complete": (kinds.get("segment", 0) == 0) if self.segments_expected else None,
            "readers_consistent": (kinds.get("reader", 0) == 0) if self.pkg else None,
            "all_cycles_ok": not fails,
            "reached_target": len(records) >= target,
        }
        return result("server_cycles", checks, details)


def markdown(res: Dict[str, Any]) -> str:
    lines = [f"# Reliability suite, {res['date']}", "", f"GPU: {res['environment'].get('nvidia_smi', {}).get('gpu')}; "
             f"command: `{res['command']}`", "", "| case | passed | checks | details |", "|---|---|---|---|"]
    for c in res["cases"]:
        checks = ", ".join(f"{k} {'ok' if v else ('n/a' if v is None else 'FAIL')}" for k, v in c["checks"].items())
        d = c["details"]
        brief = ""
        if c["case"] == "server_cycles":
            brief = (f"{d.get('cycles_ran')}/{d.get('cycles_target')} cycles, crashes {d.get('crashes')}, "
                     f"hangs {d.get('hangs')}, answer mismatches {d.get('answer_mismatches')}, "
                     f"{d.get('concurrent_reads')} concurrent reads ({d.get('torn_reads')} torn)")
        elif c["case"] == "short_lived":
            brief = (f"+{d.get('added_ms_per_process')} ms/process, {d.get('segment_files_left')} files "
                     f"({d.get('segment_bytes_on_disk')} B) left, init-only files {d.get('segment_files_left_by_init_only')}")
        elif c["case"] == "torch_profiler":
            r = d.get("result", {})
            brief = (f"profiler kernels {r.get('profiler_cuda_kernels')}, census during profiling "
                     f"{d.get('census_kernels_while_profiling')}")
        elif "error" in d:
            brief = str(d["error"])[:120]
        lines.append(f"| {c['case']} | {'yes' if c['passed'] else 'NO'} | {checks} | {brief} |")
    lines += ["", f"Total {res['elapsed_s']} s."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--server", help="llama-server binary (CUDA build); server cases are skipped without it")
    ap.add_argument("--model", help="tiny GGUF (default: OUT/work/tiny.gguf, made from --vocab)")
    ap.add_argument("--vocab", help="vocab-only GGUF to make the tiny model from")
    ap.add_argument("--census-lib", help="default $OTEL_GPU_CENSUS_LIB or native/build/libotel_gpu_census.so")
    ap.add_argument("--budget-s", type=float, default=500)
    ap.add_argument("--reserve-s", type=float, default=15, help="kept free at the end of the budget")
    ap.add_argument("--cycles", type=int, default=200)
    ap.add_argument("--parallel", type=int, default=4, help="server cycles run at once")
    ap.add_argument("--signal-repeats", type=int, default=2)
    ap.add_argument("--short-n", type=int, default=30, help="short-lived processes per variant")
    ap.add_argument("--reader-kills", type=int, default=15)
    ap.add_argument("--arch", default="90", help="sm_ of the GPU for cuda_prog")
    ap.add_argument("--port", type=int, default=19100)
    ap.add_argument("--startup-timeout", type=float, default=60)
    ap.add_argument("--only", default="", help="comma list of cases (`cycles`: server_cycles)")
    ap.add_argument("--skip", default="", help="comma list of cases")
    ap.add_argument("--expect-segments", choices=("auto", "yes", "no"), default="auto",
                    help="check each censused cycle's segment (auto: when nvidia-smi sees a GPU)")
    a = ap.parse_args()
    alias = {"cycles": "server_cycles"}
    only = [alias.get(c, c) for c in a.only.split(",") if c]
    skip = [alias.get(c, c) for c in a.skip.split(",") if c]
    unknown = [c for c in only + skip if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s): {', '.join(unknown)}; known: {', '.join(CASES)}")
    cases = [c for c in CASES if (not only or c in only) and c not in skip]

    out = Path(a.out)
    work = out / "reliability-work"
    work.mkdir(parents=True, exist_ok=True)
    os.chmod(work, 0o700)
    log = bl.Log(work / "reliability.log")
    env_info = {"nvidia_smi": bl.nvidia_smi(), "nvcc": bl.nvcc_version(), "python": sys.version.split()[0]}
    res_path = bl.results_path(str(out), env_info["nvidia_smi"].get("gpu"), "reliability")
    if a.expect_segments == "auto":
        a.expect_segments = "yes" if env_info["nvidia_smi"].get("gpu") else "no"
    s = Suite(a, log, work)
    why = (bl.ensure_built(s.lib, bl.REPO / "native", log) if s.lib == bl.CENSUS_LIB_DEFAULT.resolve()
           else (None if s.lib.is_file() else f"{s.lib} does not exist"))
    if why:
        log(f"no census library: {why}")
        return 1
    server_cases = {"sigterm_midload", "sigkill_midload", "server_cycles"}
    if not a.server or not Path(a.server).is_file():
        log(f"no llama-server ({a.server}): skipping {sorted(server_cases & set(cases))}")
        cases = [c for c in cases if c not in server_cases]
    if server_cases & set(cases):
        a.model = a.model or str(work / "tiny.gguf")
        if not Path(a.model).is_file():
            if not a.vocab:
                log("no --model and no --vocab: skipping server cases")
                cases = [c for c in cases if c not in server_cases]
            else:
                import make_model
                info = make_model.write_model(Path(a.model), Path(a.vocab), dict(make_model.PRESETS["tiny"], preset="tiny"))
                log(f"tiny model: {info['bytes'] / 1e6:.0f} MB in {info['seconds']} s")
    if s.pkg is None:
        log(f"note: {s.pkg_why}; reader checks are skipped")
    s.build_prog()
    log(f"plan: {cases}; server cycles fill what is left of {a.budget_s:.0f} s (up to {a.cycles}, "
        f"{a.parallel} at a time)")

    res: Dict[str, Any] = {"benchmark": "reliability", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                           "command": " ".join(shlex.quote(x) for x in sys.argv), "environment": env_info,
                           "cases": []}
    runners: Dict[str, Callable[[], Dict[str, Any]]] = {
        "sigterm_midload": lambda: s.case_signal_midload(signal.SIGTERM),
        "sigkill_midload": lambda: s.case_signal_midload(signal.SIGKILL),
        "fork_no_exec": s.case_fork, "exit_no_sync": s.case_exit_no_sync, "short_lived": s.case_short_lived,
        "dir_removed": s.case_dir_removed, "dir_unusable": s.case_dir_unusable,
        "reader_killed": s.case_reader_killed, "torch_profiler": s.case_torch_profiler,
        "server_cycles": s.case_server_cycles,
    }
    for c in cases:
        if c != "server_cycles" and s.time_left() < 30 + a.reserve_s:
            res["cases"].append(result(c, {"time": None}, {"skipped": "budget spent"}))
            continue
        t0 = time.monotonic()
        try:
            r = runners[c]()
        except Exception as e:   # a broken case is a finding, not the end of the suite
            import traceback
            r = result(c, {"harness": False}, {"error": f"{type(e).__name__}: {e}",
                                               "traceback": traceback.format_exc()[-1500:]})
        r["seconds"] = round(time.monotonic() - t0, 1)
        res["cases"].append(r)
        log(f"{c}: {'passed' if r['passed'] else 'FAILED'} {r['checks']} ({r['seconds']} s)")
        res["elapsed_s"] = round(log.elapsed(), 1)
        bl.write_json(res_path, res)
    res["elapsed_s"] = round(log.elapsed(), 1)
    bl.write_json(res_path, res)
    md = markdown(res)
    (out / "reliability.md").write_text(md)
    print("\n" + md)
    print(f"results: {res_path}")
    return 0 if all(c["passed"] for c in res["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
