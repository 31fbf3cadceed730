"""OTEL_GPU_CENSUS_ACTIVITY=off: every kernel, copy and memset counted at its CUDA call, CUPTI's activity API
never set up (on the H200 it taxes every CUDA call once used: docs/measurements.md §20).

The injector runs against the mock libcupti (callbacks with the driver calls' real parameter layouts) and the
mock driver (pointer attributes: device memory, pinned host memory, the rest pageable), as in
test_injector.py."""
from __future__ import annotations

from test_injector import CONTROL_SWITCH, read, run_with_driver

# The driver calls' parameters, in the order of their arguments (cuda.h), as CUPTI passes them.
CALLS = """
        pffi = cffi.FFI()
        pffi.cdef('''
            typedef struct { uint64_t dst; const void *src; size_t bytes; void *stream; } htod_t;
            typedef struct { void *dst; uint64_t src; size_t bytes; } dtoh_t;
            typedef struct { uint64_t dst, src; size_t bytes; void *stream; } copy_t;
            typedef struct { uint64_t dst; unsigned int value; size_t n; void *stream; } set_t;
            typedef struct { uint64_t dst; size_t pitch; unsigned char value; size_t width, height; } set2d_t;
            typedef struct { void *exec; void *stream; } graph_t;
            typedef struct { void *p; void *stream; } ptr_t;
            typedef struct {
                size_t srcXInBytes, srcY, srcZ, srcLOD; int srcMemoryType; const void *srcHost; uint64_t srcDevice;
                void *srcArray; void *reserved0; size_t srcPitch, srcHeight;
                size_t dstXInBytes, dstY, dstZ, dstLOD; int dstMemoryType; void *dstHost; uint64_t dstDevice;
                void *dstArray; void *reserved1; size_t dstPitch, dstHeight;
                size_t WidthInBytes, Height, Depth;
            } memcpy3d_t;
        ''')
        mffi.cdef('int mock_api_call_params(int, uint32_t, uint32_t, const void *);')
        cffi_cuda.cdef('void mock_cuda_set_memory(unsigned long long, unsigned long long, unsigned long long, '
                       'unsigned long long); void mock_cuda_set_capturing(unsigned long);')
        DRV = 1
        DEV, PIN, PAGE = 0x7000_0000_0000, 0x1000_0000, 0x5000_0000
        cuda.mock_cuda_set_memory(DEV, DEV + (1 << 40), PIN, PIN + (1 << 28))
        keep = []
        def call(name, ctype, **fields):     # each call its own correlation id, as CUPTI numbers them
            p = pffi.new(ctype + ' *', fields)
            keep.append(p)
            return mock.mock_api_call_params(DRV, getattr(rlib, 'CUPTI_DRIVER_TRACE_CBID_' + name), 1000 + len(keep), p)
        def ptr(v):
            return pffi.cast('void *', v)
        mock.mock_set_api_device(1)      # device 0's context
        RT_LAUNCH, DRV_LAUNCH = rlib.CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000, rlib.CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel
        def torch_launch(n=1):
            for _ in range(n):
                mock.mock_api_call_nested(0, RT_LAUNCH, 1, DRV_LAUNCH)
        KINDS = ('CONCURRENT_KERNEL', 'MEMCPY', 'MEMCPY2', 'MEMSET', 'GRAPH_TRACE', 'KERNEL')
        def activity_used():
            return [mock.mock_registered()] + [mock.mock_enabled_globally(getattr(rlib, 'CUPTI_ACTIVITY_KIND_' + k))
                                               for k in KINDS]
"""

ENV = {"OTEL_GPU_CENSUS_ATTACH": "cuinit", "OTEL_GPU_CENSUS_ACTIVITY": "off", "OTEL_GPU_CENSUS_KERNELS": "counted"}


def test_activity_off_counts_every_copy_memset_and_launch_at_its_call_without_the_activity_api(
        native, mock_lib, mock_cuda, tmp_path, records):
    """Bytes, direction and host memory kind from the calls' parameters and the driver's pointer attributes;
    failed calls, empty ones and calls into a stream capture count nothing; a copy whose size cannot be read
    is counted as lost, never guessed; no activity buffer is registered and no activity kind enabled."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, CALLS + """
        out['init'] = g.InitializeInjection()
        out['activity'] = activity_used()
        out['cb'] = [mock.mock_callback_enabled(DRV, getattr(rlib, 'CUPTI_DRIVER_TRACE_CBID_' + n)) for n in
                     ('cuMemcpyHtoDAsync_v2', 'cuMemcpyHtoDAsync_v2_ptsz', 'cuMemcpyAsync', 'cuMemsetD32Async',
                      'cuGraphLaunch', 'cuMemcpyHtoD')]
        call('cuMemcpyHtoDAsync_v2', 'htod_t', dst=DEV, src=ptr(PIN), bytes=1 << 20)          # pinned
        call('cuMemcpyHtoDAsync_v2_ptsz', 'htod_t', dst=DEV, src=ptr(PAGE), bytes=4096)       # pageable
        call('cuMemcpyDtoH_v2', 'dtoh_t', dst=ptr(PAGE), src=DEV, bytes=643_000_000)          # synchronous
        call('cuMemcpyAsync', 'copy_t', dst=PIN + 64, src=DEV + 8, bytes=1000)               # UVA: dtoh pinned
        call('cuMemcpyAsync', 'copy_t', dst=DEV + 4096, src=DEV, bytes=2048)                 # UVA: dtod
        m = pffi.new('memcpy3d_t *', dict(srcMemoryType=2, srcDevice=DEV, dstMemoryType=1, dstHost=ptr(PAGE),
                                          WidthInBytes=100, Height=3, Depth=2))
        keep.append(m)
        call('cuMemcpy3DAsync_v2', 'ptr_t', p=m)                                            # 600 B dtoh pageable
        call('cuMemsetD32Async', 'set_t', dst=DEV, value=0, n=256)                          # 1,024 B
        call('cuMemsetD2D8_v2', 'set2d_t', dst=DEV, pitch=128, value=1, width=100, height=3)  # 300 B
        mock.mock_set_api_result(1)
        call('cuMemcpyHtoDAsync_v2', 'htod_t', dst=DEV, src=ptr(PIN), bytes=999)            # failed: nothing
        mock.mock_set_api_result(0)
        call('cuMemcpyHtoDAsync_v2', 'htod_t', dst=DEV, src=ptr(PIN), bytes=0)              # empty: nothing
        mock.mock_api_call(0, rlib.CUPTI_RUNTIME_TRACE_CBID_cudaStreamBeginCapture_v10000, 3)
        cuda.mock_cuda_set_capturing(0x77)
        call('cuMemcpyHtoDAsync_v2', 'htod_t', dst=DEV, src=ptr(PIN), bytes=777, stream=ptr(0x77))  # a node
        call('cuMemcpyBatchAsync_v2', 'copy_t', dst=0, src=0, bytes=0)                     # not sized: lost
        g.gc_step_begin(9)
        call('cuMemcpyHtoDAsync_v2', 'htod_t', dst=DEV, src=ptr(PIN), bytes=3 << 20)
        torch_launch(4)
        g.gc_step_end(gffi.NULL)
        torch_launch(1)
        for _ in range(3):
            call('cuGraphLaunch', 'graph_t', exec=ptr(0x1234))   # the mock driver cannot walk it: unknown
        out['flush'] = g.gc_flush()
        out['path'] = path()
        out['after'] = activity_used()
    """, env=ENV)
    assert res["init"] == 1 and res["flush"] == 0 and err == ""
    assert res["activity"] == [0] * 7 and res["after"] == [0] * 7
    assert res["cb"] == [1, 1, 1, 1, 1, 0]       # the v1 copy (32-bit pointers) is not followed
    p = read(native, res["path"])
    dev = p.devices[0]
    got = {(dr, mem): (dev.copies.get(dr, mem).count, dev.copies.get(dr, mem).bytes)
           for dr in ("htod", "dtoh", "dtod") for mem in ("pageable", "pinned", "device")
           if dev.copies.get(dr, mem).count}
    assert got == {("htod", "pinned"): (2, (1 << 20) + (3 << 20)), ("htod", "pageable"): (1, 4096),
                   ("dtoh", "pageable"): (2, 643_000_600), ("dtoh", "pinned"): (1, 1000),
                   ("dtod", "device"): (1, 2048)}, got
    assert (dev.memset.count, dev.memset.bytes) == (2, 1324)
    assert (dev.eager_launches, dev.graph_launches, p.graphs.unknown, dev.kernel_count) == (5, 3, 3, 5)
    assert p.calls_lost == 1 and p.launches_lost == 0
    assert dev.uuid.replace("-", "").removeprefix("GPU") == "a0" * 16, dev.uuid   # named without any buffer
    assert p.kernels.untimed and p.kernels.name == "calls" and p.kernels.fraction == 0.0
    assert p.kernels.traced_between(0, 10**18) == 0     # spans say kernel_traced_ratio 0, not 1 (the H200's run)
    # no duration is measured: kernel time unknown, never a 0 that reads as measured
    kt = p.kernel_time(dev)
    assert (kt.ns, kt.unknown, kt.estimated) == (0, True, False)
    assert dev.kernel_ns == dev.busy_ns == dev.copies.get("dtoh", "pageable").ns == 0
    from otel_gpu_census import report
    text = report.render_text([p], requests=1)
    assert "kernels counted at their calls (OTEL_GPU_CENSUS_ACTIVITY=off)" in text
    assert "kernel time not measured (OTEL_GPU_CENSUS_ACTIVITY=off)" in text and "(estimated)" not in text
    assert "busy not measured" in text and "graph launches 3 (spans not measured)" in text
    assert "5 kernels per request, kernel time not measured" in text and "0.000000" not in text   # no time reads as 0
    assert "5 launches counted x 1.31 us" in text and "1 copies, memsets or graph launches were seen but could not" in text
    out = report.to_dict([p], requests=1)
    assert out["processes"][0]["devices"][0]["kernel_time_unknown"] is True
    st = p.steps[9]
    assert (st.eager_launches, st.kernel_count, st.copies["htod"].count, st.copies["htod"].bytes) == (4, 4, 1, 3 << 20)
    assert p.step_max == 9                       # the step's call came: the settler may split it


def test_activity_off_pauses_with_the_census_and_ignores_record_switches(native, mock_lib, mock_cuda, tmp_path, records):
    """census=off stops counting calls and census=on resumes it; kernels= and graphs= have no records to
    switch (one line for both, nothing changes); the activity API stays untouched throughout."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, CALLS + CONTROL_SWITCH + """
        g.InitializeInjection()
        call('cuMemcpyHtoDAsync_v2', 'htod_t', dst=DEV, src=ptr(PIN), bytes=100)
        out['off'] = switch('census=off kernels=all graphs=node\\n', True)
        call('cuMemcpyHtoDAsync_v2', 'htod_t', dst=DEV, src=ptr(PIN), bytes=10_000)          # paused: nothing
        torch_launch(3)
        out['on'] = switch('census=on\\n', False)
        call('cuMemcpyHtoDAsync_v2', 'htod_t', dst=DEV, src=ptr(PIN), bytes=1)
        torch_launch(2)
        g.gc_finish()
        out['activity'] = activity_used()
    """, env=dict(ENV, OTEL_GPU_CENSUS_FLUSH_MS="20"))
    assert res["off"] and res["on"] and res["activity"] == [0] * 7
    assert 'ignoring "kernels=all" (OTEL_GPU_CENSUS_ACTIVITY=off: no activity records to switch); "graphs=node"' in err
    p = read(native, next(d.glob("*.seg")))
    dev = p.devices[0]
    assert (dev.copies.get("htod", "pinned").count, dev.copies.get("htod", "pinned").bytes) == (2, 101)
    assert dev.eager_launches == 2 and p.graphs.paused_ns > 0 and p.state_name == "exited"
    assert p.kernels.name == "calls"
