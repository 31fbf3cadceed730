"""argparse value types shared by the CLI and the proxy: a bad value is a clear usage error (exit 2)."""
from __future__ import annotations

import argparse


def _number(text: str, cast, what: str):
    try:
        return cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None


def positive_int(text: str) -> int:
    v = _number(text, int, "a whole number")
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return v


# Seconds, mostly; nanoseconds of this still fit in an int64 (inf, nan and 1e300 do not, and were
# a traceback deep inside the proxy).
MAX_FLOAT = 1e9


def _finite(text: str) -> float:
    v = _number(text, float, "a number")
    if v != v or abs(v) == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number: {text!r}")
    if v > MAX_FLOAT:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_FLOAT:.0f}: {text!r}")
    return v


def positive_float(text: str) -> float:
    v = _finite(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0: {text!r}")
    return v


MIN_METRICS_INTERVAL_S = 0.1    # the metrics sidecar reads every segment each interval; the SDK wants >= 1 ms


def metrics_interval(text: str) -> float:
    v = _finite(text)
    if not v >= MIN_METRICS_INTERVAL_S:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_METRICS_INTERVAL_S:g} seconds: {text!r}")
    return v


def nonneg_float(text: str) -> float:
    v = _finite(text)
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more: {text!r}")
    return v


WINDOW_MS = 20   # GC_WINDOW_NS: the sampling schedule is in whole windows


def request_counts(text: str):
    """N, or NA,NB (one count for each side of report --diff)."""
    parts = text.split(",")
    if len(parts) > 2:
        raise argparse.ArgumentTypeError(f"expected N or NA,NB: {text!r}")
    counts = tuple(positive_int(p.strip()) for p in parts)
    return counts[0] if len(counts) == 1 else counts


def ratio(text: str) -> float:
    """A ratio 0..1, or a percentage ending in %."""
    pct = text.endswith("%")
    v = _number(text[:-1] if pct else text, float, "a ratio or a percentage")
    v = v / 100.0 if pct else v
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1 (or 0% and 100%): {text!r}")
    return v
