"""Managed (unified) memory under both collectors, on the mock driver and the mock CUPTI.

Pages of managed memory move between host and device when either touches them, and no copy call names those moves.
- The default collector (the library preloaded) counts the managed allocations, frees, advice and prefetches at their
  calls, per device, and then says, in the segment's gaps, the report's NOT EXACT line, the metric and the spans'
  notes, that migrations were not measured and that the precise collector measures them.
- The precise collector turns CUPTI's unified-memory counters on at the first managed allocation its callbacks report
  (before the allocation returns) and counts what they report: bytes each way as their own copy rows (managed_htod,
  managed_dtoh) in the device totals and the windows, faults and thrashing per device. A CUPTI or GPU without the
  counters: one line, the gap said, everything else exact.
"""
from __future__ import annotations

from test_injector import CONTROL_SWITCH, read, run_with_driver
from test_interpose import DRIVER, ENV, preloaded

MiB = 1 << 20

MANAGED = """
        from ctypes import Structure, c_int, c_size_t, c_uint, c_ulong
        class Loc(Structure):
            _fields_ = [('type', c_int), ('id', c_int)]          # CUmemLocation
        HOST_LOC, DEVICE_LOC = 2, 1
        F = ctypes.CFUNCTYPE
        alloc_managed = proc('cuMemAllocManaged', F(c_int, ctypes.POINTER(c_uint64), c_size_t, c_uint))
        pool_alloc = proc('cuMemAllocFromPoolAsync', F(c_int, ctypes.POINTER(c_uint64), c_size_t, c_ulong, c_void_p))
        free = proc('cuMemFree', F(c_int, c_uint64))
        free_async = proc('cuMemFreeAsync', F(c_int, c_uint64, c_void_p))
        advise = proc('cuMemAdvise', F(c_int, c_uint64, c_size_t, c_int, Loc))
        prefetch = proc('cuMemPrefetchAsync', F(c_int, c_uint64, c_size_t, Loc, c_uint, c_void_p))
        pbatch = proc('cuMemPrefetchBatchAsync', F(c_int, ctypes.POINTER(c_uint64), ctypes.POINTER(c_size_t), c_size_t,
                                                  ctypes.POINTER(Loc), ctypes.POINTER(c_size_t), c_size_t,
                                                  ctypes.c_ulonglong, c_void_p))
        def managed(n):
            p = c_uint64()
            assert alloc_managed(byref(p), n, 1) == 0
            return p.value
"""


def test_the_default_collector_counts_managed_memory_and_says_migrations_are_not_measured(native, mock_lib, mock_cuda,
                                                                                        tmp_path):
    """Two 8 MiB managed allocations (one freed), one from a managed pool (freed in stream order) and one from another
    pool, advice, a
    prefetch each way and a batch of two: counted per device from the calls' arguments; the copies and kernels of the
    same run stay exact; the segment, the report, the metric and a request's cost say migrations were not
    measured and name the precise collector."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, DRIVER.format(mock_cuda=mock_cuda) + MANAGED + """
        out['init'] = g.InitializeInjection()
        a, b = managed(8 << 20), managed(8 << 20)
        pm, pd = c_uint64(), c_uint64()
        out['pools'] = [pool_alloc(byref(pm), 1 << 20, 0xbeef, None), pool_alloc(byref(pd), 1 << 20, 0x1234, None)]
        out['advise'] = advise(a, 8 << 20, 1, Loc(DEVICE_LOC, 0))
        out['prefetch'] = [prefetch(a, 8 << 20, Loc(DEVICE_LOC, 0), 0, None), prefetch(a, 4 << 20, Loc(HOST_LOC, 0), 0, None)]
        ptrs, sizes = (c_uint64 * 2)(a, b), (c_size_t * 2)(1 << 20, 3 << 20)
        locs, idx = (Loc * 2)(Loc(DEVICE_LOC, 0), Loc(HOST_LOC, 0)), (c_size_t * 2)(0, 1)
        out['batch'] = pbatch(ptrs, sizes, 2, locs, idx, 2, 0, 0x99)
        k()
        htod(DEV, PIN, 4096, None)
        out['free'] = [free(b), free(DEV), free_async(pm.value, None)]   # managed, device memory (not), the pool's
        out['flush'] = g.gc_flush()
        out['path'] = path()
    """, env=dict(ENV, **preloaded(native)))
    assert res["init"] == 1 and res["flush"] == 0, (res, err)
    assert res["pools"] == [0, 0] and res["advise"] == 0 and res["prefetch"] == [0, 0] and res["batch"] == 0
    assert res["free"] == [0, 0, 0] and err == "", err
    p = read(native, res["path"])
    dev = p.devices[0]
    m = dev.managed
    assert (m.allocs, m.alloc_bytes, m.live_bytes) == (3, 16 * MiB + MiB, 8 * MiB)
    assert m.advises == 1
    assert (m.prefetch_in.count, m.prefetch_in.bytes) == (2, 8 * MiB + MiB)
    assert (m.prefetch_out.count, m.prefetch_out.bytes) == (2, 4 * MiB + 3 * MiB)
    assert dev.eager_launches == 1 and dev.copies.get("htod", "pinned").bytes == 4096   # the rest stays exact
    assert p.managed_in_use and not p.migrations_measured
    assert dev.copies.get("managed_htod").count == 0                # nothing claims to have measured them
    gap = p.managed_gap
    assert gap and "not measured by this collector" in gap and "--precise" in gap and gap in p.gaps, p.gaps
    assert "3 allocations, 17,825,792 bytes, 8,388,608 live" in gap, gap

    from otel_gpu_census.report import render
    text = render.render_text([p])
    assert "NOT EXACT" in text and "page migrations between host and device are not measured" in text, text

    from otel_gpu_census.telemetry import census_metrics
    state = census_metrics.CensusMetrics(lambda: [p], min_refresh_s=0)
    state.refresh()
    cbs = state.callbacks()
    got = {name: [o.value for o in cbs[name](None)] for name in ("gpu_census.exact", "gpu_census.managed.unmeasured")}
    assert got == {"gpu_census.exact": [0], "gpu_census.managed.unmeasured": [1]}, got

    from otel_gpu_census.attribution.ledger import COMPLETE, PARTIAL, GpuCost, mark_gaps
    cost = mark_gaps(GpuCost(status=COMPLETE), [p])
    assert cost.status == PARTIAL and any("not measured by this collector" in n for n in cost.notes), cost.notes


def test_no_managed_memory_no_gap_until_some_is_allocated(native, mock_lib, mock_cuda, tmp_path):
    """A run that allocates no managed memory says nothing about it (frees of plain device memory pass through);
    its first managed allocation is in the segment at the next flush, and the gap with it."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, DRIVER.format(mock_cuda=mock_cuda) + MANAGED + """
        out['init'] = g.InitializeInjection()
        k()
        out['free'] = free(DEV)
        out['flush'] = g.gc_flush()
        out['path'] = path()
        from otel_gpu_census.census.reader import read_segment
        out['before'] = read_segment(path()).gaps
        managed(4096)                                 # once the segment exists, a flush publishes it at once
        g.gc_flush()
        c = read_segment(path())
        out['after'] = [c.managed_in_use, c.devices[0].managed.allocs, bool(c.managed_gap)]
    """, env=dict(ENV, **preloaded(native)))
    assert res["init"] == 1 and res["free"] == 0 and err == ""
    assert res["before"] == [] and res["after"] == [True, 1, True], res


# ---- the precise collector: CUPTI's unified-memory counters ----------------------------------------------------

PRECISE = """
        cffi_um = cffi.FFI()
        cffi_um.cdef('int mock_api_call_params(int, uint32_t, uint32_t, const void *); int mock_um_configured(void);')
        um_mock = cffi_um.dlopen({mock!r})
        import ctypes
        def alloc_managed_cb(ptr, nbytes, corr=500):
            # cuMemAllocManaged as the driver reports it to a subscriber: its params, the pointer already written
            dptr = ctypes.c_uint64(ptr)
            params = (ctypes.c_uint64 * 3)(ctypes.addressof(dptr), nbytes, 1)
            mock.mock_set_api_device(1)
            return um_mock.mock_api_call_params(1, rlib.CUPTI_DRIVER_TRACE_CBID_cuMemAllocManaged, corr,
                                                cffi_um.cast('void *', ctypes.addressof(params)))
        def um(counter, value, start, end=0, src=0, dst=0):
            return queue(cr.unified(counter, value, start, end, src, dst), cr.UM_T)
"""


def test_the_precise_collector_measures_migrations_from_the_first_managed_allocation(native, mock_lib, mock_cuda,
                                                                                    tmp_path):
    """Counters off until the first managed allocation (a record before it is not kept: nothing was asked); then on,
    and a known pattern: 8 MiB touched on the host then the device (host-to-device in two transfers), then back on the
    host (device-to-host), with faults and a thrashing report. Migrated bytes are their own copy rows beside the one
    real copy, in the device totals and the windows; no gap, so the census is exact."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, PRECISE.format(mock=mock_lib) + """
        out['init'] = g.InitializeInjection()
        out['before'] = [um('BYTES_TRANSFER_HTOD', 4096, T, T + 10, 0, 0), um_mock.mock_um_configured()]
        out['cb'] = alloc_managed_cb(0x900000000000, 8 << 20)
        out['configured'] = um_mock.mock_um_configured()
        out['um_on'] = mock.mock_enabled(rlib.CUPTI_ACTIVITY_KIND_UNIFIED_MEMORY_COUNTER)
        um('BYTES_TRANSFER_HTOD', 2 << 20, T + 1000, T + 2000, 0, 0)
        um('BYTES_TRANSFER_HTOD', 6 << 20, T + 3000, T + 5000, 0, 0)
        um('GPU_PAGE_FAULT', 3, T + 900, T + 950, 0, 0)
        um('BYTES_TRANSFER_DTOH', 8 << 20, T + 30_000_000, T + 30_004_000, 0, 0)
        um('CPU_PAGE_FAULT_COUNT', 0, T + 29_000_000)
        um('THRASHING', 1 << 20, T + 40_000_000, 0, 1, 0)
        queue(cr.memcpy('htod', 4096, T + 100, T + 110, src='pinned'), cr.MEMCPY_T)
        out['flush'] = g.gc_flush()
        out['path'] = path()
    """)
    assert res["init"] == 1 and res["flush"] == 0 and res["cb"] == 1, (res, err)
    assert res["before"] == [1, 0], res                    # not traced before any managed memory existed
    assert res["configured"] >= 2 and res["um_on"] == 1, res
    p = read(native, res["path"])
    dev = p.devices[0]
    assert p.migrations_measured and p.managed_in_use and p.managed_gap is None and p.gaps == [], p.gaps
    assert p.um_since_wall_ns >= p.wall_start_ns
    htod, dtoh = dev.copies.get("managed_htod", "other"), dev.copies.get("managed_dtoh", "other")
    assert (htod.count, htod.bytes, htod.ns) == (2, 8 << 20, 1000 + 2000)
    assert (dtoh.count, dtoh.bytes) == (1, 8 << 20)
    assert dev.copies.get("htod", "pinned").bytes == 4096 and dev.copies.get("htod").bytes == 4096
    assert (dev.managed.allocs, dev.managed.alloc_bytes, dev.managed.gpu_faults, dev.managed.thrashing) == (1, 8 << 20, 3, 1)
    assert p.um_cpu_faults == 1
    win = {w.start_ns: w for w in p.windows}
    assert sum(w.copies.get("managed_htod").bytes for w in win.values() if "managed_htod" in w.copies) == 8 << 20
    assert sum(w.copies.get("managed_dtoh").bytes for w in win.values() if "managed_dtoh" in w.copies) == 8 << 20
    assert p.step_unmatched == 0                          # no correlation id: never tried against a step
    assert err == "", err


def test_a_gpu_without_unified_memory_counters_says_so_once_and_stays_exact(native, mock_lib, mock_cuda, tmp_path):
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, PRECISE.format(mock=mock_lib) + """
        out['init'] = g.InitializeInjection()
        alloc_managed_cb(0x900000000000, 8 << 20, 500)
        alloc_managed_cb(0x900000800000, 8 << 20, 502)
        queue(cr.memcpy('dtoh', 4096, T + 100, T + 110, dst='pinned'), cr.MEMCPY_T)
        out['flush'] = g.gc_flush()
        out['path'] = path()
        out['active'] = g.gc_active()
    """, env={"MOCK_CUPTI_NO_UM": "1"})
    assert res["init"] == 1 and res["flush"] == 0 and res["active"] == 1, (res, err)
    assert err.count("no unified-memory counters") == 1, err
    p = read(native, res["path"])
    assert not p.migrations_measured and p.managed_gap and "code 28" in p.managed_gap, p.gaps
    assert p.devices[0].copies.get("dtoh", "pinned").bytes == 4096 and p.devices[0].managed.allocs == 2


def test_without_callbacks_the_counters_go_on_at_the_flushers_first_wake(native, mock_lib, mock_cuda, tmp_path):
    """Graphs traced node by node under CUPTI's one-subscriber API: no callback tells of managed allocations (one
    would take the slot), so the flusher turns the counters on at its first wake, whatever the process allocates,
    and migrations from then are measured."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, PRECISE.format(mock=mock_lib) + """
        out['init'] = g.InitializeInjection()
        out['cb'] = alloc_managed_cb(0x900000000000, 8 << 20)     # no callback enabled: not reported
        for _ in range(500):
            if mock.mock_enabled(rlib.CUPTI_ACTIVITY_KIND_UNIFIED_MEMORY_COUNTER):
                break
            time.sleep(0.01)
        out['um_on'] = mock.mock_enabled(rlib.CUPTI_ACTIVITY_KIND_UNIFIED_MEMORY_COUNTER)
        um('BYTES_TRANSFER_HTOD', 2 << 20, T + 1000, T + 2000, 0, 0)
        out['flush'] = g.gc_flush()
        out['path'] = path()
    """, env={"OTEL_GPU_CENSUS_GRAPHS": "node", "OTEL_GPU_CENSUS_FLUSH_MS": "20"})
    assert res["init"] == 1 and res["cb"] == 0 and res["um_on"] == 1 and res["flush"] == 0, (res, err)
    p = read(native, res["path"])
    assert p.migrations_measured and p.devices[0].copies.get("managed_htod").bytes == 2 << 20 and p.gaps == []
    assert err == "", err


def test_a_paused_census_switches_the_counters_off_and_on_with_every_other_kind(native, mock_lib, mock_cuda, tmp_path):
    """census=off in the control file: the counters' kind off (a migration then is not counted, as no other work
    is); census=on: on again; a managed allocation made while paused turns them on only when counting resumes."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, PRECISE.format(mock=mock_lib) + CONTROL_SWITCH + """
        UM = rlib.CUPTI_ACTIVITY_KIND_UNIFIED_MEMORY_COUNTER
        out['init'] = g.InitializeInjection()
        queue(cr.memcpy('htod', 4096, T, T + 10, src='pinned'), cr.MEMCPY_T)
        g.gc_flush()                                              # the segment, and so its control file
        out['off'] = switch('census=off', True)
        alloc_managed_cb(0x900000000000, 8 << 20)
        out['paused'] = [mock.mock_enabled(UM), um('BYTES_TRANSFER_HTOD', 1 << 20, T + 100, T + 200, 0, 0)]
        out['on'] = switch('census=on', False)
        out['resumed'] = [mock.mock_enabled(UM), um('BYTES_TRANSFER_HTOD', 2 << 20, T + 300, T + 400, 0, 0)]
        out['flush'] = g.gc_flush()
        out['path'] = path()
    """, env={"OTEL_GPU_CENSUS_FLUSH_MS": "20"})
    assert res["init"] == 1 and res["off"] and res["on"] and res["flush"] == 0, (res, err)
    assert res["paused"] == [0, 1] and res["resumed"] == [1, 0], res
    p = read(native, res["path"])
    assert p.migrations_measured and p.devices[0].copies.get("managed_htod").bytes == 2 << 20 and err == ""


def test_allocations_and_frees_of_many_threads_leave_exactly_the_live_bytes(native, mock_lib, mock_cuda, tmp_path):
    """Eight threads at once, each making 400 managed allocations of its own size and freeing all but every
    eighth: the live bytes are exactly those of the ones kept, every allocation counted once."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, DRIVER.format(mock_cuda=mock_cuda) + MANAGED + """
        import threading
        out['init'] = g.InitializeInjection()
        go = threading.Barrier(8)
        def work(t):
            go.wait()
            for i in range(400):
                p = managed(4096 * (t + 1))
                if i % 8:
                    assert free(p) == 0
        ts = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for x in ts: x.start()
        for x in ts: x.join()
        out['flush'] = g.gc_flush()
        out['path'] = path()
    """, env=dict(ENV, **preloaded(native)))
    assert res["init"] == 1 and res["flush"] == 0 and err == "", (res, err)
    m = read(native, res["path"]).devices[0].managed
    per_thread = [4096 * (t + 1) for t in range(8)]
    assert m.allocs == 8 * 400 and m.alloc_bytes == 400 * sum(per_thread)
    assert m.live_bytes == 50 * sum(per_thread), m
