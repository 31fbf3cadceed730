"""The OTLP/HTTP exporters' session, with a bound on what a collector's answer may cost.

requests reads a whole answer into memory before the exporter looks at its status: a collector (or
whatever answers at its address) that sends hundreds of MB back would take the process's memory with
it. An OTLP answer is a small protobuf (an ExportTraceServiceResponse, a partial-success message), so
this session reads at most MAX_RESPONSE_BYTES of it and drops the connection on the rest.
"""
from __future__ import annotations

import os

import requests

MAX_RESPONSE_BYTES = 1 << 20
READ_BYTES = 1 << 16


class BoundedSession(requests.Session):
    def request(self, method, url, **kwargs):
        kwargs["stream"] = True
        resp = super().request(method, url, **kwargs)
        body = bytearray()
        try:
            for chunk in resp.iter_content(READ_BYTES):
                body += chunk[:MAX_RESPONSE_BYTES - len(body)]
                if len(body) >= MAX_RESPONSE_BYTES:
                    break
        except (requests.RequestException, OSError):
            pass                       # the status is what the exporter reads; a broken body is no export failure
        finally:
            resp.close()               # what was not read goes with the connection
        resp._content, resp._content_consumed = bytes(body), True
        return resp


def session_kwargs() -> dict:
    """What to give an OTLP/HTTP exporter class: our session, unless a credential provider is configured
    (then the SDK's session from it is the one to use)."""
    if any(k.endswith("_CREDENTIAL_PROVIDER") and v for k, v in os.environ.items()):
        return {}
    return {"session": BoundedSession()}
