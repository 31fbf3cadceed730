"""A tracing reverse proxy for llama-server and Ollama: one span per request, with its GPU cost.

Standalone::

    otel-gpu-census proxy --upstream http://127.0.0.1:8080 --listen 127.0.0.1:8081

Beside a server started under the census (what ``otel-gpu-census run --proxy`` does)::

    from otel_gpu_census.integrations.llamacpp import ProxyConfig, start_proxy_in_thread, upstream_from_server_args
    upstream, prefix = upstream_from_server_args(server_argv)
    handle = start_proxy_in_thread(ProxyConfig(upstream=upstream, listen_host="127.0.0.1",
                                               listen_port=8081, census_dir=dir, upstream_pid=child.pid,
                                               api_prefix=prefix))
    ...
    handle.stop()

Modules: config (options), routes (which requests are model work), stream (facts from a copy of the
answer), spans (llama-server's and Ollama's facts as attributes), upstream (pooled connections),
server (the aiohttp proxy). The rest is the engine-neutral core: the request lifecycle
(``telemetry.request``), the wait for the census and the per-request cost (``attribution.ledger``),
providers from OTEL_* variables (``telemetry.setup``).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import threading
from typing import List, Optional

from otel_gpu_census.integrations.llamacpp.config import (ConfigError, ProxyConfig, add_proxy_arguments, config_from_args,
                     upstream_from_server_args)

# service.name of the proxy's spans and metrics where OTEL_SERVICE_NAME names none: the server they describe (an
# Ollama user sets OTEL_SERVICE_NAME=ollama)
SERVICE_NAME = "llama.cpp"

__all__ = ["ProxyConfig", "ConfigError", "add_proxy_arguments", "config_from_args", "run_proxy",
           "start_proxy_in_thread", "ProxyThread", "upstream_from_server_args"]

log = logging.getLogger("otel_gpu_census.proxy")


def _say(msg: str) -> None:
    print(f"otel-gpu-census proxy: {msg}", file=sys.stderr, flush=True)


def _describe(cfg: ProxyConfig, port: int, proxy) -> str:
    src = proxy.ledger.source
    if src is None:
        census = "no census folder: spans carry no GPU cost"
    else:
        census = f"census {src.directory}" + (f", pid {src.pid} and children" if src.pid else ", every process")
    return f"listening on http://{cfg.listen_host}:{port} → {proxy.upstream_shown} ({census})"


class ProxyThread:
    """A proxy running on its own event loop in a daemon thread."""

    def __init__(self, config: ProxyConfig, tracer_provider=None, meter_provider=None, census_source=None):
        self.config = config
        self._providers = (tracer_provider, meter_provider)
        self._census_source = census_source
        self._telemetry = None
        self.proxy = None
        self.port: Optional[int] = None
        self.error: Optional[BaseException] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stop: Optional[asyncio.Event] = None
        self._drain_s = 0.0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="otel-gpu-census-proxy", daemon=True)

    @property
    def url(self) -> str:
        host = self.config.listen_host
        host = "127.0.0.1" if host in ("0.0.0.0", "") else f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    def describe(self) -> str:
        """'listening on URL → upstream (census ...)', for a start-up message."""
        return _describe(self.config, self.port, self.proxy)

    def descriptions(self) -> List[str]:
        """Where the signals of the providers this proxy built go ('traces → …', 'metrics → …');
        nothing for providers the caller gave."""
        return list(self._telemetry.descriptions) if self._telemetry is not None else []

    def served(self) -> List[tuple]:
        """(start, end, first token or None), wall ns, of each model request the proxy served (the last
        SERVED_KEPT), in the order they ended."""
        return list(self.proxy.served) if self.proxy is not None else []

    def start(self, timeout: float = 30.0) -> "ProxyThread":
        self._thread.start()
        if not self._ready.wait(timeout):
            raise RuntimeError("the proxy did not start in time")
        if self.error is not None:
            raise self.error
        return self

    def _main(self) -> None:
        from otel_gpu_census.integrations.llamacpp.server import Proxy
        tp, mp = self._providers
        try:
            if tp is None or mp is None:
                from otel_gpu_census.telemetry.setup import build_telemetry
                self._telemetry = build_telemetry(traces=tp is None, metrics=mp is None,
                                                  service_name=SERVICE_NAME)
                tp = tp or self._telemetry.tracer_provider
                mp = mp or self._telemetry.meter_provider
            self._loop = asyncio.new_event_loop()
            self.proxy = Proxy(self.config, tp, mp, self._census_source)
            self._loop.run_until_complete(self._serve())
        except BaseException as e:       # reported to the starter through start()
            self.error = e
            self._ready.set()
        finally:
            if self._loop is not None:
                self._loop.close()
            if self._telemetry is not None:
                self._telemetry.shutdown()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        await self.proxy.start()
        self.port = self.proxy.port
        self._ready.set()
        await self._stop.wait()
        await self.proxy.stop(self._drain_s)

    def stop(self, timeout: float = 10.0, drain_s: float = 0.0) -> None:
        """Stop accepting, finish spans (GPU cost as far as the census has it), flush telemetry.
        With drain_s, spans still waiting for the census get that long to finish normally first."""
        self._drain_s = drain_s
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout + drain_s)


def start_proxy_in_thread(config: ProxyConfig, tracer_provider=None, meter_provider=None,
                          census_source=None) -> ProxyThread:
    """Start the proxy beside the caller; returns once it listens (``.url``, ``.port``, ``.stop()``).

    A provider not given is built from the OTEL_* variables and shut down (flushed) by ``stop()``;
    given providers are used and left to the caller. Raises OSError when it cannot listen and
    ConfigError when the upstream is the proxy's own address."""
    return ProxyThread(config, tracer_provider, meter_provider, census_source).start()


def run_proxy(args: argparse.Namespace) -> int:
    """`otel-gpu-census proxy`: run until SIGINT/SIGTERM. Returns the exit status."""
    from otel_gpu_census.extras import missing
    lacking = missing("proxy")
    if lacking:
        _say(lacking)
        return 2
    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        _say(str(e))
        return 2
    logging.basicConfig(level=logging.WARNING, format="otel-gpu-census proxy: %(message)s")
    from otel_gpu_census.integrations.llamacpp.server import Proxy
    from otel_gpu_census.telemetry.setup import build_telemetry
    try:
        tel = build_telemetry(service_name=SERVICE_NAME)
    except Exception as e:
        _say(f"cannot set up telemetry: {type(e).__name__}: {e}")
        return 2

    async def main() -> int:
        proxy = Proxy(cfg, tel.tracer_provider, tel.meter_provider)
        try:
            await proxy.start()
        except ConfigError as e:
            _say(str(e))
            await proxy.stop()
            return 2
        except OSError as e:
            _say(f"cannot listen on {cfg.listen_host}:{cfg.listen_port}: {e.strerror or e}")
            await proxy.stop()
            return 1
        # the stop signals are ours before anything says the proxy is up: a supervisor that stops it as soon as it
        # reads that line gets the orderly stop
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):
                pass
        _say(_describe(cfg, proxy.port, proxy))
        for d in tel.descriptions:
            _say(d)
        await stop.wait()
        _say("stopping: finishing open spans")
        await proxy.stop()
        return 0

    try:
        return asyncio.run(main())
    except KeyboardInterrupt:
        return 130
    finally:
        tel.shutdown()
