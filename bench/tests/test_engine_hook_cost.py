"""bench/perf/engine_hook_cost.py runs the real vLLM integration's hooks and says what a step costs them."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_it_prices_a_step_of_the_real_hooks_per_batch_size(tmp_path):
    out = tmp_path / "hooks.json"
    p = subprocess.run([sys.executable, str(REPO / "bench/perf/engine_hook_cost.py"), "--requests", "4,32",
                        "--steps", "50", "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [r["requests"] for r in rows] == [4, 32]
    # two records a step reach the settling process (the step's opening, its end), and more requests cost more bytes
    assert all(r["records_per_step"] == 2.0 and r["hooks_us_per_step"] > 0 for r in rows)
    assert rows[1]["bytes_per_step"] > rows[0]["bytes_per_step"] > 0
