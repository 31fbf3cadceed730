"""`otel-gpu-census`: run a command under the census, report on segments, check the machine.

    otel-gpu-census run [--dir DIR] [--json FILE] [--requests N] [--proxy HOST:PORT [--upstream URL]] -- CMD ARGS...
    otel-gpu-census report [DIR|FILE.seg] [--requests N] [--request-log FILE] [--sm-occupancy R] [--by tenant|model] [--json] [--pid PID]
    otel-gpu-census report --diff A B [--requests N|NA,NB] [--json]
    otel-gpu-census doctor
    otel-gpu-census proxy ...            (the llama.cpp proxy)

Bad input never shows a traceback: argparse errors exit 2, an unusable folder or unreadable
segment exits 1 with a message, a command that cannot be started exits 127 (126 when it is not
executable), like a shell.
"""
from __future__ import annotations

import argparse
import errno
import errno
import json
import os
import signal
import stat
import subprocess
import sys
import threading
from typing import Dict, List, Optional
from otel_gpu_census.cli.argtypes import metrics_interval, positive_float, positive_int, ratio, request_counts

# reader/report/launcher are imported by the commands that use them: `--help` and `doctor` must
# work even where the package is broken (doctor is what says so).

PROG = "otel-gpu-census"
# Every signal a supervisor or a user may send is the command's (SIGUSR1 asks many servers to reopen
# logs, SIGWINCH to resize). Not forwarded: what cannot be caught, SIGCHLD (ours), faults and
# resource limits of this process itself, terminal reads and writes from the background (they stop
# this process, as for any job), and SIGPIPE, SIGURG, SIGIO, profiling timers (raised by this process's
# own I/O and timers). SIGTSTP stops the command and then this process (a job stops whole).
_NOT_FORWARDED = {signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD, signal.SIGSEGV, signal.SIGBUS, signal.SIGFPE,
                  signal.SIGILL, signal.SIGTRAP, signal.SIGSYS, signal.SIGABRT, signal.SIGXCPU, signal.SIGXFSZ,
                  signal.SIGTTIN, signal.SIGTTOU, signal.SIGPIPE, signal.SIGURG, signal.SIGIO,
                  signal.SIGPROF, signal.SIGVTALRM}
FORWARDED_SIGNALS = tuple(sorted(s for s in signal.valid_signals() if s not in _NOT_FORWARDED))
# Signals whose default is to do nothing: after the command ended they do not end the report either.
_HARMLESS_SIGNALS = {signal.SIGWINCH, signal.SIGCONT}
# Python ignores SIGPIPE and SIGXFSZ for itself; the child gets them back at their defaults (subprocess's
# restore_signals). Other dispositions pass through (under nohup, SIGHUP stays ignored).
_SI_KERNEL = 0x80          # si_code of signals the terminal sends to a whole process group
EXPORTERS = ("otlp", "prometheus", "console", "none")
DEFAULT_DIR_KEEP_S = 24 * 3600   # segments of ended processes kept this long in the default folder
# Without --exporter, these variables ask for metrics (otel_gpu_census.telemetry.setup decides which).
_METRICS_ENV = ("OTEL_METRICS_EXPORTER", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def _say(msg: str) -> None:
    _write_stderr(f"{PROG}: {msg}\n")


def _write_stderr(text: str) -> None:
    """Write to stderr and flush. A stderr that cannot take it (closed, its reader gone, a full disk)
    loses this and every later line and nothing else: never an exception, and from then on descriptor 2
    is /dev/null, so neither a later write nor the interpreter's last flush can change the exit status
    (`run` exits with its command's code; its JSON report is written all the same)."""
    err = sys.stderr
    if err is None:                    # started with descriptor 2 closed
        return
    try:
        err.write(text)
        err.flush()
    except (OSError, ValueError):
        _silence_stderr()


def _silence_stderr() -> None:
    try:
        null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        os.dup2(null, 2)               # the buffered text now goes nowhere, successfully
        os.close(null)
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass


def _port(text: str) -> int:
    v = positive_int(text)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text!r}")
    return v


# ---------------------------------------------------------------------------------------------
# run

def _terminal_foreground() -> bool:
    """This process is in the foreground process group of its terminal (a shell prompt started it)."""
    for fd in (0, 1, 2):
        try:
            if os.isatty(fd):
                return os.tcgetpgrp(fd) == os.getpgrp()
        except OSError:
            continue
    return False


class _Child:
    """The command's process, with the launcher's signals forwarded to it.

    Forwarded signals are blocked in this process and collected by one thread with sigtimedwait,
    which also sees where each came from: a signal the terminal sent to the whole foreground group
    (Ctrl-C) already reached the child and is not sent twice.

    Started from a terminal's foreground, the command stays in this process group, so the terminal's
    Ctrl-C, Ctrl-Z and Ctrl-\\ reach all of it (and job control keeps working) and a signal sent to
    this process goes to the command. Otherwise (a supervisor, a script, `docker stop`) the command
    gets its own process group and every signal goes to the whole group: a shell's children get the
    SIGTERM too, not only the shell.
    """

    def __init__(self, argv: List[str], env: Dict[str, str]):
        from otel_gpu_census.census import proctree
        own_group = not _terminal_foreground()
        signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)
        try:
            self._process = _spawn(argv, env, own_group)
        except (OSError, subprocess.SubprocessError):
            signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED_SIGNALS)
            raise
        self.pid = self._process.pid
        self.start_ticks = proctree.proc_start_ticks(self.pid)   # the unreaped child keeps /proc/<pid>
        self.own_group = own_group
        try:
            self.same_group = os.getpgid(0) == os.getpgid(self.pid)
        except OSError:
            self.same_group = not own_group
        self.parents: Dict[int, int] = {}       # descendants seen while running: {pid: ppid}
        self.exited = threading.Event()
        threading.Thread(target=self._forward, name="signal-forwarder", daemon=True).start()
        self._watcher = threading.Thread(target=self._watch_tree, name="tree-watcher", daemon=True)
        self._watcher.start()

    def _forward(self) -> None:
        absorbed = False
        while True:
            info = signal.sigtimedwait(FORWARDED_SIGNALS, 0.2)
            if info is None:
                continue
            from_terminal = info.si_code == _SI_KERNEL and self.same_group
            if info.si_signo == signal.SIGTSTP:
                if not from_terminal and not self.exited.is_set():
                    self.signal(signal.SIGTSTP)        # the server stops with `run`, not runs on without it
                os.kill(os.getpid(), signal.SIGSTOP)   # SIGTSTP's own effect on this process; SIGCONT goes on
                continue
            if self.exited.is_set():
                # The command is done and the report is being written. The Ctrl-C that ended the
                # command may be seen only now: let one pass; any further request to stop is obeyed.
                if info.si_signo in _HARMLESS_SIGNALS:
                    continue
                if from_terminal and not absorbed:
                    absorbed = True
                    continue
                _say(f"interrupted by signal {info.si_signo} while finishing the report")
                os._exit(128 + info.si_signo)
            if from_terminal:
                continue
            self.signal(info.si_signo)

    def signal(self, signo: int) -> None:
        """Send `signo` to the command: to its whole process group when it has its own."""
        try:
            if self.own_group:
                try:
                    os.killpg(self.pid, signo)
                    return
                except ProcessLookupError:    # it moved to another group (a job-control shell): the pid
                    pass
            os.kill(self.pid, signo)
        except ProcessLookupError:
            pass

    def _watch_tree(self) -> None:
        from otel_gpu_census.census import proctree
        # Processes between the command and a CUDA program (a shell, a launcher script) write no
        # segment; remembering them keeps their CUDA descendants in this run's report.
        while not self.exited.wait(0.5):
            try:
                self.parents.update(proctree.live_descendants(self.pid))
            except OSError:
                pass

    def wait(self) -> int:
        """The command's exit code; 128+N when signal N killed it."""
        while True:
            try:
                _, status = os.waitpid(self.pid, 0)
                break
            except InterruptedError:
                continue
        self.exited.set()
        self._watcher.join()            # self.parents is complete and no longer changes
        code = os.waitstatus_to_exitcode(status)
        self._process.returncode = code  # reaped here, not by subprocess
        return 128 - code if code < 0 else code


_PR_SET_PDEATHSIG = 1


def _spawn(argv: List[str], env: Dict[str, str], own_group: bool) -> "subprocess.Popen":
    """Start the command: every signal unblocked and SIGPIPE/SIGXFSZ at their defaults (as after a
    shell's exec), in its own process group when `own_group`, descriptors passed as they are (socket
    activation), and SIGKILLed by the kernel if `run` dies without forwarding anything (SIGKILL, a
    crash): the command never runs on, orphaned, with nobody to report on it (PR_SET_PDEATHSIG, Linux)."""
    parent = os.getpid()
    try:
        import ctypes
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        prctl = None

    def in_child() -> None:          # after fork, before exec; `run` has no other thread yet
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        if own_group:
            os.setpgid(0, 0)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:        # run died before the request took effect
                os.kill(os.getpid(), signal.SIGKILL)
    return subprocess.Popen(argv, env=env, close_fds=False, restore_signals=True, preexec_fn=in_child)


def _start_metrics(args, census_dir, root_pid: int):
    """The metrics sidecar (otel_gpu_census.telemetry.sidecar), when asked for and available; never fatal."""
    if args.exporter == "none" or (args.exporter is None and not any(os.environ.get(v) for v in _METRICS_ENV)):
        return None      # not asked for: do not even import the OpenTelemetry SDK
    try:
        from otel_gpu_census.telemetry import sidecar
    except ModuleNotFoundError as e:
        if e.name == "otel_gpu_census.telemetry.sidecar":
            _say("metrics export is not available in this build; continuing without")
        else:
            _say(f"metrics export needs {e.name}, which is not installed; continuing without")
        return None
    except ImportError as e:
        _say(f"metrics export cannot load ({e}); continuing without")
        return None
    try:
        return sidecar.start_sidecar(census_dir=census_dir, root_pid=root_pid, exporter=args.exporter,
                                     prometheus_port=args.prometheus_port, interval_s=args.metrics_interval)
    except Exception as e:    # the command must run whatever the exporter thinks
        _say(f"metrics export did not start ({type(e).__name__}: {e}); continuing without")
        return None


def _metrics_lines(sidecar) -> List[str]:
    """Where the metrics of this run go ('metrics → …'); nothing when none were asked for, so a
    plain run's output is the command's own."""
    return sidecar.descriptions() if sidecar is not None else []


def _stop_metrics(sidecar) -> None:
    if sidecar is None:
        return
    try:
        sidecar.stop()
    except Exception as e:
        _say(f"metrics export did not stop cleanly ({type(e).__name__}: {e})")


def _cmd_run(args) -> int:
    argv = list(args.command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        args.parser.error("no command given (usage: run [options] -- CMD ARGS...)")
    if args.upstream and args.proxy is None:
        args.parser.error("--upstream goes with --proxy HOST:PORT")
    from otel_gpu_census.report import render  # noqa: F401  (imported before the command starts: a broken install shows then)
    from otel_gpu_census.census import folder
    from otel_gpu_census.cli.launcher import census_env
    try:
        census_dir = folder.census_dir(args.dir)
    except folder.CensusDirError as e:
        _say(str(e))
        return 1
    if args.dir is None and not os.environ.get("OTEL_GPU_CENSUS_DIR"):
        # The default folder is ours to keep tidy (it is often RAM-backed: /run/user/<uid>); a
        # folder the user named is theirs.
        folder.cleanup(census_dir, older_than_s=DEFAULT_DIR_KEEP_S)
    json_out = None
    if args.json:
        json_out = _open_json_out(args.json)     # now: a path that cannot be written should not cost a whole run
        if json_out is None:
            return 1
    plan = census_env(census_dir, precise=args.precise)
    proxy_plan = None
    if args.proxy is not None:
        proxy_plan = _proxy_plan(args, argv, plan.env)     # checked before anything starts
        if isinstance(proxy_plan, int):
            return proxy_plan
    for w in plan.warnings:
        _say(w)
    try:
        child = _Child(argv, plan.env)
    except FileNotFoundError:
        _say(f"{argv[0]}: command not found")
        return 127
    except OSError as e:
        _say(f"{argv[0]}: cannot run: {e.strerror}")
        return 126
    except subprocess.SubprocessError as e:
        _say(f"{argv[0]}: cannot run: {e}")
        return 126
    sidecar = _start_metrics(args, census_dir, child.pid)
    for line in _metrics_lines(sidecar):
        _say(line)
    proxy = None
    if proxy_plan is not None:
        proxy = _start_proxy(proxy_plan, census_dir, child, sidecar)
        if proxy is None:       # the server is of no use without the proxy that was asked for
            child.signal(signal.SIGTERM)
            child.wait()
            _stop_metrics(sidecar)
            return 1
    keeper = _WindowKeeper(census_dir, child)
    code = child.wait()
    try:        # nothing from here on may change the exit status: it is the command's
        _after_the_command(args, census_dir, plan, child, proxy, sidecar, json_out, keeper)
    except Exception as e:
        _say(f"the report failed ({type(e).__name__}: {e}); the command's exit status stands")
    return code


def _open_json_out(path: str):
    """`run --json`'s file, open for writing, or None after saying why not. Opened without waiting: a FIFO
    that nobody reads would otherwise hold `run` before its command starts."""
    import errno
    import fcntl
    from otel_gpu_census.census.folder import show_path
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    except OSError as e:
        why = "a FIFO that nobody reads (start its reader first)" if e.errno == errno.ENXIO else e.strerror
        _say(f"cannot write {show_path(path)}: {why}")
        return None
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return os.fdopen(fd, "w")


def _after_the_command(args, census_dir, plan, child: "_Child", proxy, sidecar, json_out, keeper) -> None:
    """Stop the proxy and the metrics, print the report to stderr (and the JSON one to --json)."""
    from otel_gpu_census.report import render as report
    from otel_gpu_census.census import proctree, reader
    from otel_gpu_census.report.diagnose import Facts
    keeper.join()
    records = None
    if proxy is not None:
        _stop_proxy(proxy)
        records = _served(proxy)
    _stop_metrics(sidecar)

    censuses, errors = reader.scan(census_dir)
    tree = proctree.process_tree(child.pid, censuses, parents=child.parents, root_start_ticks=child.start_ticks)
    tree = [keeper.history.extend(c) for c in tree]
    facts = Facts(requests=args.requests, records=records)
    hint = None
    if not tree:
        hint = (f"the census was off ({plan.warnings[0]})" if not plan.census_on and plan.warnings else
                f"no process of this run initialised CUDA (no census segment for it in {census_dir}); if one "
                "did, the injector's own log lines above say why it wrote none")
    errors = _errors_in_tree(errors, {c.pid for c in tree} | {child.pid} | set(child.parents))
    _write_stderr(report.render_text(tree, args.requests, str(census_dir), hint, facts))
    _say_errors(errors)
    if json_out is not None:
        try:
            with json_out:
                json.dump(report.to_dict(tree, errors, args.requests, str(census_dir), hint, facts), json_out, indent=2)
                json_out.write("\n")
        except OSError as e:
            _say(f"cannot write {args.json}: {e.strerror}")


class _WindowKeeper:
    """Reads the command's segments every READ_EVERY_S while it runs and keeps their 20 ms windows
    (census.history), so the report at the end reaches back to start-up however long the run was.
    Never fatal: a read that fails is skipped."""

    def __init__(self, census_dir, child: "_Child"):
        from otel_gpu_census.census.history import READ_EVERY_S, WindowHistory
        self.history = WindowHistory()
        self._dir, self._child, self._every = census_dir, child, READ_EVERY_S
        self._thread = threading.Thread(target=self._run, name="window-keeper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from otel_gpu_census.census import reader
        while not self._child.exited.wait(self._every):
            try:
                pids = {self._child.pid} | set(self._child.parents.copy())
                for p in reader.segment_paths(self._dir):
                    ident = reader.segment_file_pid(p)
                    if ident is None or ident[0] not in pids:
                        continue
                    try:
                        self.history.add(reader.read_segment(p))
                    except reader.SegmentError:
                        continue
            except Exception as e:      # the report at the end still has the last read's ring
                _say(f"keeping the census windows stopped ({type(e).__name__}: {e}); the report has the last ~41 s")
                return

    def join(self) -> None:
        self._thread.join()


def _served(proxy) -> Optional[list]:
    """The requests the proxy served, as request records (start, end, first token), for the report."""
    from otel_gpu_census.report.request_log import RequestRecord
    try:
        return [RequestRecord(a, b, f if f is not None and a <= f <= b else None)
                for a, b, f in sorted(proxy.served()) if 0 < a <= b] or None
    except Exception as e:
        _say(f"the proxy's requests could not be read ({type(e).__name__}: {e}); the report has no request records")
        return None


def _proxy_plan(args, argv: List[str], env: Dict[str, str]):
    """The proxy `run --proxy` starts beside the command, checked before the command starts: a
    ProxyConfig without the server's pid, or an exit status after saying what is wrong."""
    from otel_gpu_census.extras import missing
    lacking = missing("proxy")
    if lacking:
        _say(f"--proxy: {lacking}")
        return 1
    from otel_gpu_census.integrations.llamacpp import ConfigError, ProxyConfig
    from otel_gpu_census.integrations.llamacpp.config import check_not_itself, check_upstream, parse_host_port, upstream_from_server_args
    try:
        host, port = parse_host_port(args.proxy, "--proxy")
        if args.upstream:
            upstream, prefix = check_upstream(args.upstream), ""
        else:
            upstream, prefix = upstream_from_server_args(argv, env)
        check_not_itself(host, port, upstream)
    except ConfigError as e:
        _say(str(e))
        return 2
    problem = _cannot_listen(host, port)
    if problem:
        _say(f"--proxy: cannot listen on {args.proxy}: {problem}")
        return 1
    return ProxyConfig(upstream=upstream, listen_host=host, listen_port=port, api_prefix=prefix)


def _cannot_listen(host: str, port: int) -> Optional[str]:
    """Why the proxy could not listen on host:port, or None (a trial bind, released at once)."""
    import socket
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return e.strerror or str(e)
    family, kind, proto, _, addr = infos[0]
    try:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
    except OSError as e:
        return e.strerror or str(e)
    return None


def _start_proxy(plan, census_dir, child: "_Child", sidecar=None):
    """The proxy in a thread of this process, attributing the command's GPU work (its pid and
    children) to requests; None after saying why it did not start. Its metrics go out through the
    sidecar's provider when there is one: one process, one set of exporters (one Prometheus port),
    as --exporter chose."""
    import dataclasses

    from otel_gpu_census.integrations.llamacpp import start_proxy_in_thread
    cfg = dataclasses.replace(plan, census_dir=str(census_dir), upstream_pid=child.pid)
    meter_provider = getattr(sidecar, "meter_provider", None)
    try:
        handle = start_proxy_in_thread(cfg, meter_provider=meter_provider)
    except OSError as e:
        _say(f"proxy: cannot listen on {cfg.listen_host}:{cfg.listen_port}: {e.strerror or e}; stopping the command")
        return None
    except Exception as e:
        _say(f"proxy did not start ({type(e).__name__}: {e}); stopping the command")
        return None
    _say(f"proxy: {handle.describe()}")
    for line in handle.descriptions():
        if line.startswith("traces"):
            _say(line)
    return handle


def _stop_proxy(handle) -> None:
    """Stop accepting; spans still waiting for the census get --gpu-wait to finish (the server has
    exited, so its census is final and they settle at once), then telemetry is flushed."""
    try:
        handle.stop(drain_s=handle.config.gpu_max_wait_s)
    except Exception as e:
        _say(f"proxy did not stop cleanly ({type(e).__name__}: {e})")


def _errors_in_tree(errors, pids):
    """Unreadable segments whose file name says they belong to one of `pids`."""
    from otel_gpu_census.census.reader import segment_file_pid
    return [e for e in errors if (segment_file_pid(e.path) or (0, 0))[0] in pids]


ERROR_LINES = 10        # files that could not be read, one line each; past these, one line for the rest


def _say_errors(errors) -> None:
    from collections import Counter
    from otel_gpu_census.telemetry.redact import printable
    for e in errors[:ERROR_LINES]:
        _say(printable(f"could not read {e.path}: {e.reason}"))
    rest = errors[ERROR_LINES:]
    if rest:       # a folder of thousands of planted or broken files costs a few lines, not one each
        common = "; ".join(f"{n:,}: {reason}" for reason, n in Counter(e.reason for e in rest).most_common(3))
        _say(printable(f"and {len(rest):,} more files named like segments could not be read ({common})"))


# ---------------------------------------------------------------------------------------------
# report

def _cmd_report(args) -> int:
    from otel_gpu_census.report import render as report
    from otel_gpu_census.census import folder, proctree, reader
    if args.diff and args.by:
        args.parser.error("--by goes without --diff")
    if args.diff:
        from otel_gpu_census.report.diff import run_diff
        return run_diff(args, _say)
    if isinstance(args.requests, tuple):
        args.parser.error("--requests NA,NB goes with --diff")
    facts = _report_facts(args)
    if isinstance(facts, int):
        return facts
    target = args.dir
    errors: List[reader.SegmentError] = []
    kind = None
    if target:
        try:
            kind = os.stat(target).st_mode
        except OSError as e:      # a folder above it we cannot enter, a name too long, ...
            if e.errno != errno.ENOENT:
                _say(f"cannot read {folder.show_path(target)}: {e.strerror}")
                return 1
    if kind is not None and not stat.S_ISDIR(kind):       # one segment (read_segment refuses a non-file)
        census_dir = os.path.dirname(os.path.abspath(target))
        try:
            censuses = [reader.read_segment(target)]
        except reader.SegmentError as e:
            censuses, errors = [], [e]
    else:
        try:
            census_dir = str(folder.readable_dir(target))
        except folder.CensusDirError as e:
            _say(str(e))
            return 1
        censuses, errors = reader.scan(census_dir)
    if errors and not censuses and not args.json:      # nothing readable: the lines that say why, no empty report
        _say_errors(errors)
        return 1
    hint = None
    if args.pid is not None:
        parents = proctree.live_descendants(args.pid) if proctree.proc_start_ticks(args.pid) else {}
        censuses = proctree.process_tree(args.pid, censuses, parents=parents)
        errors = _errors_in_tree(errors, {c.pid for c in censuses} | {args.pid} | set(parents))
        if not censuses:
            hint = f"no census segment for pid {args.pid} or its descendants in {census_dir}"
    elif not censuses:
        hint = f"no census segment in {census_dir}"
    if args.by:
        return _report_by(args, censuses, errors, hint, facts)
    if args.json:
        json.dump(report.to_dict(censuses, errors, args.requests, census_dir, hint, facts), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(report.render_text(censuses, args.requests, census_dir, hint, facts))
    sys.stdout.flush()
    _say_errors(errors)
    return 1 if errors or (args.pid is not None and not censuses) else 0


def _report_by(args, censuses, errors, hint, facts) -> int:
    """`report --by tenant|model`: the chargeback table (report/chargeback.py) of the engines' request logs, and of
    the spans in --request-log (the proxy's) where given."""
    from otel_gpu_census.report import chargeback, engine_requests
    if hint:
        _say(hint)
    cb = chargeback.build(engine_requests.for_segments([c.path for c in censuses]), args.by, censuses)
    spans = chargeback.from_spans(facts.records or (), args.by, censuses)
    if args.request_log and spans is None:
        _say("the request log has no span with a GPU share (gpu_census.kernel.count): nothing of it to add up")
    if args.json:
        out = chargeback.to_dict(cb)
        if spans is not None:
            out["request_log"] = chargeback.to_dict(spans)
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        if cb.logs or spans is None:
            sys.stdout.write(chargeback.render_text(cb))
        if spans is not None:
            sys.stdout.write(chargeback.render_text(spans))
    sys.stdout.flush()
    _say_errors(errors)
    return 1 if errors or not censuses else 0


def _report_facts(args):
    """What report knows besides the census (diagnose.Facts), or an exit status after saying why not."""
    from otel_gpu_census.report.diagnose import Facts
    records = None
    if args.request_log:
        from otel_gpu_census.report.request_log import RequestLogError, load
        try:
            records = load(args.request_log)
        except RequestLogError as e:
            _say(str(e))
            return 1
        if records.unread:
            from otel_gpu_census.census.folder import show_path
            _say(f"request log {show_path(args.request_log)}: {records.unread}")
    return Facts(requests=args.requests, records=records, sm_occupancy=args.sm_occupancy)


# ---------------------------------------------------------------------------------------------
# doctor, proxy

def _cmd_doctor(args) -> int:
    from otel_gpu_census.cli import doctor
    return doctor.main()


def add_proxy_arguments(parser: argparse.ArgumentParser) -> None:
    """The proxy's options live with the proxy (otel_gpu_census.integrations.llamacpp.config)."""
    from otel_gpu_census.integrations.llamacpp import add_proxy_arguments as add
    add(parser)


def _cmd_proxy(args) -> int:
    from otel_gpu_census.integrations.llamacpp import run_proxy
    return run_proxy(args)


# ---------------------------------------------------------------------------------------------

def _cmd_env(args) -> int:
    import shlex
    from otel_gpu_census.telemetry.redact import printable
    from otel_gpu_census.census import folder
    from otel_gpu_census.cli.launcher import census_env, census_variables
    try:
        census_dir = folder.census_dir(args.dir)
    except folder.CensusDirError as e:
        _say(str(e))
        return 1
    plan = census_env(census_dir, precise=args.precise)
    for w in plan.warnings:
        _say(w)
    if not plan.census_on:
        return 1
    variables = census_variables(plan)
    if args.format == "docker":
        # an --env-file line is NAME=VALUE to its end, no quoting: a line break would end the value and
        # start a line of its own (another variable)
        for name, value in variables.items():
            if any(c in value for c in "\n\r\0"):
                _say(printable(f"{name}={value} has a line break, which docker's --env-file cannot carry; use "
                               "--format sh or systemd, or a folder whose name has none"))
                return 1
    for name, value in variables.items():
        if args.format == "sh":
            print(f"export {name}={shlex.quote(value)}")
        elif args.format == "docker":
            print(f"{name}={value}")
        else:
            print(f'Environment="{_systemd_quoted(f"{name}={value}")}"')
    return 0


def _systemd_quoted(text: str) -> str:
    """`text` inside a systemd Environment="..." : backslash, quote and control characters escaped, % doubled
    (systemd expands %-specifiers there)."""
    out = []
    for c in text:
        if c in '\\"':
            out.append("\\" + c)
        elif c == "%":
            out.append("%%")
        elif ord(c) < 32 or ord(c) == 127:
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(c)
    return "".join(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Count what CUDA processes ask of their GPUs: every "
                                "kernel and memory copy, exact, per process and device.")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="verb", metavar="COMMAND")

    run = sub.add_parser("run", help="run a command under the census, then report",
                         description="Run CMD with the census injector loaded into every CUDA process it "
                         "starts; pass signals to it; exit with its exit code; print the report to stderr.")
    run.add_argument("--dir", help="census folder (default: $OTEL_GPU_CENSUS_DIR, else "
                     "$XDG_RUNTIME_DIR/otel-gpu-census, else /tmp/otel-gpu-census-<uid>, where segments of "
                     "processes that ended over a day ago are removed when run starts)")
    run.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    run.add_argument("--requests", type=positive_int, metavar="N",
                     help="print per-request figures over N requests, while serving (start-up left out)")
    run.add_argument("--exporter", choices=EXPORTERS,
                     help="export census metrics while CMD runs (default: as OTEL_METRICS_EXPORTER and "
                     "OTEL_EXPORTER_OTLP_ENDPOINT say, else none)")
    run.add_argument("--prometheus-port", type=_port, metavar="PORT", help="port of the Prometheus endpoint")
    run.add_argument("--metrics-interval", type=metrics_interval, metavar="SECONDS",
                     help="seconds between metric exports")
    run.add_argument("--precise", action="store_true",
                     help="CUPTI's measured records of every kernel and copy (kernel and copy time, busy), at CUPTI's "
                          "price on every CUDA call (sets OTEL_GPU_CENSUS_COLLECTOR=precise). Default: every launch, "
                          "copy and memset counted at its CUDA call by the census library preloaded, kernel time from "
                          "CUDA event pairs, CUPTI never loaded")
    run.add_argument("--proxy", metavar="HOST:PORT",
                     help="also run the tracing proxy for llama-server / Ollama, listening on HOST:PORT: one "
                     "span per request, with the GPU work of the command attributed to it (see `proxy --help`; "
                     "traces export as OTEL_TRACES_EXPORTER and OTEL_EXPORTER_OTLP_* say)")
    run.add_argument("--upstream", metavar="URL",
                     help="with --proxy: where the server listens (default: from the command's --host/--port "
                     "or LLAMA_ARG_HOST/LLAMA_ARG_PORT, else http://127.0.0.1:8080)")
    run.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ARGS", help="the command to run")
    run.set_defaults(func=_cmd_run, parser=run)

    rep = sub.add_parser("report", help="report on the census segments in a folder",
                         description="Print, per process and device, kernel count and time, busy %, and copies "
                         "by direction with exact bytes.")
    rep.add_argument("dir", nargs="?", metavar="DIR", help="census folder or one .seg file (default: as for run)")
    rep.add_argument("--requests", type=request_counts, metavar="N",
                     help="print per-request figures over N requests, while serving (start-up left out; with "
                     "--diff: over the whole runs, N, or NA,NB for each side)")
    rep.add_argument("--request-log", metavar="FILE",
                     help="when each request was in flight: JSON lines with start_time_unix_nano and "
                     "end_time_unix_nano (optional first_token_time_unix_nano), or OTLP JSON traces (SERVER "
                     "spans); adds where GPU time went next to requests in flight, and the diagnoses that need it")
    rep.add_argument("--sm-occupancy", type=ratio, metavar="RATIO",
                     help="SM occupancy NVML GPM measured over the run (gpu_census.sm.occupancy, 0..1 or N%%), "
                     "for the diagnosis of kernels that fill little of the chip")
    rep.add_argument("--diff", nargs=2, metavar=("A", "B"),
                     help="compare two runs (census folders or .seg files): every figure of A and B and the change")
    rep.add_argument("--by", choices=("tenant", "model"),
                     help="each tenant's (gpu_census.tenant) or model's (LoRA adapter's) share of the engines' GPU "
                     "work, from the vLLM and SGLang integrations' request logs, with what no request was in, "
                     "adding up to the census")
    rep.add_argument("--json", action="store_true", help="print JSON instead of text")
    rep.add_argument("--pid", type=positive_int, help="only this process and its descendants")
    rep.set_defaults(func=_cmd_report, parser=rep)

    env = sub.add_parser("env", help="print the environment that puts a process under the census, for a "
                         "container or unit that cannot use `run`",
                         description="Print, as shell assignments, the variables `run` gives its command: set them in "
                         "a container or service unit and every CUDA process started there is censused exactly as "
                         "under `run`. Example: eval \"$(otel-gpu-census env --dir /var/run/census)\".")
    env.add_argument("--dir", help="census folder (default: as for run)")
    env.add_argument("--precise", action="store_true", help="the precise collector (CUPTI), as `run --precise`")
    env.add_argument("--format", choices=("sh", "docker", "systemd"), default="sh",
                     help="sh: export NAME=VALUE lines (default); docker: --env-file lines; systemd: Environment= lines")
    env.set_defaults(func=_cmd_env)

    doc = sub.add_parser("doctor", help="check driver, CUPTI, NVML and the injector, in plain words")
    doc.set_defaults(func=_cmd_doctor)

    prox = sub.add_parser("proxy", help="HTTP proxy for llama.cpp / Ollama that attributes GPU work to requests",
                          description="HTTP proxy for llama.cpp / Ollama servers: one span per request, with "
                          "TTFT and the GPU work attributed to it.")
    try:
        add_proxy_arguments(prox)
        prox.set_defaults(func=_cmd_proxy)
    except ImportError as e:      # a broken proxy must not take run/report/doctor down with it
        prox.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        prox.set_defaults(func=lambda args, err=e: _unavailable("proxy", err))
    return p


def _unavailable(verb: str, error: Exception) -> int:
    _say(f"{verb} is not available: {error}")
    return 1


def _version() -> str:
    from otel_gpu_census._native import LAYOUT_VERSION
    from otel_gpu_census.version import installed_version
    return f"{PROG} {installed_version() or '(not installed)'}, segment layout {LAYOUT_VERSION}"


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        print(_version())
        return 0
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        code = args.func(args)
        sys.stdout.flush()         # here, where a failure is one line, not at the interpreter's exit
        return code
    except ImportError as e:     # e.g. the header or cffi missing from a broken install
        _say(f"cannot load its own modules ({e}); reinstall otel-gpu-census, or run `{PROG} doctor`")
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:        # `report | head`
        sys.stderr.close()
        return 0
    except OSError as e:
        if e.errno not in _OUTPUT_ERRORS:
            raise
        _say(f"cannot write its output: {e.strerror}")      # stdout on a full disk, a dead device
        _silence_stdout()
        return 1


_OUTPUT_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG}


def _silence_stdout() -> None:
    """What is still buffered for stdout goes nowhere, so the interpreter's last flush cannot fail too."""
    try:
        null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        os.dup2(null, 1)
        os.close(null)
        sys.stdout.flush()
    except (OSError, ValueError, AttributeError):
        pass


if __name__ == "__main__":
    sys.exit(main())
