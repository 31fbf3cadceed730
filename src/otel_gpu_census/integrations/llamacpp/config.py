"""The proxy's settings, its command-line options, and where a llama-server listens."""
from __future__ import annotations

import argparse
import base64
import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Tuple

from otel_gpu_census.cli.argtypes import nonneg_float, positive_float
from otel_gpu_census.telemetry import redact

DEFAULT_LISTEN = "127.0.0.1:8081"
DEFAULT_MAX_BODY_BYTES = 256 << 20       # a request body larger than this gets 413
DEFAULT_UPSTREAM_TIMEOUT_S = 600.0       # longest silence from the upstream (before or between chunks)
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_UPSTREAM_KEEPALIVE_S = 4.0       # idle upstream connections kept; llama-server closes them at 5 s
DEFAULT_GPU_MARGIN_S = 1.2               # CUPTI delivers records up to ~1 s late
DEFAULT_GPU_MAX_WAIT_S = 3.0             # longest a span waits for the census after the response ended
DEFAULT_CLIENT_TIMEOUT_S = 15.0          # the deadline of every read of a client (and of its reading the answer)


class ConfigError(ValueError):
    """A setting that cannot be used; the message says which and why."""


@dataclass(frozen=True)
class ProxyConfig:
    upstream: str                         # http://HOST:PORT[/prefix] or unix:/path/to.sock
    listen_host: str = "127.0.0.1"
    listen_port: int = 8081
    census_dir: Optional[str] = None      # None: the default census folder, when it exists
    upstream_pid: Optional[int] = None    # the server process; None: every segment in the folder
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    upstream_timeout_s: float = DEFAULT_UPSTREAM_TIMEOUT_S
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    upstream_keepalive_s: float = DEFAULT_UPSTREAM_KEEPALIVE_S   # 0: a new connection per request
    gpu_margin_s: float = DEFAULT_GPU_MARGIN_S
    gpu_max_wait_s: float = DEFAULT_GPU_MAX_WAIT_S
    client_timeout_s: float = DEFAULT_CLIENT_TIMEOUT_S
    api_prefix: str = ""                  # llama-server --api-prefix
    gpu: bool = True                      # read the census at all
    loop_lag_s: float = 0.0               # > 0: the event-loop lag probe's interval (telemetry.loop_lag)

    @property
    def unix_socket(self) -> Optional[str]:
        return self.upstream[len("unix:"):] if self.upstream.startswith("unix:") else None

    @property
    def upstream_base(self) -> str:
        """Scheme, host, port and path prefix that every forwarded request starts with (credentials in
        the upstream's URL go as a header: upstream_authorization)."""
        if self.unix_socket is not None:
            return "http://localhost"
        from yarl import URL      # the [proxy] extra: the options parse without it (missing() names it)
        return str(URL(self.upstream).with_user(None)).rstrip("/")

    @property
    def upstream_authorization(self) -> Optional[str]:
        """``Basic ...`` from credentials in the upstream's URL, else None. Sent with a request whose
        client sent no Authorization header of its own (the proxy forwards what the client sent)."""
        if self.unix_socket is not None:
            return None
        from yarl import URL
        url = URL(self.upstream)
        if url.user is None and url.password is None:
            return None
        raw = f"{url.user or ''}:{url.password or ''}".encode("latin-1", "replace")
        return "Basic " + base64.b64encode(raw).decode("ascii")


def parse_host_port(text: str, what: str = "address") -> Tuple[str, int]:
    """'HOST:PORT', '[v6]:PORT' or ':PORT' (all interfaces) → (host, port)."""
    text = (text or "").strip()
    host, sep, port_s = text.rpartition(":")
    if not sep:
        raise ConfigError(f"{what} {text!r} must be HOST:PORT")
    host = host.strip("[]") or "0.0.0.0"
    try:
        port = int(port_s)
    except ValueError:
        raise ConfigError(f"{what} {text!r}: port {port_s!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{what} {text!r}: port {port} is out of range 0..65535")
    return host, port


def check_upstream(text: str) -> str:
    """Validate --upstream; returns it normalised (no trailing slash)."""
    text = (text or "").strip()
    if text.startswith("unix:"):
        if not text[len("unix:"):]:
            raise ConfigError("--upstream unix: needs a socket path, e.g. unix:/run/llama.sock")
        return text
    if "://" not in text:
        text = "http://" + text
    from yarl import URL             # the [proxy] extra: imported where a proxy is set up, not for --help
    # Messages never repeat credentials, nor the parser's words (they may quote a piece of a password).
    shown = repr(redact.url(text))
    why = (lambda e: "") if "@" in text else (lambda e: f": {redact.text(e)}")
    try:
        url = URL(text)
    except ValueError as e:
        raise ConfigError(f"--upstream {shown} is not a URL{why(e)}") from None
    if url.scheme not in ("http", "https"):
        raise ConfigError(f"--upstream {shown}: only http:// and https:// upstreams are supported")
    if not url.host:
        raise ConfigError(f"--upstream {shown} has no host")
    if url.query_string or url.fragment:
        raise ConfigError(f"--upstream {shown}: give scheme, host, port and an optional path prefix only")
    try:
        url.port
    except ValueError as e:
        raise ConfigError(f"--upstream {shown}: not a port{why(e)}") from None
    return str(url).rstrip("/")


_LOCAL = {"", "0.0.0.0", "::", "127.0.0.1", "::1", "localhost"}


def check_not_itself(listen_host: str, listen_port: int, upstream: str) -> None:
    """Refuse an upstream that is the proxy's own address: every request would forward to itself."""
    if upstream.startswith("unix:") or listen_port == 0:
        return
    from yarl import URL
    url = URL(upstream)
    host = (url.host or "").strip("[]")
    same_host = host == listen_host or (host in _LOCAL and listen_host in _LOCAL) or \
        (listen_host in ("0.0.0.0", "::") and host in _LOCAL)
    if same_host and url.port == listen_port:
        raise ConfigError(f"the proxy would forward to itself: it listens on {listen_host}:{listen_port} "
                          f"and its upstream is {redact.url(upstream)}; give the server and the proxy different "
                          "ports")


def _addresses(host: str, port: int) -> set:
    try:
        return {ai[4][0].split("%")[0] for ai in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return set()


def _this_machine(address: str) -> bool:
    """Whether `address` is one of this machine's own (it can be bound to)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


def forwards_to_itself(listen_host: str, port: int, upstream: str) -> bool:
    """check_not_itself for any name of this machine (its host name, another of its addresses), once the
    proxy listens on `port`: what the upstream's name resolves to is compared with where the proxy listens.
    Resolves names: call it off the event loop."""
    if upstream.startswith("unix:"):
        return False
    from yarl import URL
    url = URL(upstream)
    if url.port != port or not url.host:
        return False
    upstream_at = _addresses(url.host.strip("[]"), port)
    if listen_host in ("", "0.0.0.0", "::", "*"):
        return any(_this_machine(a) for a in upstream_at)
    return bool(upstream_at & _addresses(listen_host, port))


def _connectable(host: str) -> str:
    """A host a client can connect to for a server that listens on `host`."""
    if host in ("", "0.0.0.0", "*"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]"
    except ValueError:
        pass
    return host


def upstream_from_server_args(argv: Sequence[str], env: Mapping[str, str] = os.environ) -> Tuple[str, str]:
    """(upstream URL, api prefix) of a llama-server started with `argv`.

    Reads --host/--port/--api-prefix (also as --opt=value) and their LLAMA_ARG_HOST/LLAMA_ARG_PORT/
    LLAMA_ARG_API_PREFIX variables; the command line wins, as in llama-server. Defaults 127.0.0.1:8080.
    A host ending in .sock is a UNIX socket. Of several comma-separated hosts, the first is used.
    """
    host = env.get("LLAMA_ARG_HOST") or "127.0.0.1"
    port = env.get("LLAMA_ARG_PORT") or "8080"
    prefix = env.get("LLAMA_ARG_API_PREFIX") or ""
    args = list(argv)
    i = 0
    while i < len(args):
        a = args[i]
        name, eq, val = a.partition("=")
        if name in ("--host", "--port", "--api-prefix"):
            if not eq:
                if i + 1 >= len(args):
                    break
                val = args[i + 1]
                i += 1
            if name == "--host":
                host = val
            elif name == "--port":
                port = val
            else:
                prefix = val
        i += 1
    host = host.split(",")[0].strip()
    if host.endswith(".sock"):
        return "unix:" + host, prefix
    try:
        p = int(port)
    except ValueError:
        raise ConfigError(f"llama-server --port {port!r} is not a number") from None
    return f"http://{_connectable(host)}:{p}", prefix


# -----------------------------------------------------------------------------------------
# command line

def _size(text: str) -> int:
    t = text.strip().lower()
    mult = 1
    for suffix, m in (("kib", 1 << 10), ("mib", 1 << 20), ("gib", 1 << 30), ("k", 1 << 10),
                      ("m", 1 << 20), ("g", 1 << 30)):
        if t.endswith(suffix):
            t, mult = t[:-len(suffix)], m
            break
    try:
        v = int(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (bytes, or with k/m/g)") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def _pid(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a process id") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a process id")
    return v


def add_proxy_arguments(parser: argparse.ArgumentParser, upstream_required: bool = True) -> None:
    """Options of `otel-gpu-census proxy` (also used by `run --proxy` with upstream_required=False)."""
    parser.add_argument("--upstream", required=upstream_required, metavar="URL",
                        help="the server to forward to: http://HOST:PORT (llama-server, Ollama) or unix:/PATH.sock")
    parser.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
                        help=f"where the proxy listens (default {DEFAULT_LISTEN})")
    parser.add_argument("--dir", dest="census_dir", metavar="DIR",
                        help="census folder the server writes into (default: $OTEL_GPU_CENSUS_DIR, else the "
                        "default folder); GPU cost is left out of spans when it holds no segment")
    parser.add_argument("--upstream-pid", type=_pid, metavar="PID",
                        help="the server's process id: attribute only its GPU work and its children's "
                        "(default: every process with a segment in the census folder)")
    parser.add_argument("--max-body-bytes", type=_size, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                        help="largest request body forwarded; larger gets 413 (default 256m)")
    parser.add_argument("--upstream-timeout", type=positive_float, default=DEFAULT_UPSTREAM_TIMEOUT_S,
                        metavar="S", help="longest silence from the upstream, before the answer or between "
                        f"chunks, before giving up with 504 (default {DEFAULT_UPSTREAM_TIMEOUT_S:g} s)")
    parser.add_argument("--connect-timeout", type=positive_float, default=DEFAULT_CONNECT_TIMEOUT_S,
                        metavar="S", help=f"connect timeout (default {DEFAULT_CONNECT_TIMEOUT_S:g} s)")
    parser.add_argument("--upstream-keepalive", type=nonneg_float, default=DEFAULT_UPSTREAM_KEEPALIVE_S,
                        metavar="S", help="how long an idle upstream connection is kept for the next request; "
                        f"0: a new connection for every request (default {DEFAULT_UPSTREAM_KEEPALIVE_S:g} s, "
                        "below llama-server's 5 s)")
    parser.add_argument("--client-timeout", type=positive_float, default=DEFAULT_CLIENT_TIMEOUT_S, metavar="S",
                        help="longest a client may stay idle, take to send a request's headers, send no byte of "
                        "its request body (then 408) or take no byte of its answer before its connection is closed "
                        f"(default {DEFAULT_CLIENT_TIMEOUT_S:g} s)")
    parser.add_argument("--gpu-wait", type=nonneg_float, default=DEFAULT_GPU_MAX_WAIT_S, metavar="S",
                        help="how long a finished request's span waits for the census to cover its window "
                        f"(default {DEFAULT_GPU_MAX_WAIT_S:g} s)")
    parser.add_argument("--no-gpu", action="store_true", help="do not read the census (spans without GPU cost)")
    parser.add_argument("--loop-lag-probe", type=positive_float, metavar="MS",
                        help="measure the proxy's event-loop lag: wake every MS milliseconds and record how "
                        "late; figures at GET /.otel-gpu-census/loop-lag (?reset=1 starts a new period) and "
                        "in a line at exit (default off)")


def config_from_args(args: argparse.Namespace, upstream: Optional[str] = None,
                     upstream_pid: Optional[int] = None, api_prefix: str = "") -> ProxyConfig:
    """ProxyConfig from parsed options; `upstream`/`upstream_pid` fill in what `run` knows."""
    up = getattr(args, "upstream", None) or upstream
    if not up:
        raise ConfigError("no upstream: give --upstream http://HOST:PORT")
    host, port = parse_host_port(getattr(args, "listen", None) or DEFAULT_LISTEN, "--listen")
    wait = getattr(args, "gpu_wait", DEFAULT_GPU_MAX_WAIT_S)
    up = check_upstream(up)
    check_not_itself(host, port, up)
    return ProxyConfig(
        upstream=up,
        listen_host=host,
        listen_port=port,
        census_dir=getattr(args, "census_dir", None),
        upstream_pid=getattr(args, "upstream_pid", None) or upstream_pid,
        max_body_bytes=getattr(args, "max_body_bytes", DEFAULT_MAX_BODY_BYTES),
        upstream_timeout_s=getattr(args, "upstream_timeout", DEFAULT_UPSTREAM_TIMEOUT_S),
        connect_timeout_s=getattr(args, "connect_timeout", DEFAULT_CONNECT_TIMEOUT_S),
        upstream_keepalive_s=getattr(args, "upstream_keepalive", DEFAULT_UPSTREAM_KEEPALIVE_S),
        gpu_max_wait_s=wait,
        client_timeout_s=getattr(args, "client_timeout", DEFAULT_CLIENT_TIMEOUT_S),
        gpu_margin_s=min(DEFAULT_GPU_MARGIN_S, wait),
        api_prefix=api_prefix,
        gpu=not getattr(args, "no_gpu", False),
        loop_lag_s=(getattr(args, "loop_lag_probe", None) or 0.0) / 1000.0,
    )
