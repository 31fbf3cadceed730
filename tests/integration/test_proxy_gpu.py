"""GPU cost on spans: synthetic census windows, then real segments written by the native tally."""
from __future__ import annotations

import http.client
import json
import os
import threading
import time

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from otlp_receiver import OtlpReceiver
from otel_gpu_census.attribution import Interval, attribute
from otel_gpu_census.census import STATE_ACTIVE, ProcessCensus, Stat, Window
from otel_gpu_census.integrations.llamacpp import ProxyConfig, start_proxy_in_thread
from otel_gpu_census.attribution.ledger import CensusSource

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("fresh_standin")]
BUCKET = 20_000_000
GPU_REF = 10**12


class FakeGpu:
    """A server that copies `dtoh` bytes and runs one 1 ms kernel in every 20 ms bucket, published
    `lag_s` behind the wall clock (or never after creation, when frozen)."""

    def __init__(self, dtoh=1000, lag_s=0.0, frozen=False, pid=4242, complete_lag_s=None):
        self.wall_ref = time.time_ns() - 2 * 10**9
        self.created = time.time_ns()
        self.dtoh, self.lag_ns, self.frozen, self.pid = dtoh, int(lag_s * 1e9), frozen, pid
        # the injector's "complete up to" time, this far behind the wall clock (None: not published)
        self.complete_lag_ns = None if complete_lag_s is None else int(complete_lag_s * 1e9)
        self.reads = 0

    def to_wall(self, g):
        return g - GPU_REF + self.wall_ref

    def census(self, update_ns):
        first = (GPU_REF // BUCKET) * BUCKET
        last = update_ns - self.wall_ref + GPU_REF
        windows = [Window(b, b + BUCKET, 1, 1_000_000, {"dtoh": Stat(1, self.dtoh, 500)}, device_mask=1)
                   for b in range(first, last - BUCKET, BUCKET)]
        return ProcessCensus(
            path=f"/fake/gpu-census-{self.pid}-1.seg", pid=self.pid, ppid=1, comm="llama-server", proc_start_ticks=1,
            wall_start_ns=self.wall_ref, wall_update_ns=update_ns, clock_ref_gpu_ns=GPU_REF,
            clock_ref_wall_ns=self.wall_ref, cupti_version=130000, state=STATE_ACTIVE, flags=0, records=0,
            records_unknown=0, dropped=0, buffers=0, buffers_refused=0, step_unmatched=0, window_late=0,
            step_max=0, last_gpu_ns=last, devices={}, windows=windows, alive=True,
            complete_wall_ns=0 if self.complete_lag_ns is None else time.time_ns() - self.complete_lag_ns)

    def read(self):
        self.reads += 1
        upd = self.created if self.frozen else time.time_ns() - self.lag_ns
        return [self.census(upd)], []


@pytest.fixture
def rx():
    with OtlpReceiver(grpc_enabled=False) as r:
        yield r


@pytest.fixture
def make_proxy(standin, rx):
    made = []

    def make(source, **cfg):
        tp = TracerProvider()
        tp.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=rx.traces_endpoint),
                                                 schedule_delay_millis=50))
        metrics = InMemoryMetricReader()
        cfg.setdefault("gpu_margin_s", 0.1)
        cfg.setdefault("gpu_max_wait_s", 2.0)
        h = start_proxy_in_thread(ProxyConfig(upstream=standin.url, listen_port=0, **cfg), tp,
                                  MeterProvider(metric_readers=[metrics]), source)
        h.tp, h.metrics = tp, metrics
        made.append(h)
        return h
    yield make
    for h in made:
        h.stop()
        h.tp.shutdown()


def post(port, path="/completion", body=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    c.request("POST", path, json.dumps(body or {"prompt": "x", "stream": True}).encode(),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def expected(fake, spans):
    """Shares recomputed from the spans' own start/end/TTFT with the attribution module."""
    ivs = []
    for s in spans:
        ft = s.start_ns + round(s.attributes["gen_ai.response.time_to_first_chunk"] * 1e9)
        ivs += [Interval((s.span_id, "prefill"), s.start_ns, ft, group=s.span_id),
                Interval((s.span_id, "decode"), ft, s.end_ns, group=s.span_id)]
    c = fake.census(time.time_ns())
    out = {}
    for s in spans:
        ws = c.windows_between(c.wall_to_gpu_ns(s.start_ns), c.wall_to_gpu_ns(s.end_ns))
        a = attribute(ws, c.gpu_to_wall_ns, ivs)
        out[s.span_id] = (a.group_share([(s.span_id, "prefill"), (s.span_id, "decode")]), a)
    return out


def test_single_request_gets_its_window(make_proxy, standin, rx):
    standin.opts.first_token_delay = 0.2
    standin.opts.token_delay = 0.05
    fake = FakeGpu(dtoh=1000)
    p = make_proxy(fake)
    assert post(p.port)[0] == 200
    s = rx.wait_for_spans(lambda ss: ss)[0]
    a = s.attributes
    G = "gpu_census."
    assert a[G + "attribution.status"] == "complete" and a[G + "attribution.method"] == "time_window_shared"
    share, attr = expected(fake, [s])[s.span_id]
    mine, window = a[G + "copy.dtoh.bytes"], a[G + "window.copy.dtoh.bytes"]
    assert mine == pytest.approx(share.copy("dtoh").bytes, abs=2)
    assert window == attr.total.copy("dtoh").bytes == 1000 * a[G + "attribution.buckets"]
    # one request: what it did not get is exactly what nobody was in flight for
    assert mine + a.get(G + "window.unattributed.copy.dtoh.bytes", 0) == window
    e2e, ttft = (s.end_ns - s.start_ns) / 1e9, a["gen_ai.response.time_to_first_chunk"]
    assert abs(mine - e2e / 0.02 * 1000) <= 2000                 # ~1000 bytes per 20 ms in flight
    assert abs(a[G + "prefill.copy.dtoh.bytes"] - ttft / 0.02 * 1000) <= 2000
    assert a[G + "kernel.count"] <= a[G + "window.kernel.count"] and a[G + "kernel.time"] > 0
    assert a[G + "attribution.concurrency_max"] == 1 and a[G + "process.pids"] == (4242,)
    assert "next request" in a[G + "attribution.note"]
    # the span ends when the answer ended, not when the census caught up
    assert (s.end_ns - s.start_ns) / 1e9 == pytest.approx(e2e, abs=1e-6)
    pts = {m.name: m for rm in p.metrics.get_metrics_data().resource_metrics for sm in rm.scope_metrics
           for m in sm.metrics}
    dps = {dp.attributes[G + "copy.direction"]: dp for dp in pts[G + "request.copy.size"].data.data_points}
    assert dps["dtoh"].sum == mine and dps["dtoh"].count == 1
    assert pts["gpu_census.request.copy.size"].unit == "By"


def test_concurrent_requests_share_buckets(make_proxy, standin, rx):
    standin.opts.first_token_delay = 0.15
    standin.opts.token_delay = 0.05
    standin.opts.tokens = 6
    fake = FakeGpu(dtoh=999)
    p = make_proxy(fake)
    ts = [threading.Thread(target=post, args=(p.port,)) for _ in range(2)]
    ts[0].start()
    time.sleep(0.15)
    ts[1].start()
    [t.join() for t in ts]
    spans = rx.wait_for_spans(lambda ss: len(ss) == 2)
    exp = expected(fake, spans)
    for s in spans:
        a = s.attributes
        assert a["gpu_census.attribution.concurrency_max"] == 2
        assert a["gpu_census.copy.dtoh.bytes"] == pytest.approx(exp[s.span_id][0].copy("dtoh").bytes, abs=2)
        assert a["gpu_census.copy.dtoh.bytes"] < a["gpu_census.window.copy.dtoh.bytes"]
    # over the union of the two windows, shares and the idle remainder add up to what the census held
    first, second = sorted(spans, key=lambda s: s.start_ns)
    c = fake.census(time.time_ns())
    ws = c.windows_between(c.wall_to_gpu_ns(first.start_ns), c.wall_to_gpu_ns(max(first.end_ns, second.end_ns)))
    union = sum(w.copies["dtoh"].bytes for w in ws)
    got = sum(s.attributes["gpu_census.copy.dtoh.bytes"] for s in spans)
    a_all = attribute(ws, c.gpu_to_wall_ns, [Interval(s.span_id, s.start_ns, s.end_ns) for s in spans])
    assert got + a_all.unattributed.copy("dtoh").bytes == pytest.approx(union, abs=4)


def test_span_waits_for_a_lagging_census(make_proxy, standin, rx):
    fake = FakeGpu(lag_s=0.5)
    p = make_proxy(fake, gpu_margin_s=0.3, gpu_max_wait_s=3.0)
    t0 = time.monotonic()
    post(p.port)
    done = time.monotonic()
    s = rx.wait_for_spans(lambda ss: ss)[0]
    assert time.monotonic() - done >= 0.75          # census publish >= end + margin: 0.8 s after the end
    assert s.attributes["gpu_census.attribution.status"] == "complete"
    assert s.attributes["gpu_census.attribution.wait_s"] >= 0.75
    assert time.monotonic() - t0 < 5


def test_complete_up_to_time_settles_a_span_without_the_margin(make_proxy, standin, rx):
    # publishes stopped at creation, but the flusher says the census is complete up to now
    fake = FakeGpu(frozen=True, complete_lag_s=0.0)
    p = make_proxy(fake, gpu_margin_s=1.2, gpu_max_wait_s=3.0)
    post(p.port)
    a = rx.wait_for_spans(lambda ss: ss)[0].attributes
    assert a["gpu_census.attribution.status"] == "complete" and a["gpu_census.attribution.wait_s"] < 0.8


def test_complete_up_to_time_is_waited_for(make_proxy, standin, rx):
    # fresh publishes, but complete only up to 0.8 s ago: the span waits for that, not for a publish
    fake = FakeGpu(complete_lag_s=0.8)
    p = make_proxy(fake, gpu_margin_s=0.1, gpu_max_wait_s=3.0)
    post(p.port)
    a = rx.wait_for_spans(lambda ss: ss)[0].attributes
    assert a["gpu_census.attribution.status"] == "complete" and a["gpu_census.attribution.wait_s"] >= 0.85


def test_stale_census_is_said_so(make_proxy, standin, rx):
    fake = FakeGpu(frozen=True)
    p = make_proxy(fake, gpu_margin_s=0.1, gpu_max_wait_s=0.6)
    post(p.port)
    a = rx.wait_for_spans(lambda ss: ss)[0].attributes
    assert a["gpu_census.attribution.status"] == "stale"
    assert 0.55 <= a["gpu_census.attribution.wait_s"] < 2


def test_no_segment_in_folder(make_proxy, standin, rx, tmp_path):
    p = make_proxy(CensusSource(str(tmp_path)))
    post(p.port)
    a = rx.wait_for_spans(lambda ss: ss)[0].attributes
    assert a["gpu_census.attribution.status"] == "no_segment" and "gpu_census.copy.dtoh.bytes" not in a


def test_failed_request_carries_no_gpu_cost(make_proxy, standin, rx):
    standin.opts.drop_before_headers = True
    fake = FakeGpu()
    p = make_proxy(fake)
    assert post(p.port)[0] == 502
    a = rx.wait_for_spans(lambda ss: ss)[0].attributes
    assert "gpu_census.copy.dtoh.bytes" not in a and fake.reads == 0


def test_stopping_the_proxy_ends_waiting_spans(make_proxy, standin, rx):
    fake = FakeGpu(frozen=True)
    p = make_proxy(fake, gpu_margin_s=0.1, gpu_max_wait_s=30)
    post(p.port)
    time.sleep(0.3)
    p.stop()
    p.tp.force_flush()
    a = rx.wait_for_spans(lambda ss: ss, timeout=5)[0].attributes
    assert a["gpu_census.attribution.status"] == "shutdown"


def test_reading_errors_do_not_break_the_proxy(make_proxy, standin, rx):
    class Broken:
        def read(self):
            raise OSError("disk on fire")
    p = make_proxy(Broken(), gpu_max_wait_s=0.3)
    assert post(p.port)[0] == 200
    a = rx.wait_for_spans(lambda ss: ss)[0].attributes
    assert a["gpu_census.attribution.status"] == "read_error" and "disk on fire" in a["gpu_census.attribution.note"]
    assert post(p.port)[0] == 200


# ---------------------------------------------------------------------------------------------
# real segments: the native tally counts real CUPTI records, the reader reads the file

def test_real_segment_copies_land_in_the_right_request_and_phase(make_proxy, standin, rx, segments, records,
                                                                  census_dir):
    standin.opts.first_token_delay = 0.4
    standin.opts.token_delay = 0.1
    standin.opts.tokens = 3
    seg = segments.new("llama-server", gpu_ref_ns=0)      # CUPTI clock == wall clock
    segments.tally(seg, [], final=False, state=1)
    path = segments.write(census_dir, seg)
    p = make_proxy(CensusSource(str(census_dir), pid=os.getpid()), gpu_margin_s=0.2, gpu_max_wait_s=5)
    assert post(p.port)[0] == 200
    t_recv = time.time_ns()
    ms = 1_000_000
    # placed from when the stand-in had the request (the span began before): its first token goes out
    # 0.4 s later, its last 0.6 s later, so the decode copies sit well clear of the first token on a busy CPU
    t_up = standin.seen[-1].received_ns
    state_save, logits = 200 * 1024 * 1024 + 7, 3 * 128256 * 4
    recs = [records.memcpy("dtoh", state_save, t_up + 100 * ms, t_up + 130 * ms, dst="pageable"),
            records.kernel(t_up + 200 * ms, t_up + 250 * ms),
            records.memcpy("dtoh", logits, t_up + 550 * ms, t_up + 551 * ms, dst="pageable"),
            records.memcpy("htod", 4096, t_up + 560 * ms, t_up + 561 * ms, src="pinned"),
            records.memcpy("dtoh", 5, t_recv + 2000 * ms, t_recv + 2001 * ms, dst="pageable")]   # after: nobody's
    time.sleep(0.3)
    segments.tally(seg, recs, final=False, state=1)        # one buffer completion, published now
    segments.write(census_dir, seg, name=path.name)
    a = rx.wait_for_spans(lambda ss: ss)[0].attributes
    assert a["gpu_census.attribution.status"] == "complete"
    assert a["gpu_census.copy.dtoh.bytes"] == state_save + logits and a["gpu_census.copy.dtoh.count"] == 2
    assert a["gpu_census.prefill.copy.dtoh.bytes"] == state_save         # before the first token
    assert a["gpu_census.copy.htod.bytes"] == 4096
    assert a["gpu_census.kernel.count"] == 1 and round(a["gpu_census.kernel.time"] * 1e9) == 50 * ms
    assert a["gpu_census.window.copy.dtoh.bytes"] == state_save + logits   # the late copy is outside the window
    assert a["gpu_census.process.pids"] == (os.getpid(),)


def test_draining_stop_lets_spans_finish_normally(make_proxy, standin, rx):
    fake = FakeGpu()
    p = make_proxy(fake, gpu_margin_s=0.5, gpu_max_wait_s=5)
    post(p.port)
    p.stop(drain_s=5)
    p.tp.force_flush()
    a = rx.wait_for_spans(lambda ss: ss, timeout=5)[0].attributes
    assert a["gpu_census.attribution.status"] == "complete" and a["gpu_census.attribution.wait_s"] >= 0.5


def test_range_read_gives_the_windows_the_full_read_gives(segments, records, census_dir):
    from otel_gpu_census.census import reader
    ms, t0 = 1_000_000, 10**12
    # 2200 buckets: the ring (2048) wraps, so slots are out of time order; every field non-zero somewhere
    recs = []
    for k in range(2200):
        t = t0 + k * BUCKET
        recs += [records.kernel(t, t + ms), records.memcpy(("dtoh", "htod", "dtod")[k % 3], 1000 + k, t, t + 5000),
                 records.memset(64 + k, t + 2 * ms, t + 3 * ms)]
    path = segments.segment(census_dir, recs, final=False, state=1, gpu_ref_ns=t0)
    full = reader.read_segment(path)
    wall = full.gpu_to_wall_ns
    for lo_k, hi_k in ((0, 2200), (2100, 2150), (300, 301), (2199, 2300), (-5, 10)):
        lo, hi = wall(t0 + lo_k * BUCKET + 7 * ms), wall(t0 + hi_k * BUCKET + 3 * ms)
        got = reader.read_windows(path, lo, hi)
        assert got.windows == full.windows_between(full.wall_to_gpu_ns(lo), full.wall_to_gpu_ns(hi))
        assert got.devices == full.devices and got.wall_update_ns == full.wall_update_ns and not got.steps
    assert len(reader.read_windows(path, wall(t0), wall(t0 + 3000 * BUCKET)).windows) == 2048
