"""What every sentence the report prints must hold to: one sentence per diagnosis, no part larger than its
whole ("41 of the 33 seconds"), no share above 100 %, and no count without its unit."""
from __future__ import annotations

import re
from typing import List

UNITS = ("bytes", "B", "kB", "MB", "GB", "TB", "GB/s", "s", "ms", "us", "%", "copies", "copy", "requests",
         "request", "bursts", "burst", "kernels", "kernel", "memsets", "memset", "seconds", "second", "GB a second",
         "copies a second", "copies per request", "warp")
NUMBER = r"\d[\d,]*(?:\.\d+)?"
QUALIFIERS = re.compile(r"^(?:(?:device-to-host|host-to-device|device-to-device|peer-to-peer|pageable|pinned|eager|graph)"
                        r"\s+)+")   # "511 device-to-host copies": the unit after what kind of copies


def _num(text: str) -> float:
    return float(text.replace(",", ""))


def _plain(text: str) -> str:
    """The sentence without what is not prose: `flags`, pids, device names and UUIDs."""
    text = re.sub(r"`[^`]*`", "FLAG", text)
    text = re.sub(r"\bGPU-[0-9a-f-]+", "UUID", text)
    text = re.sub(r"\bcuda:\d+", "DEVICE", text)
    return re.sub(r"\bpid \d+", "pid PID", text)


def problems(text: str, one_sentence: bool = True) -> List[str]:
    """What is wrong with `text`; [] when nothing is."""
    out = []
    plain = _plain(text)
    if one_sentence:
        if "\n" in text or not text.endswith("."):
            out.append("not one sentence ending in a full stop")
        if re.search(r"[a-z0-9)]\. [A-Z]", plain):
            out.append("more than one sentence")
    for m in re.finditer(rf"({NUMBER})\s*([A-Za-z%/]*)\s+of\s+(?:the\s+|all\s+)?(?:last\s+)?({NUMBER})\s*([A-Za-z%/]*)",
                         plain):
        part, unit_a, whole, unit_b = _num(m.group(1)), m.group(2), _num(m.group(3)), m.group(4)
        if unit_a == "%" or (unit_a and unit_b and unit_a != unit_b and unit_a != unit_b.rstrip("s")):
            continue          # a share of something, or two kinds of thing
        if part > whole:
            out.append(f"a part larger than its whole: {m.group(0)!r}")
    for m in re.finditer(rf"({NUMBER})%", plain):
        if _num(m.group(1)) > 100.0:
            out.append(f"a share above 100%: {m.group(0)!r}")
    for m in re.finditer(rf"(?<![\w.:/-])({NUMBER})(?![\w.,])", plain):
        rest = plain[m.end():].lstrip()
        if plain[m.end():m.end() + 1] == "%" or re.match(rf"of (?:the |all )?(?:last )?{NUMBER}", rest):
            continue          # a share, or "1 of the 2 requests": the whole's unit is the part's
        rest = QUALIFIERS.sub("", rest)
        if not any(rest.startswith(u) and (len(rest) == len(u) or not rest[len(u)].isalnum()) for u in UNITS):
            out.append(f"a count without its unit: {plain[max(0, m.start() - 30):m.end() + 20]!r}")
    return out
