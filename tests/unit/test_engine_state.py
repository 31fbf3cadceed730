"""The engine state summed per second (attribution/engine_state.py): each step's state weighted by how long it
held, a second's sums written once the next second's step comes."""
from __future__ import annotations

from otel_gpu_census.attribution.engine_state import BUCKET_NS, HOLD_NS, StateBuckets, valid

MS = 1_000_000
T = 1_700_000_000 * BUCKET_NS


def test_a_state_holds_until_the_next_step_and_at_most_hold_past_its_end():
    sb = StateBuckets()
    sb.add(T, T + 10 * MS, (4, 2, 4, 30, 70, 0, 0), 5 * MS, 0)              # held 20 ms (the next opens then)
    sb.add(T + 20 * MS, T + 30 * MS, (3, 0, 4, 20, 80, 1, 0), 6 * MS, 0)    # held to its end + HOLD_NS (idle after)
    sb.add(T + 900 * MS, T + 910 * MS, (1, 0, 4, 5, 95, 0, 7), 1 * MS, MS // 2)   # the last: + HOLD_NS at the end
    assert sb.drain() == []                                                # the second is not over
    (b,) = sb.drain(final=True)
    held = [20 * MS, 10 * MS + HOLD_NS, 10 * MS + HOLD_NS]
    assert b["t"] == T and b["steps"] == 3 and b["step_ns"] == sum(held)
    assert b["running_ns"] == 4 * held[0] + 3 * held[1] + 1 * held[2]
    assert b["waiting_ns"] == 2 * held[0]
    assert b["at_cap_ns"] == held[0] and b["at_cap_waiting_ns"] == 2 * held[0]
    assert b["at_cap_running_ns"] == 4 * held[0] and b["at_cap_kv_used_ns"] == 30 * held[0]
    assert (b["cap"], b["kv_total"], b["kv_used_max"]) == (4, 100, 30)
    assert (b["preempted"], b["recomputed_tokens"], b["recompute_kernel_ns"], b["kernel_ns"]) == (1, 7, MS // 2, 12 * MS)


def test_a_second_is_written_when_a_later_seconds_step_comes():
    sb = StateBuckets()
    sb.add(T + 990 * MS, T + 995 * MS, (1, 0, 8, 1, 9, 0, 0), MS, 0)
    sb.add(T + BUCKET_NS + 5 * MS, T + BUCKET_NS + 6 * MS, (2, 0, 8, 1, 9, 0, 0), MS, 0)
    sb.add(T + 3 * BUCKET_NS, T + 3 * BUCKET_NS + 1, (2, 0, 8, 1, 9, 0, 0), MS, 0)
    got = sb.drain()
    assert [b["t"] for b in got] == [T]                                    # (the step of T+1 s is weighed, unwritten)
    assert got[0]["step_ns"] == 15 * MS                                    # to the next open
    assert [b["t"] for b in sb.drain(final=True)] == [T + BUCKET_NS, T + 3 * BUCKET_NS]
    assert sb.steps == 3


def test_no_cap_means_never_at_it():
    sb = StateBuckets()
    sb.add(T, T + MS, (5, 5, 0, 0, 0, 0, 0), 0, 0)
    (b,) = sb.drain(final=True)
    assert b["at_cap_ns"] == 0 and b["cap"] == 0


def test_what_a_hook_records_is_checked():
    assert valid((1, 2, 3, 4, 5, 6, 7))
    assert not valid((1, 2, 3)) and not valid((1, 2, 3, 4, 5, 6, -1)) and not valid((1, 2, 3, 4, 5, 6, 1.0))
    assert not valid([1, 2, 3, 4, 5, 6, 7]) and not valid((True, 2, 3, 4, 5, 6, 7))


def test_a_state_that_is_not_counts_is_left_out_and_counted():
    sb = StateBuckets()
    sb.add(T, T + MS, (1, 2, 3, 4.5, 5, 6, 7), 0, 0)
    sb.add(T, T + MS, (1, 2), 0, 0)
    assert sb.drain(final=True) == [] and sb.invalid == 2 and sb.steps == 0
