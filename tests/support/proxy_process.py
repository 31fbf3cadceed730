"""The proxy as a user starts it (`python -m otel_gpu_census.integrations.llamacpp`, this checkout's src/), configured
by OTEL_* variables only, for tests that watch it from outside."""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

SRC = Path(__file__).resolve().parents[2] / "src"


def start_proxy(args: Sequence[str], env_extra: Optional[Dict[str, str]] = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(SRC)
    env.update(env_extra or {})
    return subprocess.Popen([sys.executable, "-m", "otel_gpu_census.integrations.llamacpp", *args], env=env,
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)


def listening_port(proc: subprocess.Popen, timeout: float = 20.0) -> Tuple[int, List[str]]:
    """The port from the proxy's "listening on" line, and the lines it wrote before it."""
    deadline = time.monotonic() + timeout
    lines: List[str] = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"listening on http://[^:]+:(\d+)", line)
        if m:
            return int(m.group(1)), lines
    proc.kill()
    raise AssertionError("proxy did not start: " + "".join(lines))


@contextlib.contextmanager
def in_thread_proxies(default_upstream: str):
    """make(upstream=None, **config): a proxy in this process's threads (no GPU reading), its spans in
    memory (`h.spans`); every one made is stopped at the end."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from otel_gpu_census.integrations.llamacpp import ProxyConfig, start_proxy_in_thread
    running = []

    def make(upstream=None, **cfg):
        spans = InMemorySpanExporter()
        tp = TracerProvider()
        tp.add_span_processor(SimpleSpanProcessor(spans))
        h = start_proxy_in_thread(ProxyConfig(upstream=upstream or default_upstream, listen_port=0, gpu=False,
                                              **cfg), tp, MeterProvider())
        h.spans = spans
        running.append(h)
        return h
    try:
        yield make
    finally:
        for h in running:
            h.stop()
