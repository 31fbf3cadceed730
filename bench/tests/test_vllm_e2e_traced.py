"""CPU test of bench/device/vllm_e2e.py's traced check (vLLM's own tracing on): it passes only where each
of our spans has exactly one llm_request child and each request's trace holds one SERVER span."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "device"))
sys.path.insert(0, str(REPO / "tests" / "support"))
import vllm_e2e  # noqa: E402
from otlp_receiver import Span  # noqa: E402


def _span(name, trace, sid, parent, kind):
    return Span("http", name, trace, sid, parent, kind, 0, 1, {}, "unset", "", {"service.name": "vllm-V"}, "s")


class _Rx:
    def __init__(self, spans):
        self.spans = spans

    def wait_for_spans(self, pred, timeout=0):
        if not pred(self.spans):
            raise AssertionError("not all came")
        return self.spans

    def span_snapshot(self):
        return self.spans


def _tree(n, ours_kind="internal", under_ours=True):
    ours, spans = {}, []
    for i in range(n):
        t, s = f"{i:032x}", f"{i + 1:016x}"
        ours[f"r{i}"] = _span("text_completion m", t, s, "c" * 16, ours_kind)
        spans += [ours[f"r{i}"], _span("llm_request", t, f"{i + 100:016x}", s if under_ours else "c" * 16, "server")]
    return ours, spans


@pytest.mark.parametrize("case, fails", [("nested", 0), ("siblings", 1), ("two servers", 1), ("one missing", 2)])
def test_the_traced_check_fails_unless_llm_request_hangs_under_ours_and_one_server_span_a_trace(monkeypatch, case, fails):
    monkeypatch.setattr(vllm_e2e, "FAILS", [])
    ours, spans = _tree(3, ours_kind="server" if case == "two servers" else "internal",
                        under_ours=case != "siblings")
    if case == "one missing":
        spans = spans[:-1]
    res = {}
    vllm_e2e.traced_check(_Rx(spans), ours, res)
    assert len(vllm_e2e.FAILS) == fails
    assert res["traced"]["llm_request_under_ours"] == (0 if case == "siblings" else 2 if case == "one missing" else 3)
