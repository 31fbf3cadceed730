"""Who a request's GPU share is charged to: its tenant, read once when the request arrives.

The tenant comes from what ``OTEL_GPU_CENSUS_TENANT`` names (:func:`source`):

- ``baggage`` (the default): the W3C baggage entry ``gpu_census.tenant`` (:data:`BAGGAGE_KEY`). Baggage is
  what the *caller* says: behind a gateway that sets it (and drops a client's own) it is the gateway's word,
  otherwise any client can name any tenant. ``off`` turns it off;
- ``header:NAME``: request header NAME (one header, e.g. ``header:x-tenant-id``), read before baggage
  (``header:NAME,baggage`` reads both, the header first);
- ``off``: no tenant is read; every request is ``unknown``.

A credential is never a tenant id: the value of a header whose name carries a secret (``authorization``,
``x-api-key``, ...: ``redact.secret_name``) and any value that looks like one (``Bearer ...``, ``sk-...``) is
kept as ``sha256:`` and the first 16 hex digits of its SHA-256 (:func:`clean`): the same key always charges the
same tenant, and the key itself is nowhere. Other values are stripped, non-printables escaped, cut to
TENANT_CHARS; a request without one is ``unknown``. A client's baggage header is read only within the W3C
limits (:func:`baggage_problem`: the proxy drops one past them whole); nothing here logs what a client sent.

The metrics label at most ``instruments.TENANT_LABELS`` tenants (then ``_OTHER``); spans keep the value.
No web framework is imported: the engines' API servers and schedulers load this as is.
"""
from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional
from urllib.parse import unquote

from otel_gpu_census.telemetry import redact

log = logging.getLogger("otel_gpu_census.telemetry")

TENANT_ENV = "OTEL_GPU_CENSUS_TENANT"
BAGGAGE_KEY = "gpu_census.tenant"          # the W3C baggage entry a caller names its tenant with
TENANT = "gpu_census.tenant"               # the span and metric attribute
UNKNOWN = "unknown"
TENANT_CHARS = 128                         # characters of a tenant kept (a longer one is cut)
HEADER_CHARS = 256                         # a header value read at most this far (the rest is cut)

# W3C Baggage limits (also OpenTelemetry's): a client's header past them is dropped whole.
BAGGAGE_MAX_BYTES = 8192
BAGGAGE_MAX_MEMBERS = 180
BAGGAGE_MAX_MEMBER_BYTES = 4096
_CREDENTIAL_PREFIXES = ("bearer ", "basic ", "token ", "sk-", "hf_", "ghp_", "xoxb-", "eyj")


@dataclass(frozen=True)
class Source:
    """Where a request's tenant is read: `header` (lower case, '' for none) first, then baggage."""

    header: str = ""
    baggage: bool = True

    @property
    def off(self) -> bool:
        return not self.header and not self.baggage


DEFAULT = Source()


def source(env: Mapping[str, str] = os.environ) -> Source:
    """OTEL_GPU_CENSUS_TENANT as a Source; a value it cannot read: one line, and the default (baggage)."""
    raw = (env.get(TENANT_ENV) or "baggage").strip()
    header, baggage, bad = "", False, False
    for part in (p.strip() for p in raw.split(",")):
        low = part.lower()
        if low == "baggage":
            baggage = True
        elif low == "off" and raw.lower() == "off":
            pass
        elif low.startswith("header:") and _token(low[7:].strip()) and not header:
            header = low[7:].strip()
        else:
            bad = True
    if bad:
        log.warning("%s=%s: expected baggage, header:NAME, header:NAME,baggage or off; the tenant is read from "
                    "baggage (%s)", TENANT_ENV, redact.text(raw, 80), BAGGAGE_KEY)
        return DEFAULT
    return Source(header, baggage)



_configured: Optional[Source] = None


def configured() -> Source:
    """OTEL_GPU_CENSUS_TENANT as this process's hooks read it: once (a bad value said once)."""
    global _configured
    if _configured is None:
        _configured = source()
    return _configured

def _token(name: str) -> bool:
    """An HTTP header name (RFC 9110 token characters)."""
    return bool(name) and len(name) <= 128 and all(c.isalnum() and c.isascii() or c in "!#$%&'*+-.^_`|~"
                                                     for c in name)


def baggage_problem(values: Iterable[str]) -> Optional[str]:
    """Why a client's baggage header(s) must be dropped whole, or None. Says what is wrong, never what was sent."""
    values = list(values)
    n = sum(len(v) for v in values) + max(0, len(values) - 1)
    if n > BAGGAGE_MAX_BYTES:
        return f"{n} bytes, over the {BAGGAGE_MAX_BYTES} W3C Baggage allows"
    joined = ",".join(values)
    if not (joined.isascii() and joined.isprintable()):
        return "characters outside printable ASCII"
    members = joined.split(",")
    if len(members) > BAGGAGE_MAX_MEMBERS:
        return f"{len(members)} members, over the {BAGGAGE_MAX_MEMBERS} W3C Baggage allows"
    if any(len(m) > BAGGAGE_MAX_MEMBER_BYTES for m in members):
        return f"a member over the {BAGGAGE_MAX_MEMBER_BYTES} bytes W3C Baggage allows"
    return None


def baggage_value(values: Iterable[str], key: str = BAGGAGE_KEY) -> Optional[str]:
    """The value of baggage entry `key` (its first), percent-decoded; None where there is none or the
    header(s) break the W3C limits."""
    values = [v for v in values if isinstance(v, str)]
    if not values or baggage_problem(values) is not None:
        return None
    for member in ",".join(values).split(","):
        name, eq, rest = member.partition("=")
        if eq and name.strip() == key:
            return unquote(rest.split(";", 1)[0].strip())
    return None


def clean(value: Any, secret: bool = False) -> Optional[str]:
    """A tenant as telemetry may carry it, or None for none: a credential (`secret`, or a value that looks
    like one) as ``sha256:`` + 16 hex digits, anything else stripped, escaped and cut."""
    if not isinstance(value, str):
        return None
    value = value[:HEADER_CHARS * 16].strip()
    if not value:
        return None
    if secret or value.lower().startswith(_CREDENTIAL_PREFIXES):
        return "sha256:" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    if len(value) > TENANT_CHARS:
        value = value[:TENANT_CHARS] + "…"
    return redact.printable(value)


def _get(headers: Any, name: str) -> list:
    """Every value of header `name` (lower case) of a multidict, a dict of any case, or pairs."""
    getall = getattr(headers, "getall", None)
    if getall is not None:
        return list(getall(name, ()))
    items = headers.items() if hasattr(headers, "items") else headers
    return [v for k, v in items if isinstance(k, str) and k.lower() == name and isinstance(v, str)]


def of_headers(headers: Any, src: Optional[Source] = None) -> Optional[str]:
    """The tenant of a request with these HTTP headers, or None; never raises for what a client sent."""
    src = source() if src is None else src
    try:
        if src.header:
            got = _get(headers, src.header)
            if got:
                return clean(got[0][:HEADER_CHARS * 16], secret=redact.secret_name(src.header))
        if src.baggage:
            return clean(baggage_value(_get(headers, "baggage")))
    except Exception:             # a header object of a kind never seen: no tenant, not a failure
        log.debug("tenant: could not read the headers", exc_info=True)
    return None
