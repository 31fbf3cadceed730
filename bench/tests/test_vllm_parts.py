"""bench/device/vllm_parts.sh on stand-in pieces: the wheel set cut so that each call carries at most Q_BYTES of it
(q1-q4), and joined again on the GPU machine (--join) into the two pieces and the folders install.sh reads, byte for
byte; a join without q1's piece says so."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "device" / "vllm_parts.sh"
W = "vllm-0.25.1-cp38-abi3-manylinux_2_28_x86_64.whl"


def wheel_set(d: Path) -> bytes:
    """part1 (the wheel's first piece), part2 (its rest and two small wheels), part3 (installer, model maker)."""
    whole = os.urandom(1000)
    for sub in ("part1", "part2", "part3"):
        (d / sub).mkdir(parents=True)
    (d / "part1" / f"{W}.part-00").write_bytes(whole[:600])
    (d / "part2" / f"{W}.part-01").write_bytes(whole[600:])
    (d / "part2" / "small-1.0-py3-none-any.whl").write_bytes(b"small")
    (d / "part3" / "install.sh").write_text("echo install\n")
    (d / "part3" / "vllm_model.py").write_text("# model\n")
    return whole


def test_cut_in_four_then_joined_gives_back_every_byte(tmp_path):
    d = tmp_path / ".vllm"
    whole = wheel_set(d)
    subprocess.run(["bash", str(SCRIPT), str(d)], check=True, capture_output=True,
                   env={**os.environ, "Q_BYTES": "250", "P1_BYTES": "400"})
    sizes = {q: sum(f.stat().st_size for f in (d / q).rglob("*") if f.is_file()) for q in ("q1", "q2", "q3", "q4")}
    assert sizes["q1"] == 250 and sizes["q2"] == 350 + 5 and sizes["q3"] == 250
    assert (d / "q4" / "part3" / "vllm_model.py").exists() and (d / "q4" / f"{W}.part-01b").stat().st_size == 150
    # the GPU machine: q1-q3 copied to VP/q by their calls, q4 carried by the last one (part3 not carried)
    vp, dev = tmp_path / "vp", tmp_path / "device" / ".vllm"
    (vp / "q").mkdir(parents=True)
    for q in ("q1", "q2", "q3"):
        for f in (d / q).iterdir():
            shutil.copy(f, vp / "q")
    shutil.copytree(d / "q4", dev / "q4")
    got = subprocess.run(["bash", str(SCRIPT), "--join", str(dev), str(vp)], capture_output=True, text=True)
    assert got.returncode == 0 and "joined 1 wheel" in got.stdout
    joined = (vp / "part1" / f"{W}.part-00").read_bytes() + (vp / "part2" / f"{W}.part-01").read_bytes()
    assert hashlib.sha256(joined).digest() == hashlib.sha256(whole).digest()
    assert (vp / "part2" / "small-1.0-py3-none-any.whl").read_bytes() == b"small"
    assert (dev / "part3" / "install.sh").read_text() == "echo install\n"


def test_a_join_without_the_first_piece_says_so(tmp_path):
    d = tmp_path / ".vllm"
    wheel_set(d)
    subprocess.run(["bash", str(SCRIPT), str(d)], check=True, capture_output=True, env={**os.environ, "Q_BYTES": "250"})
    vp = tmp_path / "vp"
    (vp / "q").mkdir(parents=True)
    got = subprocess.run(["bash", str(SCRIPT), "--join", str(d), str(vp)], capture_output=True, text=True)
    assert got.returncode == 1 and "no q1 piece" in got.stderr
