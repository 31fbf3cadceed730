"""The llama.cpp / Ollama proxy under its first name: ``python -m otel_gpu_census.proxy`` and
``from otel_gpu_census.proxy import ...`` keep working. It lives in ``integrations/llamacpp``."""
from __future__ import annotations

import sys

from .integrations.llamacpp import (ConfigError, ProxyConfig, ProxyThread, add_proxy_arguments, config_from_args,
                                    run_proxy, start_proxy_in_thread, upstream_from_server_args)

__all__ = ["ProxyConfig", "ConfigError", "add_proxy_arguments", "config_from_args", "run_proxy",
           "start_proxy_in_thread", "ProxyThread", "upstream_from_server_args"]

if __name__ == "__main__":
    from .integrations.llamacpp.__main__ import main
    sys.exit(main())
