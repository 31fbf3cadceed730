"""vllm_phase_windows.py: the census's 20 ms windows put in every-kernel / duty-cycle-on / duty-cycle-off
classes by their eager records, graph span per graph kernel in each, and the requests with steps and no
kernel placed in the phase they started in."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "perf"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
import vllm_phase_windows as vpw  # noqa: E402
from otel_gpu_census.census import Window  # noqa: E402

MS = 1_000_000


def win(t_ms, kernels, kernel_ns, eager, traced, traced_ns):
    return Window(start_ns=t_ms * MS, end_ns=(t_ms + 20) * MS, kernel_count=kernels, kernel_ns=kernel_ns,
                  eager_launches=eager, eager_traced=traced, eager_traced_ns=traced_ns)


def test_windows_are_classed_by_their_eager_records_and_graph_time_is_what_records_leave():
    ws = []
    # 600 ms with every eager launch recorded (one window in the middle without eager launches): all
    for k in range(30):
        ws.append(win(k * 20, 12, 50_000, 2, 2, 10_000) if k != 7 else win(k * 20, 10, 40_000, 0, 0, 0))
    # a duty cycle: 100 ms on, then 300 ms off; graph kernels 10 a window at 3,000 ns each while off
    for k in range(5):
        ws.append(win(1000 + k * 20, 12, 40_000, 2, 2, 8_000))
    for k in range(15):
        ws.append(win(1100 + k * 20, 12, 30_000, 2, 0, 0))
    cls = vpw.classify(ws)
    assert cls[:30] == ["all"] * 30
    assert cls[30:35] == ["counted-on"] * 5 and cls[35:] == ["counted-off"] * 15
    g = vpw.graph_span_per_kernel(ws)
    assert g["all"]["graph_kernels"] == 29 * 10 + 10 and g["all"]["graph_ns"] == 29 * 40_000 + 40_000
    assert g["counted-on"]["graph_ns_per_kernel"] == 3200.0
    assert g["counted-off"] == {"windows": 15, "graph_kernels": 150, "graph_ns": 450_000, "graph_ns_per_kernel": 3000.0}


def test_requests_with_steps_and_no_kernel_are_placed_in_their_phase():
    rounds = [{"order": ["off", "launch"], "off": {"t0_ns": 0, "t1_ns": 100}, "launch": {"t0_ns": 200, "t1_ns": 300}}]
    reqs = [{"start_time_unix_nano": 250, "steps": 5, "gpu": {"kernel.count": 0}},
            {"start_time_unix_nano": 260, "steps": 5, "gpu": {"kernel.count": 9}},
            {"start_time_unix_nano": 50, "steps": 0, "gpu": {"kernel.count": 0}},   # paused: no steps
            {"start_time_unix_nano": 150, "steps": 3, "gpu": {}}]
    got = vpw.empty_requests(reqs, rounds)
    assert got == {"requests": 4, "with_steps_no_kernel": 2,
                   "by_phase": {"round 0 launch": 1, "between phases": 1}}
