"""The proxy's ledger (attribution.ledger.GpuLedger) against a live segment written by the native tally,
its flushes played by the test: what a request's span gets when CUPTI hands records over late."""
from __future__ import annotations

import asyncio
import time

import pytest

from otel_gpu_census.attribution import Interval, attribute
from otel_gpu_census.attribution.ledger import CensusSource, GpuLedger
from otel_gpu_census.census import reader

pytestmark = pytest.mark.timeout(60)
MS = 1_000_000
BUCKET = 20 * MS


class CountingSource(CensusSource):
    """The census folder, counting the ledger's polls (header reads)."""

    reads = 0

    def read_headers(self):
        self.reads += 1
        return super().read_headers()


def test_records_one_flush_held_back_still_reach_the_requests_whose_window_they_ran_in(segments, records,
                                                                                        census_dir):
    """CUPTI's periodic flush (not forced) keeps back a buffer that holds a record still in flight, with
    the finished records before it, and the injector publishes complete_wall_ns all the same: records of
    work that ended before it come one flush later. A settled at the flush that first covered its end
    lost them for good (neither its share nor anyone's unattributed part): it waits for one more flush."""
    from segments import map_segment
    T = (time.time_ns() // BUCKET + 1) * BUCKET             # a bucket edge; CUPTI clock == wall clock
    mm, seg = map_segment(census_dir / "gpu-census-1-1.seg", b"llama-server", wall_start_ns=T - 10**9,
                          gpu_ref_ns=T - 10**9)
    now = [T]
    # a 1 ms kernel in each of 40 buckets; those of [200, 400) ms sit in the buffer the first flush keeps
    kernels = [records.kernel(T + b * BUCKET + 5 * MS, T + b * BUCKET + 6 * MS) for b in range(40)]

    def flush(at_ms, recs):                                 # the injector's flusher: tally, then publish t
        segments.tally(seg, recs, final=False)
        seg.complete_wall_ns = T + at_ms * MS
        now[0] = T + at_ms * MS + 50 * MS

    async def scenario():
        source = CountingSource(str(census_dir))
        led = GpuLedger(source, margin_s=0.1, max_wait_s=3.0, poll_s=0.005, clock=lambda: now[0])

        async def polls(n=3):           # the ledger has read the census n more times (or has stopped reading)
            want, until = source.reads + n, time.monotonic() + 2
            while source.reads < want and time.monotonic() < until:
                await asyncio.sleep(0.005)

        led.open("a", T)
        led.first_token("a", T + 100 * MS)
        led.open("b", T + 300 * MS)                         # shares a's buckets of [300, 400) ms
        a = led.close("a", T + 400 * MS)
        flush(600, kernels[:10] + kernels[20:30])           # complete past a's end, its late kernels held
        await polls()
        assert not a.done()                                 # a waits ...
        b = led.close("b", T + 800 * MS)
        flush(1600, kernels[10:20] + kernels[30:])          # ... for the next flush, which brings them
        a = await asyncio.wait_for(a, 5)
        await polls()
        assert not b.done()
        flush(2600, [])
        b = await asyncio.wait_for(b, 5)
        await led.stop()
        return a, b

    a, b = asyncio.run(scenario())
    assert (a.status, b.status) == ("complete", "complete")
    # what each request is owed, split from the final census with both requests' intervals
    c = reader.read_segment(census_dir / "gpu-census-1-1.seg")
    ivs = [Interval(("a", "prefill"), T, T + 100 * MS, group="a"),
           Interval(("a", "decode"), T + 100 * MS, T + 400 * MS, group="a"),
           Interval(("b", "all"), T + 300 * MS, T + 800 * MS, group="b")]
    whole = attribute(c.windows, c.gpu_to_wall_ns, ivs)
    owed = {k: whole.group_share([iv.key for iv in ivs if iv.owner == k]) for k in "ab"}
    assert (owed["a"].kernel_ns, owed["b"].kernel_ns) == (17_500_000, 22_500_000)
    assert (a.share, b.share) == (owed["a"], owed["b"])
    assert a.window.kernel_count == 20 and a.prefill.kernel_count == 5
    # conservation: the two spans and the idle rest hold every kernel the census counted
    assert a.share.kernel_ns + b.share.kernel_ns + whole.unattributed.kernel_ns == c.totals().kernel_ns == 40 * MS
    del seg, mm


def test_a_flusher_that_stops_after_the_covering_flush_holds_a_request_only_until_max_wait(segments, records,
                                                                                          census_dir):
    """No later flush ever comes (a hung census): the request waits max_wait, no longer, and settles
    with what the census holds, said as `settled` rather than `complete`."""
    from segments import map_segment
    T = (time.time_ns() // BUCKET + 1) * BUCKET
    mm, seg = map_segment(census_dir / "gpu-census-1-1.seg", b"llama-server", wall_start_ns=T - 10**9,
                          gpu_ref_ns=T - 10**9)
    segments.tally(seg, [records.kernel(T + b * BUCKET + 5 * MS, T + b * BUCKET + 6 * MS) for b in range(20)],
                   final=False)
    seg.complete_wall_ns = seg.wall_update_ns = T + 600 * MS    # its last publish: past a's end
    now = [T + 650 * MS]

    async def scenario():
        led = GpuLedger(CensusSource(str(census_dir)), margin_s=0.1, max_wait_s=3.0, poll_s=0.005,
                        clock=lambda: now[0])
        led.open("a", T)
        a = led.close("a", T + 400 * MS)
        await asyncio.sleep(0.2)
        assert not a.done()
        now[0] = T + 3400 * MS                              # max_wait after a's end
        return await asyncio.wait_for(a, 5)

    a = asyncio.run(scenario())
    assert (a.status, a.share.kernel_count, a.window.kernel_count) == ("settled", 20, 20)
    del seg, mm
