"""`python -m otel_gpu_census.integrations.llamacpp ...`: the same as `otel-gpu-census proxy ...`."""
import argparse
import sys

from otel_gpu_census.integrations.llamacpp import add_proxy_arguments, run_proxy


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="otel-gpu-census proxy",
                                     description="HTTP proxy for llama.cpp / Ollama servers: one span per "
                                     "request, with TTFT and the GPU work attributed to it.")
    add_proxy_arguments(parser)
    return run_proxy(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
