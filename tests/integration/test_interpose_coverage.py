"""The default census sees every driver entry point however the program reaches it, and says what it cannot size.

Against the mock driver (native/tests/mock_cuda.c), with the census library preloaded as `run` sets it:
- batched copies (CUDA 13's cuMemcpyBatchAsync_v2 and 12.8's cuMemcpyBatchAsync, handed out for an older CUDA
  version), 3D batches of pointers and arrays, and copies with attributes, sized copy by copy from the caller's
  arrays, by direction and host memory kind;
- a library linked against libcuda that calls the driver's functions directly, and looks them up with
  cuGetProcAddress itself (vLLM's compiled ops do both): the dynamic linker binds those calls to our exports;
- a driver function that puts work on the GPU and that the census has no wrapper for: its calls are counted as
  unsized, named in one line and in the segment, and the report says the totals miss them.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from test_injector import read, run_with_driver
from test_interpose import DRIVER, ENV, preloaded

BATCH = """
        from ctypes import Structure, c_ulonglong, POINTER, c_char
        class Operand(Structure):
            _fields_ = [('type', c_int), ('ptr', c_uint64), ('row', c_size_t), ('layer', c_size_t), ('hint', c_uint64)]
        class Op(Structure):
            _fields_ = [('src', Operand), ('dst', Operand), ('w', c_size_t), ('h', c_size_t), ('d', c_size_t),
                        ('order', c_int), ('flags', c_uint)]
        assert ctypes.sizeof(Op) == 112                # CUDA_MEMCPY3D_BATCH_OP
        def gpa_v(name, ftype, version):
            p, st = c_void_p(), c_int()
            assert gpa(name.encode(), byref(p), version, 0, byref(st)) == 0, name
            return ftype(p.value)
        ATTRS = ctypes.create_string_buffer(24)        # one CUmemcpyAttributes: the census does not read it
        U64 = ctypes.POINTER(c_uint64)
        B2 = ctypes.CFUNCTYPE(c_int, U64, U64, ctypes.POINTER(c_size_t), c_size_t, c_void_p, ctypes.POINTER(c_size_t),
                              c_size_t, c_void_p)
        B1 = ctypes.CFUNCTYPE(c_int, U64, U64, ctypes.POINTER(c_size_t), c_size_t, c_void_p, ctypes.POINTER(c_size_t),
                              c_size_t, ctypes.POINTER(c_size_t), c_void_p)
        B3 = ctypes.CFUNCTYPE(c_int, c_size_t, ctypes.POINTER(Op), c_ulonglong, c_void_p)
        A3 = ctypes.CFUNCTYPE(c_int, ctypes.POINTER(Op), c_ulonglong, c_void_p)
        WA = ctypes.CFUNCTYPE(c_int, c_uint64, c_uint64, c_size_t, c_void_p, c_void_p)
        def batch(f, pairs, v1=False):
            n = len(pairs)
            dsts = (c_uint64 * n)(*[d for d, s, b in pairs]); srcs = (c_uint64 * n)(*[s for d, s, b in pairs])
            sizes = (c_size_t * n)(*[b for d, s, b in pairs]); idx = (c_size_t * 1)(0)
            if v1:
                return f(dsts, srcs, sizes, n, ATTRS, idx, 1, byref(c_size_t()), 0x99)
            return f(dsts, srcs, sizes, n, ATTRS, idx, 1, 0x99)
        def ptr(p):
            return Operand(1, p, 0, 0, 0)
        def arr(a):
            return Operand(2, a, 0, 0, 0)              # CUarray, offset 0 (the union's first words)
        def ops(*spec):
            return (Op * len(spec))(*[Op(s, d, w, h, dd, 1, 0) for s, d, w, h, dd in spec])
"""


def test_batches_and_attribute_copies_are_sized_copy_by_copy(native, mock_lib, mock_cuda, tmp_path):
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, DRIVER.format(mock_cuda=mock_cuda) + BATCH + """
        out['init'] = g.InitializeInjection()
        b2 = gpa_v('cuMemcpyBatchAsync', B2, 13000)
        b1 = gpa_v('cuMemcpyBatchAsync', B1, 12080)    # 12.8's signature, with failIdx
        b3 = gpa_v('cuMemcpy3DBatchAsync', B3, 13000)
        a3 = gpa_v('cuMemcpy3DWithAttributesAsync', A3, 13000)
        wa = gpa_v('cuMemcpyWithAttributesAsync', WA, 13000)
        out['rc'] = [
            batch(b2, [(DEV, PIN, 1000), (DEV + 8192, PIN + 4096, 3000), (PAGE, DEV, 262144), (DEV + (1 << 20), DEV, 512),
                       (DEV, PIN, 0)]),
            batch(b1, [(PAGE, DEV, 262144), (PAGE + 262144, DEV + 262144, 262144)], v1=True),
            b3(2, ops((ptr(DEV), ptr(PAGE), 100, 2, 3), (arr(0xa004), ptr(PIN), 10, 1, 1)), 0, 0x99),
            a3(ops((ptr(PIN), ptr(DEV), 64, 1, 1)), 0, 0x99),
            wa(DEV + 4096, DEV, 4096, ATTRS, 0x99),
            b3(1, ops((arr(0xa0ff), ptr(PIN), 10, 1, 1)), 0, 0x99),   # an array the driver does not describe
        ]
        g.gc_step_begin(5)
        batch(b2, [(PAGE, DEV, 262144)] * 3)
        g.gc_step_end(gffi.NULL)
        out['flush'] = g.gc_flush()
        out['path'] = path()
    """, env=dict(ENV, **preloaded(native)))
    assert res["init"] == 1 and res["flush"] == 0 and res["rc"] == [0] * 6, (res, err)
    p = read(native, res["path"])
    dev = p.devices[0]
    got = {(dr, mem): (dev.copies.get(dr, mem).count, dev.copies.get(dr, mem).bytes)
           for dr in ("htod", "dtoh", "dtod") for mem in ("pageable", "pinned", "device")
           if dev.copies.get(dr, mem).count}
    assert got == {("htod", "pinned"): (2 + 1, 1000 + 3000 + 64),
                   ("dtoh", "pageable"): (1 + 2 + 1 + 3, 262144 * 3 + 600 + 262144 * 3),
                   ("dtoh", "pinned"): (1, 10 * 16),            # four float channels: 16 bytes an element
                   ("dtod", "device"): (1 + 1, 512 + 4096)}, got
    assert p.steps[5].copies["dtoh"].bytes == 262144 * 3 and p.steps[5].copies["dtoh"].count == 3
    assert p.calls_lost == 1 and p.unsized_calls == 0, (p.unsized_name, err)   # the undescribed array: seen, not sized, said
    assert any("could not" in g or "not counted" in g for g in p.gaps), p.gaps


LINKED_C = r"""
#include <stddef.h>
typedef int CUresult;
CUresult cuMemcpyHtoDAsync_v2(unsigned long long dst, const void *src, size_t n, void *stream);
CUresult cuGetProcAddress_v2(const char *s, void **pfn, int v, unsigned long long f, int *st);
int linked_copy(unsigned long long dst, const void *src, size_t n) { return cuMemcpyHtoDAsync_v2(dst, src, n, 0); }
int linked_gpa_copy(unsigned long long dst, const void *src, size_t n)
{
    void *p = 0;
    int st = 0;
    if (cuGetProcAddress_v2("cuMemcpyHtoDAsync", &p, 13000, 0, &st) != 0 || !p) return -1;
    return ((CUresult (*)(unsigned long long, const void *, size_t, void *))p)(dst, src, n, 0);
}
"""


def test_a_library_linked_against_libcuda_is_counted(native, mock_lib, mock_cuda, tmp_path):
    """Its direct calls bind to the preloaded library's exports; its own cuGetProcAddress answers with wrappers."""
    src = tmp_path / "linked.c"
    src.write_text(LINKED_C)
    lib = tmp_path / "liblinked.so"
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-O1", str(src), "-o", str(lib),
                    f"-L{Path(mock_cuda).parent}", "-l:libcuda.so.1"], check=True)
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, DRIVER.format(mock_cuda=mock_cuda) + f"""
        out['init'] = g.InitializeInjection()
        linked = ctypes.CDLL({str(lib)!r})
        out['rc'] = [linked.linked_copy(c_uint64(DEV), c_void_p(PIN), c_size_t(5000)),
                     linked.linked_gpa_copy(c_uint64(DEV), c_void_p(PAGE), c_size_t(7000))]
        out['calls'] = cuda.mock_cuda_calls()
        out['flush'] = g.gc_flush()
        out['path'] = path()
    """, env=dict(ENV, **preloaded(native)))
    assert res["init"] == 1 and res["rc"] == [0, 0] and res["calls"] == 2, (res, err)
    dev = read(native, res["path"]).devices[0]
    assert (dev.copies.get("htod", "pinned").count, dev.copies.get("htod", "pinned").bytes) == (1, 5000)
    assert (dev.copies.get("htod", "pageable").count, dev.copies.get("htod", "pageable").bytes) == (1, 7000)


def test_a_driver_function_without_a_wrapper_is_counted_named_and_reported(native, mock_lib, mock_cuda, tmp_path):
    """A copy function of a newer driver: fetched and called 3 times. The calls reach the driver unchanged, the
    segment counts and names them, one line says so, and the report says the totals miss them. A function that
    puts no work on the GPU passes through unremarked."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, DRIVER.format(mock_cuda=mock_cuda) + """
        out['init'] = g.InitializeInjection()
        future = proc('cuMemcpyFutureAsync', COPY)
        out['rc'] = [future(DEV, DEV + 64, 64, None) for _ in range(3)]
        out['calls'] = cuda.mock_cuda_calls()
        p, st = c_void_p(), c_int()
        gpa(b'cuArray3DGetDescriptor', byref(p), 13000, 0, byref(st))
        out['plain'] = p.value == ctypes.cast(cu.cuArray3DGetDescriptor_v2, c_void_p).value
        htod(DEV, PIN, 4096, None)
        out['flush'] = g.gc_flush()
        out['path'] = path()
    """, env=dict(ENV, **preloaded(native)))
    assert res["init"] == 1 and res["rc"] == [0, 0, 0] and res["calls"] == 3, (res, err)
    p = read(native, res["path"])
    assert (p.unsized_calls, p.unwrapped, p.unsized_name) == (3, 0, "cuMemcpyFutureAsync")
    assert p.devices[0].copies.get("htod", "pinned").bytes == 4096        # what it can size stays exact
    assert err.count("cuMemcpyFutureAsync") == 1 and "no wrapper" in err, err
    from otel_gpu_census.report import render as report
    text = report.render_text([p])
    assert "3 calls of cuMemcpyFutureAsync" in text and "NOT EXACT" in text, text


PATHS = """
        from ctypes import Structure, c_int, c_size_t
        class M2D(Structure):
            _fields_ = [('sx', c_size_t), ('sy', c_size_t), ('st', c_int), ('sh', c_void_p), ('sd', c_uint64),
                        ('sa', c_void_p), ('sp', c_size_t), ('dx', c_size_t), ('dy', c_size_t), ('dt', c_int),
                        ('dh', c_void_p), ('dd', c_uint64), ('da', c_void_p), ('dp', c_size_t), ('w', c_size_t),
                        ('h', c_size_t)]
        class M3D(Structure):
            _fields_ = [('sx', c_size_t), ('sy', c_size_t), ('sz', c_size_t), ('slod', c_size_t), ('st', c_int),
                        ('sh', c_void_p), ('sd', c_uint64), ('sa', c_void_p), ('sctx', c_void_p), ('sp', c_size_t),
                        ('sheight', c_size_t), ('dx', c_size_t), ('dy', c_size_t), ('dz', c_size_t),
                        ('dlod', c_size_t), ('dt', c_int), ('dh', c_void_p), ('dd', c_uint64), ('da', c_void_p),
                        ('dctx', c_void_p), ('dp', c_size_t), ('dheight', c_size_t), ('w', c_size_t), ('h', c_size_t),
                        ('d', c_size_t)]
        HOST, DEVICE = 1, 2
        F = ctypes.CFUNCTYPE
        V, U, S = c_void_p, c_uint64, c_size_t
        def f(name, *args):
            return proc(name, F(c_int, *args))
        ARR = 0xa004
        CTX0, CTX1 = 0xc000, 0xc001
"""


def test_every_copy_memset_and_launch_path_is_counted_at_its_call(native, mock_lib, mock_cuda, tmp_path):
    """On CPU, the mock driver: each copy, memset and launch function the default census wraps, called through the
    wrapper cuGetProcAddress hands out, counted with its bytes, direction and host memory kind from its arguments
    (2D, 3D and peer copies from their descriptors, arrays as device memory, peer copies as sent by one device and
    received by the other)."""
    res, err, d = run_with_driver(native, mock_lib, mock_cuda, tmp_path, DRIVER.format(mock_cuda=mock_cuda) + PATHS + """
        out['init'] = g.InitializeInjection()
        rc = []
        rc.append(f('cuMemcpy', U, U, S)(DEV, PAGE, 1001))                     # UVA: htod pageable
        rc.append(f('cuMemcpy', U, U, S)(PIN, DEV, 1003))                      # UVA: dtoh pinned
        rc.append(f('cuMemcpyHtoD', U, V, S)(DEV, PIN, 1005))
        rc.append(f('cuMemcpyDtoD', U, U, S)(DEV + 8, DEV, 1007))
        rc.append(f('cuMemcpyDtoHAsync', V, U, S, V)(PAGE, DEV, 1009, 0x5))
        rc.append(f('cuMemcpyDtoDAsync', U, U, S, V)(DEV, DEV + 8, 1011, 0x5))
        rc.append(f('cuMemcpyDtoA', V, S, U, S)(ARR, 0, DEV, 1013))
        rc.append(f('cuMemcpyAtoD', U, V, S, S)(DEV, ARR, 0, 1015))
        rc.append(f('cuMemcpyHtoA', V, S, V, S)(ARR, 0, PIN, 1017))
        rc.append(f('cuMemcpyAtoH', V, V, S, S)(PAGE, ARR, 0, 1019))
        rc.append(f('cuMemcpyAtoA', V, S, V, S, S)(ARR, 0, ARR, 0, 1021))
        m2 = [M2D(st=HOST, sh=PAGE, dt=DEVICE, dd=DEV, w=100, h=3), M2D(st=DEVICE, sd=DEV, dt=HOST, dh=PIN, w=101, h=2),
              M2D(st=DEVICE, sd=DEV, dt=DEVICE, dd=DEV + 4096, w=103, h=2)]
        rc.append(f('cuMemcpy2D', ctypes.POINTER(M2D))(byref(m2[0])))
        rc.append(f('cuMemcpy2DUnaligned', ctypes.POINTER(M2D))(byref(m2[1])))
        rc.append(f('cuMemcpy2DAsync', ctypes.POINTER(M2D), V)(byref(m2[2]), 0x5))
        m3 = [M3D(st=HOST, sh=PAGE, dt=DEVICE, dd=DEV, w=10, h=2, d=3), M3D(st=DEVICE, sd=DEV, dt=DEVICE, dd=DEV, w=7, h=1, d=1),
              M3D(st=DEVICE, sd=DEV, sctx=CTX0, dt=DEVICE, dd=DEV + 32, dctx=CTX1, w=11, h=1, d=1)]
        rc.append(f('cuMemcpy3D', ctypes.POINTER(M3D))(byref(m3[0])))
        rc.append(f('cuMemcpy3DAsync', ctypes.POINTER(M3D), V)(byref(m3[1]), 0x5))
        rc.append(f('cuMemcpy3DPeer', ctypes.POINTER(M3D))(byref(m3[2])))
        rc.append(f('cuMemcpyPeer', U, V, U, V, S)(DEV + 16, CTX1, DEV, CTX0, 1023))    # device 0 to device 1
        rc.append(f('cuMemcpyPeerAsync', U, V, U, V, S, V)(DEV + 16, CTX0, DEV, CTX0, 1025, 0x5))   # within one
        rc.append(f('cuMemsetD8', U, ctypes.c_ubyte, S)(DEV, 1, 1027))
        rc.append(f('cuMemsetD16', U, ctypes.c_ushort, S)(DEV, 1, 1029))
        rc.append(f('cuMemsetD32', U, c_uint, S)(DEV, 1, 1031))
        rc.append(f('cuMemsetD8Async', U, ctypes.c_ubyte, S, V)(DEV, 1, 1033, 0x5))
        rc.append(f('cuMemsetD16Async', U, ctypes.c_ushort, S, V)(DEV, 1, 1035, 0x5))
        rc.append(f('cuMemsetD2D8', U, S, ctypes.c_ubyte, S, S)(DEV, 2048, 1, 10, 3))
        rc.append(f('cuMemsetD2D16', U, S, ctypes.c_ushort, S, S)(DEV, 2048, 1, 10, 3))
        rc.append(f('cuMemsetD2D32', U, S, c_uint, S, S)(DEV, 2048, 1, 10, 3))
        rc.append(f('cuMemsetD2D32Async', U, S, c_uint, S, S, V)(DEV, 2048, 1, 5, 2, 0x5))
        coop = f('cuLaunchCooperativeKernel', V, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, V, V)
        rc += [coop(None, 1, 1, 1, 32, 1, 1, 0, 0x5, None) for _ in range(2)]
        out['rc'] = rc
        out['calls'] = cuda.mock_cuda_calls()
        out['flush'] = g.gc_flush()
        out['path'] = path()
    """, env=dict(ENV, **preloaded(native)))
    assert res["init"] == 1 and set(res["rc"]) == {0} and res["calls"] == len(res["rc"]), (res, err)
    p = read(native, res["path"])
    d0, d1 = p.devices[0], p.devices[1]
    got = {k: (s.count, s.bytes) for k, s in d0.copies.cells.items() if s.count}
    assert got == {("htod", "pageable"): (3, 1001 + 300 + 60), ("htod", "pinned"): (2, 1005 + 1017),
                   ("dtoh", "pinned"): (2, 1003 + 202), ("dtoh", "pageable"): (2, 1009 + 1019),
                   ("dtod", "device"): (8, 1007 + 1011 + 1013 + 1015 + 1021 + 206 + 7 + 1025),
                   ("ptop", "device"): (2, 1023 + 11)}, got
    assert (d1.peer_recv.count, d1.peer_recv.bytes) == (2, 1023 + 11)
    assert (d0.memset.count, d0.memset.bytes) == (9, 1027 + 2 * 1029 + 4 * 1031 + 1033 + 2 * 1035 + 30 + 60 + 120 + 40)
    assert d0.eager_launches == 2 and p.calls_lost == 0 and not p.gaps and err == "", (p.gaps, err)
