"""How the report writes a figure: exact integers, decimal sizes, seconds, shares, plurals.

Every module that prints figures (report, explain, diagnose, diff) takes them from here, so a byte
count reads the same everywhere and none of them imports another to format a number.
"""
from __future__ import annotations

from typing import Optional

DIRECTION_LABELS = {
    "htod": "host-to-device",
    "dtoh": "device-to-host",
    "dtod": "device-to-device",
    "ptop": "peer-to-peer sent",
    "htoh": "host-to-host",
    "other": "other copies",
    "managed_htod": "managed host-to-device",   # migrated by the driver, no copy call (precise collector)
    "managed_dtoh": "managed device-to-host",
}
UNITS_NOTE = "bytes are exact; MB = 10^6 bytes, GB = 10^9 bytes (decimal); times in seconds"

_SIZE_UNITS = (("B", 1, 0), ("kB", 1e3, 1), ("MB", 1e6, 1), ("GB", 1e9, 2), ("TB", 1e12, 2))


def human_size(n: float) -> str:
    """Decimal units; the unit is chosen after rounding, so 999,999 bytes reads 1.0 MB."""
    for unit, scale, decimals in _SIZE_UNITS:
        if unit == "B" and not float(n).is_integer():
            decimals = 1            # a per-request quotient below one kB
        v = round(n / scale, decimals)
        if abs(v) < 1000 or unit == _SIZE_UNITS[-1][0]:
            break
    return f"{v:.{decimals}f} {unit}"


def exact(n) -> str:
    """An integer with thousands separators; a non-integer quotient keeps up to two decimals."""
    if isinstance(n, int) or float(n).is_integer():
        return f"{int(n):,}"
    return f"{n:,.2f}".rstrip("0").rstrip(".")


def plural(n, word: str, words: Optional[str] = None) -> str:
    return f"{exact(n)} {word if n == 1 else (words or word + 's')}"


def size(n) -> str:
    """Bytes as the report writes them in a sentence: '215,989,920 bytes (216.0 MB)'."""
    return f"{exact(n)} bytes ({human_size(n)})"


def seconds(ns: float) -> str:
    return f"{ns / 1e9:.6f}"


def percent(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole > 0 else "n/a"


def share(x: float) -> str:
    """A ratio 0..1 as a percentage with one decimal."""
    return f"{100.0 * x:.1f}%"


def per(total: int, n: int):
    """total / n, kept an exact int when it divides."""
    return total // n if total % n == 0 else total / n
