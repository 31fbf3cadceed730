"""Anything a user, a client or an upstream supplied, made safe for telemetry and logs: the one place.

- Credentials in a URL (``http://user:password@host``) become ``REDACTED:REDACTED``, as the
  OpenTelemetry conventions ask of ``url.full``; in free text too (an error message that quotes a URL).
- Values of query parameters that carry secrets (``api_key``, ``key``, ``token``, ``signature``,
  ``password``, ...) become ``REDACTED`` (``url.query``, and URLs in free text).
- A header line that carries a secret (``Authorization: ...``, ``X-Api-Key: ...``) keeps its name only.
- Characters that are not printable are escaped (``\\x1b``, ``\\u202e``): no terminal escape or
  bidirectional override reaches a log reader or a trace viewer.
- Text is cut to a length, and integers outside the int64 OTLP can carry are left out: a client's
  text must not make an attribute or a log line unbounded, nor a number make an export fail.

Headers and prompts are never put into telemetry or logs at all; nothing here needs to see them.
"""
from __future__ import annotations

import math
import re
from typing import Any, Dict, Mapping, Optional
from urllib.parse import unquote

REDACTED = "REDACTED"
TEXT_LIMIT = 1024                      # characters of one attribute value or one quoted item in a log line
INT64 = (-(1 << 63), (1 << 63) - 1)

# Parameter and header names (lower case, '-' '_' '.' removed) that carry a secret: exact, or containing one of
# the parts (x-goog-signature, hf_token, client_secret, X-Amz-Credential, aws_access_key_id ...), but not a count
# of tokens (max_tokens).
_SECRET_NAMES = frozenset({"key", "sig", "pwd", "code", "jwt", "cookie", "setcookie"})
_SECRET_PARTS = re.compile(r"token(?!s)|secret|passw|apikey|accesskey|privatekey|signature|credential|auth|session")

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>`]*[^\s\"'<>`:,.;)]")   # not a trailing ':', '.' ...
# "Name: value" of a header that carries a secret, in free text (a peer's error message quoting a header)
_HEADER = re.compile(r"(?i)\b([A-Za-z0-9-]*(?:authorization|api-key|apikey|token|secret|cookie|"
                     r"x-amz-security-token))(\s*:\s*)[^\r\n'\"]*")
# what a parser's error message quotes of its input: b'...', '...', "..."
_QUOTED = re.compile(r"""b?'(?:[^'\\]|\\.)*'|b?"(?:[^"\\]|\\.)*\"""")


def secret_name(name: str) -> bool:
    """Whether a query parameter or header called `name` carries a secret."""
    n = unquote(name).lower().replace("-", "").replace("_", "").replace(".", "")
    return n in _SECRET_NAMES or _SECRET_PARTS.search(n) is not None


def query(qs: str) -> str:
    """A query string with the values of secret-carrying parameters replaced by REDACTED."""
    if not qs:
        return qs
    parts = qs.split("&")
    for i, part in enumerate(parts):
        name, eq, _ = part.partition("=")
        if eq and secret_name(name):
            parts[i] = f"{name}={REDACTED}"
    return "&".join(parts)


def url(text: str) -> str:
    """A URL without its credentials (``REDACTED:REDACTED@``) and without secret query values.
    Also a malformed one: everything between ``://`` and the last ``@`` before the query is userinfo."""
    scheme, sep, rest = text.partition("://")
    if not sep:
        return text
    cut = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    where, tail = rest[:cut], rest[cut:]
    at = where.rfind("@")
    if at >= 0:
        where = f"{REDACTED}:{REDACTED}@" + where[at + 1:]
    if tail.startswith("?"):
        q, hash_, frag = tail[1:].partition("#")
        tail = "?" + query(q) + hash_ + frag
    return f"{scheme}://{where}{tail}"


def printable(text: str, lines: bool = False) -> str:
    """`text` with every character that is not printable escaped (``\\x1b``, ``\\n``, ``\\u202e``);
    `lines`: newlines kept (a report of many lines)."""
    if (text.replace("\n", "") if lines else text).isprintable():
        return text
    return "".join(c if c.isprintable() or (lines and c == "\n") else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def cut(text: str, limit: int = TEXT_LIMIT) -> str:
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def text(value: Any, limit: int = TEXT_LIMIT) -> str:
    """Free text for a log line, a span status or an error body: URLs in it without credentials or
    secret query values, secret header values dropped, non-printables escaped, cut to `limit`."""
    s = str(value)
    if "://" in s:
        s = _URL.sub(lambda m: url(m.group(0)), s)
    if ":" in s:
        s = _HEADER.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", s)
    return printable(cut(s, limit))


def reason(message: Any, limit: int = 200) -> str:
    """A parser's or a peer's error message without the input it quotes (``b'Authorization: ...'``,
    a request line with its query): the reason only, on one line."""
    s = _QUOTED.sub("…", str(message).split("\n\n", 1)[0])
    return text(" ".join(s.split()).rstrip(":"), limit)


def value(v: Any) -> Optional[Any]:
    """One attribute value made safe, or None to leave the attribute out: strings as :func:`text`
    (but URLs and headers are not looked for: a string attribute is one item), integers inside
    int64, floats finite; sequences item by item."""
    if isinstance(v, str):
        return printable(cut(v))
    if isinstance(v, bool):
        return v
    if isinstance(v, int):
        return v if INT64[0] <= v <= INT64[1] else None
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, (list, tuple)):
        items = [value(x) for x in v]
        return None if any(x is None for x in items) else items
    return v


def attributes(attrs: Mapping[str, Any]) -> Dict[str, Any]:
    """Span attributes with every value made safe (:func:`value`); the ones that cannot be left out."""
    out = {}
    for k, v in dict(attrs).items():
        safe = value(v)
        if safe is not None:
            out[k] = safe
    return out
