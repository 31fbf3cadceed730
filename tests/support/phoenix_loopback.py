"""`phoenix serve` with its OTLP/gRPC receiver on PHOENIX_HOST too, run by Phoenix's own Python.

Phoenix 20.x binds the HTTP side (UI, REST API, OTLP/HTTP) to PHOENIX_HOST but its gRPC receiver to
``[::]:PHOENIX_GRPC_PORT`` whatever PHOENIX_HOST says (phoenix/server/grpc_server.py), so a test that
means to listen on the loopback only rewrites that one address and changes nothing else.

    .venv-phoenix/bin/python tests/support/phoenix_loopback.py      (environment as for `phoenix serve`)
"""
import os
import sys

import grpc.aio

HOST = os.environ.get("PHOENIX_HOST") or "127.0.0.1"
_server = grpc.aio.server


def _rebind(address: str) -> str:
    return f"{HOST}:{address[len('[::]:'):]}" if address.startswith("[::]:") else address


def server(*args, **kwargs):
    srv = _server(*args, **kwargs)
    insecure, secure = srv.add_insecure_port, srv.add_secure_port
    srv.add_insecure_port = lambda address: insecure(_rebind(address))
    srv.add_secure_port = lambda address, credentials: secure(_rebind(address), credentials)
    return srv


grpc.aio.server = server

if __name__ == "__main__":
    from phoenix.server.main import main
    sys.argv = ["phoenix", "serve"]
    sys.exit(main())
