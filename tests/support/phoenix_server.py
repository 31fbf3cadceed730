"""A real Arize Phoenix server for tests: started on free loopback ports with its data in a folder of
the caller's, read back through its own REST API, stopped on demand.

Phoenix lives in a virtual environment of its own (tests/support_phoenix.sh); :func:`find` says where,
or why not.

    ph = Phoenix(find()[0], tmp_dir).start()
    spans = ph.wait_for_spans(trace_id, lambda ss: len(ss) >= 2)
    ph.stop()
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from ports import free_port

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = Path(__file__).resolve().parent / "phoenix_loopback.py"
DEFAULT_VENV = ROOT / ".venv-phoenix"


def find() -> Tuple[Optional[Path], str]:
    """(the `phoenix` command, "") or (None, why there is none)."""
    env = os.environ.get("PHOENIX_BIN")
    cand = Path(env) if env else DEFAULT_VENV / "bin" / "phoenix"
    # the default venv counts once tests/support_phoenix.sh finished it (an install that failed half-way
    # is a reason to skip, not a failure)
    finished = env or (DEFAULT_VENV / ".installed").is_file()
    if finished and cand.is_file() and os.access(cand, os.X_OK) and (cand.parent / "python").exists():
        return cand, ""
    where = f"PHOENIX_BIN={env}" if env else str(cand)
    return None, (f"Arize Phoenix is not installed ({where} is not its command): tests/support_phoenix.sh "
                  "installs it into .venv-phoenix (it needs PyPI)")


class Phoenix:
    def __init__(self, command: Path, workdir: Path, host: str = "127.0.0.1"):
        self.command, self.workdir, self.host = Path(command), Path(workdir), host
        self.http_port = self.grpc_port = 0
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = self.workdir / "phoenix.log"

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, timeout: float = 150.0) -> "Phoenix":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.http_port, self.grpc_port = free_port(), free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "PHOENIX_"))}
        env.update({
            "PHOENIX_HOST": self.host, "PHOENIX_PORT": str(self.http_port),
            "PHOENIX_GRPC_PORT": str(self.grpc_port), "PHOENIX_WORKING_DIR": str(self.workdir / "data"),
            # no fonts, pixels or downloads from outside, no assistant that runs shell commands
            "PHOENIX_TELEMETRY_ENABLED": "false", "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false",
            "PHOENIX_DISABLE_AGENT_ASSISTANT": "true", "PHOENIX_AGENTS_DISABLE_BASH": "true",
        })
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([str(self.command.parent / "python"), str(LOOPBACK)], env=env,
                                     stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"phoenix exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self._healthy() and self._grpc_listening():
                return self
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"phoenix did not answer on :{self.http_port} within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def _healthy(self) -> bool:
        try:
            return urllib.request.urlopen(f"{self.url}/healthz", timeout=2).status == 200
        except (OSError, urllib.error.URLError):
            return False

    def _grpc_listening(self) -> bool:
        try:
            socket.create_connection((self.host, self.grpc_port), timeout=1).close()
            return True
        except OSError:
            return False

    # -- where to send, where to look ----------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def otlp_grpc(self) -> str:
        """OTEL_EXPORTER_OTLP_ENDPOINT for OTEL_EXPORTER_OTLP_PROTOCOL=grpc."""
        return f"http://{self.host}:{self.grpc_port}"

    @property
    def otlp_http(self) -> str:
        """OTEL_EXPORTER_OTLP_ENDPOINT for http/protobuf (the exporter adds /v1/traces)."""
        return self.url

    def span_url(self, span_id: str) -> str:
        """The UI page of a trace with this span selected (Phoenix redirects by OTel span id)."""
        return f"{self.url}/redirects/spans/{span_id}"

    # -- the REST API ----------------------------------------------------------------------------
    def _get(self, path: str, **query) -> Dict:
        q = urllib.parse.urlencode(query, doseq=True)
        with urllib.request.urlopen(f"{self.url}{path}?{q}", timeout=10) as r:
            return json.loads(r.read())

    def spans(self, trace_id: str, project: str = "default") -> List[Dict]:
        """Every stored span of one trace: {"name", "context": {"trace_id", "span_id"}, "parent_id",
        "attributes": {dotted key: value}, "start_time", "end_time", "status_code", ...}."""
        return self._get(f"/v1/projects/{project}/spans", trace_id=[trace_id], limit=1000)["data"]


    def wait_for_spans(self, trace_id: str, pred: Callable[[List[Dict]], bool], timeout: float = 20.0) -> List[Dict]:
        deadline = time.monotonic() + timeout
        got: List[Dict] = []
        while time.monotonic() < deadline:
            got = self.spans(trace_id)
            if pred(got):
                return got
            time.sleep(0.2)
        raise AssertionError(f"Phoenix holds {[s['name'] for s in got]} for trace {trace_id} after {timeout} s")

    def listening(self) -> List[Tuple[str, int]]:
        """(address, port) of every TCP socket this server listens on (from /proc)."""
        if self.proc is None:
            return []
        inodes = set()
        fd_dir = Path(f"/proc/{self.proc.pid}/fd")
        for fd in fd_dir.iterdir():
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
        out = []
        for name, width in (("tcp", 8), ("tcp6", 32)):
            for line in Path(f"/proc/{self.proc.pid}/net/{name}").read_text().splitlines()[1:]:
                f = line.split()
                if f[3] != "0A" or f[9] not in inodes:          # 0A: LISTEN
                    continue
                addr, port = f[1].split(":")
                out.append((_proc_address(addr, width), int(port, 16)))
        return out


def _proc_address(hexaddr: str, width: int) -> str:
    raw = bytes.fromhex(hexaddr)
    # /proc writes each 32-bit word in host (little-endian) order
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if width == 8 else socket.AF_INET6, raw)
