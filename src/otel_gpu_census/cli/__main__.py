"""`python -m otel_gpu_census.cli ...`: the same as `otel-gpu-census ...`."""
import sys

from otel_gpu_census.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
