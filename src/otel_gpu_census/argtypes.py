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


def positive_float(text: str) -> float:
    v = _number(text, float, "a number")
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0: {text!r}")
    return v


def nonneg_float(text: str) -> float:
    v = _number(text, float, "a number")
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more: {text!r}")
    return v
