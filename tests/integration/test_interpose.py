"""The census library preloaded (LD_PRELOAD): it answers the process's dlsym and the driver's cuGetProcAddress
with wrappers of the driver's launch, copy, memset and graph calls, and under OTEL_GPU_CENSUS_ACTIVITY=off
counts those calls itself: CUPTI is never loaded (every CUPTI mode taxes each launch: docs/measurements.md).

The process looks the driver up as the CUDA runtime does (dlsym of cuGetProcAddress_v2, then every entry point
through it, the per-thread-stream twins too) in the mock driver (native/tests/mock_cuda.c), whose test graphs
can be walked; then calls what it got."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_injector import read, run_with_driver

ROOT = Path(__file__).resolve().parents[2]

DRIVER = """
        import ctypes
        from ctypes import c_int, c_uint, c_void_p, c_uint64, c_ulong, c_size_t, byref
        cffi_cuda.cdef('void mock_cuda_set_memory(unsigned long long, unsigned long long, unsigned long long, '
                       'unsigned long long); void mock_cuda_set_result(int); int mock_cuda_calls(void); '
                       'void mock_cuda_set_device(int);')
        DEV, PIN, PAGE = 0x7000_0000_0000, 0x1000_0000, 0x5000_0000
        cuda.mock_cuda_set_memory(DEV, DEV + (1 << 40), PIN, PIN + (1 << 28))
        cu = ctypes.CDLL({mock_cuda!r})            # looked up through the process's dlsym, as cudart does
        GPA = ctypes.CFUNCTYPE(c_int, ctypes.c_char_p, ctypes.POINTER(c_void_p), c_int, c_uint64, ctypes.POINTER(c_int))
        gpa = GPA(ctypes.cast(cu.cuGetProcAddress_v2, c_void_p).value)
        def proc(name, ftype, per_thread=False):
            p, st = c_void_p(), c_int()
            assert gpa(name.encode(), byref(p), 13000, 2 if per_thread else 0, byref(st)) == 0, name
            return ftype(p.value)
        LAUNCH = ctypes.CFUNCTYPE(c_int, c_void_p, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_void_p,
                                  c_void_p, c_void_p)
        EX = ctypes.CFUNCTYPE(c_int, c_void_p, c_void_p, c_void_p, c_void_p)
        HTOD = ctypes.CFUNCTYPE(c_int, c_uint64, c_void_p, c_size_t, c_void_p)
        DTOH = ctypes.CFUNCTYPE(c_int, c_void_p, c_uint64, c_size_t)
        COPY = ctypes.CFUNCTYPE(c_int, c_uint64, c_uint64, c_size_t, c_void_p)
        SET32 = ctypes.CFUNCTYPE(c_int, c_uint64, c_uint, c_size_t, c_void_p)
        INST = ctypes.CFUNCTYPE(c_int, ctypes.POINTER(c_ulong), c_ulong, c_uint64)
        GLAUNCH = ctypes.CFUNCTYPE(c_int, c_ulong, c_void_p)
        DESTROY = ctypes.CFUNCTYPE(c_int, c_ulong)
        BEGIN = ctypes.CFUNCTYPE(c_int, c_ulong, c_int)
        END = ctypes.CFUNCTYPE(c_int, c_ulong, ctypes.POINTER(c_void_p))
        launch, launch_pt = proc('cuLaunchKernel', LAUNCH), proc('cuLaunchKernel', LAUNCH, True)
        launch_ex = proc('cuLaunchKernelEx', EX)
        htod, htod_pt = proc('cuMemcpyHtoDAsync', HTOD), proc('cuMemcpyHtoDAsync', HTOD, True)
        dtoh, copy, set32 = proc('cuMemcpyDtoH', DTOH), proc('cuMemcpyAsync', COPY), proc('cuMemsetD32Async', SET32)
        inst, glaunch, destroy = proc('cuGraphInstantiate', INST), proc('cuGraphLaunch', GLAUNCH), proc('cuGraphExecDestroy', DESTROY)
        begin, end = proc('cuStreamBeginCapture', BEGIN), proc('cuStreamEndCapture', END)
        def k(f=launch, stream=None, fn=None):
            return f(fn, 1, 1, 1, 32, 1, 1, 0, stream, None, None)
        config = ctypes.create_string_buffer(64)   # a CUlaunchConfig on the NULL stream
        def graph(nodes):
            ex = c_ulong()
            assert inst(byref(ex), 0x6000 + nodes, 0) == 0
            return ex.value
"""

ENV = {"OTEL_GPU_CENSUS_ACTIVITY": "off"}


def preloaded(native):
    return {"LD_PRELOAD": native[2]}


def test_preloaded_counts_every_launch_copy_and_graph_at_its_call_without_cupti(native, mock_lib, mock_cuda, tmp_path):
    """Launches of both stream flavours and through cuLaunchKernelEx count, failed ones and ones recorded into a
    capture do not; copies keep bytes, direction and host memory kind; a graph instantiated through us is walked
    once and each launch counts its kernels; a step gets its launches, graph kernels and copies. CUPTI is never
    loaded: no subscriber, no callback, no activity buffer."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, DRIVER.format(mock_cuda=mock_cuda) + """
        out['init'] = g.InitializeInjection()

        for _ in range(3): k()
        for _ in range(2): k(launch_pt)
        out['ex'] = launch_ex(config, None, None, None)
        cuda.mock_cuda_set_result(1)
        out['failed'] = [k(), htod(DEV, PIN, 999, None), glaunch(0x7005, None)]
        cuda.mock_cuda_set_result(0)
        begin(0x55, 0)
        k(stream=0x55)                           # recorded into the capture: its graph's launches count it
        htod(DEV, PIN, 777, 0x55)
        k()                                      # another stream: runs
        end(0x55, byref(c_void_p()))
        htod(DEV, PIN, 1 << 20, None)            # pinned
        htod_pt(DEV, PAGE, 4096, None)           # pageable, the per-thread stream
        dtoh(PAGE, DEV, 643_000_000)             # synchronous, pageable
        copy(DEV + 4096, DEV, 2048, None)        # UVA: device to device
        set32(DEV, 0, 256, None)                 # 1,024 bytes
        ex = graph(5)
        for _ in range(3): glaunch(ex, None)
        unknown = graph(0)                       # nothing to walk: an empty graph (0 kernels), known
        glaunch(unknown, None)
        g.gc_step_begin(9)
        k(); k()
        glaunch(ex, None)
        htod(DEV, PIN, 3 << 20, None)
        g.gc_step_end(gffi.NULL)
        destroy(ex)
        glaunch(ex, None)                        # a destroyed exec (the driver would refuse): contents unknown
        out['calls'] = cuda.mock_cuda_calls()
        out['flush'] = g.gc_flush()
        out['path'] = path()
        out['cupti_after'] = [mock.mock_registered()]
    """, env=dict(ENV, **preloaded(native)))
    assert res["init"] == 1 and res["flush"] == 0 and res["ex"] == 0 and res["failed"] == [1, 1, 1]
    assert res["cupti_after"] == [0] and err == "", err
    p = read(native, res["path"])
    dev = p.devices[0]
    assert p.kernels.preloaded and p.kernels.untimed and p.cupti_version == 0   # the default collector: no CUPTI
    assert (dev.eager_launches, dev.graph_launches, dev.graph_kernel_count) == (3 + 2 + 1 + 1 + 2, 3 + 1 + 1 + 1, 20)
    assert dev.kernel_count == 9 + 20 and p.graphs.unknown == 1
    got = {(dr, mem): (dev.copies.get(dr, mem).count, dev.copies.get(dr, mem).bytes)
           for dr in ("htod", "dtoh", "dtod") for mem in ("pageable", "pinned", "device")
           if dev.copies.get(dr, mem).count}
    assert got == {("htod", "pinned"): (2, (1 << 20) + (3 << 20)), ("htod", "pageable"): (1, 4096),
                   ("dtoh", "pageable"): (1, 643_000_000), ("dtod", "device"): (1, 2048)}, got
    assert (dev.memset.count, dev.memset.bytes) == (1, 1024)
    st = p.steps[9]
    assert (st.eager_launches, st.kernel_count, st.copies["htod"].bytes) == (2, 2 + 5, 3 << 20)
    assert p.calls_lost == 0 and p.launches_lost == 0
    from otel_gpu_census.report import cost
    from otel_gpu_census.report import render as report
    e = cost.estimate(p)      # the wrappers' prices, no event pair under ACTIVITY=off, copies unpriced
    assert p.kernels.preloaded and (e.launches_counted, e.graph_launches, e.pairs_eager, e.pairs_graph) == (9, 6, 0, 0)
    assert abs(e.seconds - (9 * 0.137e-6 + 6 * 0.790e-6)) < 1e-12
    text = report.render_text([p], requests=1)
    assert "seen by the census library preloaded: CUPTI was never loaded" in text
    assert "(9 eager launches counted x 0.137 us, 6 graph launches x 0.79 us; 6 copies and memsets not priced" in text, text
    assert "event pairs" not in text and "kernel time not measured" in text


def test_preloaded_without_activity_off_only_passes_calls_through(native, mock_lib, mock_cuda, tmp_path):
    """Preloaded under the precise census (CUPTI's records): the wrappers count nothing themselves, so nothing
    is counted twice; the driver still gets every call."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, DRIVER.format(mock_cuda=mock_cuda) + """
        out['init'] = g.InitializeInjection()
        for _ in range(4): k()
        ex = graph(3)
        glaunch(ex, None)
        htod(DEV, PIN, 1 << 20, None)
        out['calls'] = cuda.mock_cuda_calls()
        queue(cr.memcpy('dtoh', 4096, T, T + 10, dst='pinned'), cr.MEMCPY_T)   # CUPTI's record of a copy
        out['flush'] = g.gc_flush()
        out['path'] = path()
        out['registered'] = mock.mock_registered()
    """, env={**preloaded(native), "OTEL_GPU_CENSUS_ACTIVITY": "on"})
    assert res["init"] == 1 and res["calls"] == 7 and res["registered"] == 1
    p = read(native, res["path"])
    assert not p.flags & 0x40 and not p.kernels.untimed
    dev = p.devices[0]
    assert (dev.eager_launches, dev.graph_launches, dev.kernel_count) == (0, 0, 0)
    assert dev.copies.get("dtoh", "pinned").bytes == 4096 and dev.copies.get("htod", "pinned").bytes == 0


def test_rtld_next_still_searches_after_its_caller(tmp_path, native):
    """RTLD_NEXT is relative to the library that calls dlsym; the census library's dlsym passes it on as a tail
    call, so glibc still sees that caller: probe 1's dlsym(RTLD_NEXT, "probe") finds probe 2, not itself."""
    cc = os.environ.get("CC", "cc")
    libs = []
    for n in (1, 2):
        out = tmp_path / f"libprobe{n}.so"
        subprocess.run([cc, "-shared", "-fPIC", "-O2", f"-DPROBE={n}", str(ROOT / "native" / "tests" / "next_probe.c"),
                        "-o", str(out), "-ldl"], check=True)
        libs.append(str(out))
    code = ("import ctypes; l = ctypes.CDLL(%r); print(l.next_probe(), ctypes.CDLL(None).getpid() > 0)" % libs[0])
    env = dict(os.environ, LD_PRELOAD=":".join([native[2]] + libs))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["2", "True"]


def test_not_preloaded_the_default_collector_says_so_and_cupti_counts(native, mock_lib, mock_cuda, tmp_path):
    """Without the preload nothing answers dlsym: one line says so and CUPTI's activity records count instead."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, """
        out['init'] = g.InitializeInjection()
        out['registered'] = mock.mock_registered()
    """, env=ENV)
    assert res["init"] == 1 and res["registered"] == 1
    assert err.count("the default collector needs the census library preloaded") == 1, err


def test_preloaded_counts_every_launch_of_many_threads_and_none_of_a_forked_child(native, mock_lib, mock_cuda, tmp_path):
    """Eight threads launching at once through the wrappers, on two devices: every launch counted once, on its
    thread's device (asked again once a context was destroyed: a new one may sit at its address). A child forked meanwhile launches too: nothing of it reaches the parent's segment, and the
    child exits cleanly (its wrappers only pass calls through)."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, DRIVER.format(mock_cuda=mock_cuda) + """
        import threading
        out['init'] = g.InitializeInjection()
        go = threading.Barrier(8)
        def work(i):
            go.wait()
            for _ in range(5000):
                k()
        ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in ts: t.start()
        pid = os.fork()
        if pid == 0:
            for _ in range(1000): k()
            ex = graph(4); glaunch(ex, None); htod(DEV, PIN, 12345, None)
            os._exit(0)
        for t in ts: t.join()
        out['child'] = os.waitpid(pid, 0)[1]
        cuda.mock_cuda_set_device(1)             # this thread's context is device 1's from now on
        for _ in range(7): k()
        # a context destroyed and another made at its address on device 0: its launches are device 0's
        cffi_cuda.cdef('void mock_cuda_set_one_context_address(int);')
        cuda.mock_cuda_set_one_context_address(1)
        for _ in range(2): k()                   # cached: device 1's address, still device 1
        destroy_ctx = proc('cuCtxDestroy', ctypes.CFUNCTYPE(c_int, c_void_p))
        destroy_ctx(0xc000)
        cuda.mock_cuda_set_device(0)
        for _ in range(3): k()
        out['flush'] = g.gc_flush()
        out['path'] = path()
    """, env=dict(ENV, **preloaded(native)))
    assert res["init"] == 1 and res["child"] == 0 and res["flush"] == 0
    p = read(native, res["path"])
    assert p.devices[0].eager_launches == 8 * 5000 + 3 and p.devices[1].eager_launches == 7 + 2
    assert p.devices[0].graph_launches == 0 and p.devices[0].copies.get("htod", "pinned").count == 0
    assert p.launches_lost == 0 and len(list(d.glob("*.seg"))) == 1


def test_preloaded_copy_that_is_not_the_injector_says_so_and_cupti_counts(native, mock_lib, mock_cuda, tmp_path):
    """LD_PRELOAD naming another file than CUDA_INJECTION64_PATH: two copies of the library in the process, and the
    injector's copy handed nothing out. It says so in one line and counts through CUPTI's activity records; the
    preloaded copy's wrappers pass every call through."""
    import shutil
    other = tmp_path / "copy" / "libotel_gpu_census.so"
    other.parent.mkdir()
    shutil.copy(native[2], other)
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, DRIVER.format(mock_cuda=mock_cuda) + """
        out['init'] = g.InitializeInjection()
        out['registered'] = mock.mock_registered()
        for _ in range(3): k()
        out['calls'] = cuda.mock_cuda_calls()
    """, env=dict(ENV, LD_PRELOAD=str(other)))
    assert res["init"] == 1 and res["registered"] == 1 and res["calls"] == 3
    assert err.count("LD_PRELOAD and CUDA_INJECTION64_PATH name different files") == 1, err
    assert not list(d.glob("*.seg")) or not read(native, next(d.glob("*.seg"))).kernels.preloaded
