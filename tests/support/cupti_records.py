"""Real CUPTI activity records, built on a CPU from the CUPTI headers.

cffi's API mode compiles a tiny extension against <cupti.h> from the nvidia-cuda-cupti wheel: the
struct layouts (offsets, sizes, enum values) come from the header itself, so a record made here is
byte-for-byte what libcupti writes into an activity buffer. The tally is then fed these records.

Also builds (once per test session) the native library under test: `native()` returns
(ffi, lib, path) for libotel_gpu_census.so with the public header's API declared.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import cffi

ROOT = Path(__file__).resolve().parents[2]
HEADER = ROOT / "native" / "include" / "gpu_census.h"
try:
    import otel_gpu_census  # noqa: F401  (installed)
except ImportError:  # a source checkout, also in subprocess writers that did not set PYTHONPATH
    sys.path.insert(0, str(ROOT / "src"))

KERNEL_T = "CUpti_ActivityKernel13"
MEMCPY_T = "CUpti_ActivityMemcpy7"
MEMSET_T = "CUpti_ActivityMemset5"
PTOP_T = "CUpti_ActivityMemcpyPtoP4"
GRAPH_T = "CUpti_ActivityGraphTrace2"
EXT_T = "CUpti_ActivityExternalCorrelation"
UM_T = "CUpti_ActivityUnifiedMemoryCounter3"

_CDEF = f"""
typedef enum {{
    CUPTI_ACTIVITY_KIND_INVALID, CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET,
    CUPTI_ACTIVITY_KIND_KERNEL, CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY2,
    CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION, CUPTI_ACTIVITY_KIND_GRAPH_TRACE,
    CUPTI_ACTIVITY_KIND_DRIVER, CUPTI_ACTIVITY_KIND_NAME, CUPTI_ACTIVITY_KIND_UNIFIED_MEMORY_COUNTER, ...
}} CUpti_ActivityKind;
typedef enum {{
    CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_BYTES_TRANSFER_HTOD, CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_BYTES_TRANSFER_DTOH,
    CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_BYTES_TRANSFER_DTOD,
    CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_CPU_PAGE_FAULT_COUNT, CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_GPU_PAGE_FAULT,
    CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_THRASHING, CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_THROTTLING,
    CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_REMOTE_MAP, ...
}} CUpti_ActivityUnifiedMemoryCounterKind;
typedef enum {{
    CUPTI_ACTIVITY_MEMCPY_KIND_UNKNOWN, CUPTI_ACTIVITY_MEMCPY_KIND_HTOD, CUPTI_ACTIVITY_MEMCPY_KIND_DTOH,
    CUPTI_ACTIVITY_MEMCPY_KIND_HTOA, CUPTI_ACTIVITY_MEMCPY_KIND_ATOH, CUPTI_ACTIVITY_MEMCPY_KIND_ATOA,
    CUPTI_ACTIVITY_MEMCPY_KIND_ATOD, CUPTI_ACTIVITY_MEMCPY_KIND_DTOA, CUPTI_ACTIVITY_MEMCPY_KIND_DTOD,
    CUPTI_ACTIVITY_MEMCPY_KIND_HTOH, CUPTI_ACTIVITY_MEMCPY_KIND_PTOP, ...
}} CUpti_ActivityMemcpyKind;
typedef enum {{
    CUPTI_ACTIVITY_MEMORY_KIND_UNKNOWN, CUPTI_ACTIVITY_MEMORY_KIND_PAGEABLE, CUPTI_ACTIVITY_MEMORY_KIND_PINNED,
    CUPTI_ACTIVITY_MEMORY_KIND_DEVICE, CUPTI_ACTIVITY_MEMORY_KIND_ARRAY, CUPTI_ACTIVITY_MEMORY_KIND_MANAGED,
    CUPTI_ACTIVITY_MEMORY_KIND_DEVICE_STATIC, CUPTI_ACTIVITY_MEMORY_KIND_MANAGED_STATIC, ...
}} CUpti_ActivityMemoryKind;
typedef enum {{
    CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM0, CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM1,
    CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM2, ...
}} CUpti_ExternalCorrelationKind;
typedef enum {{
    CUPTI_RUNTIME_TRACE_CBID_cudaLaunchKernel_v7000, CUPTI_RUNTIME_TRACE_CBID_cudaMemcpyAsync_v3020,
    CUPTI_RUNTIME_TRACE_CBID_cudaMemsetAsync_v3020, CUPTI_RUNTIME_TRACE_CBID_cudaGraphLaunch_v10000,
    CUPTI_RUNTIME_TRACE_CBID_cudaGraphAddMemcpyNode_v10000, CUPTI_RUNTIME_TRACE_CBID_cudaGetDevice_v3020,
    CUPTI_RUNTIME_TRACE_CBID_cudaLaunchHostFunc_v10000, CUPTI_RUNTIME_TRACE_CBID_cudaStreamBeginCapture_v10000,
    CUPTI_RUNTIME_TRACE_CBID_cudaStreamEndCapture_v10000, ...
}} CUpti_runtime_api_trace_cbid;
typedef enum {{
    CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel, CUPTI_DRIVER_TRACE_CBID_cuCtxGetCurrent,
    CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx, CUPTI_DRIVER_TRACE_CBID_cuLaunchHostFunc,
    CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch, CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2_ptsz, CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoH_v2,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpyAsync, CUPTI_DRIVER_TRACE_CBID_cuMemcpy3DAsync_v2,
    CUPTI_DRIVER_TRACE_CBID_cuMemsetD32Async, CUPTI_DRIVER_TRACE_CBID_cuMemsetD2D8_v2,
    CUPTI_DRIVER_TRACE_CBID_cuMemcpyBatchAsync_v2, CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoD,
    CUPTI_DRIVER_TRACE_CBID_cuMemAllocManaged, CUPTI_DRIVER_TRACE_CBID_cuMemFree_v2,
    CUPTI_DRIVER_TRACE_CBID_cuMemPrefetchAsync_v2, ...
}} CUpti_driver_api_trace_cbid;
typedef struct {{ CUpti_ActivityKind kind; ...; }} CUpti_Activity;
typedef struct {{
    CUpti_ActivityKind kind; uint64_t start; uint64_t end; uint32_t deviceId; uint32_t contextId;
    uint32_t streamId; uint32_t correlationId; uint32_t graphId; uint64_t graphNodeId; ...;
}} {KERNEL_T};
typedef struct {{
    CUpti_ActivityKind kind; uint8_t copyKind; uint8_t srcKind; uint8_t dstKind; uint64_t bytes;
    uint64_t start; uint64_t end; uint32_t deviceId; uint32_t contextId; uint32_t streamId;
    uint32_t correlationId; uint32_t graphId; ...;
}} {MEMCPY_T};
typedef struct {{
    CUpti_ActivityKind kind; uint8_t copyKind; uint8_t srcKind; uint8_t dstKind; uint64_t bytes;
    uint64_t start; uint64_t end; uint32_t deviceId; uint32_t srcDeviceId; uint32_t dstDeviceId;
    uint32_t streamId; uint32_t correlationId; ...;
}} {PTOP_T};
typedef struct {{
    CUpti_ActivityKind kind; uint32_t value; uint64_t bytes; uint64_t start; uint64_t end;
    uint32_t deviceId; uint32_t streamId; uint32_t correlationId; ...;
}} {MEMSET_T};
typedef struct {{
    CUpti_ActivityKind kind; uint32_t correlationId; uint64_t start; uint64_t end; uint32_t deviceId;
    uint32_t graphId; ...;
}} {GRAPH_T};
typedef struct {{
    CUpti_ActivityKind kind; CUpti_ActivityUnifiedMemoryCounterKind counterKind; uint64_t value; uint64_t start;
    uint64_t end; uint64_t address; uint32_t srcId; uint32_t dstId; uint32_t streamId; uint32_t processId;
    uint32_t flags; ...;
}} {UM_T};
typedef struct {{
    CUpti_ActivityKind kind; CUpti_ExternalCorrelationKind externalKind; uint64_t externalId;
    uint32_t correlationId; ...;
}} {EXT_T};
"""


def cupti_include() -> Path:
    """include/ of the nvidia-cuda-cupti wheel (also holds cuda.h from nvidia-cuda-runtime)."""
    spec = importlib.util.find_spec("nvidia")
    for base in (spec.submodule_search_locations or []) if spec else []:
        inc = Path(base) / "cu13" / "include"
        if (inc / "cupti.h").exists():
            return inc
    raise RuntimeError("CUPTI headers not found: pip install nvidia-cuda-cupti nvidia-cuda-runtime nvidia-cuda-crt")


def _build_dir() -> Path:
    d = Path(os.environ.get("OTEL_GPU_CENSUS_TEST_BUILD", Path(tempfile.gettempdir()) / "otel-gpu-census-test-build"))
    d.mkdir(parents=True, exist_ok=True)
    return d


@functools.lru_cache(maxsize=None)
def records():
    """(ffi, lib) of the compiled record module."""
    ffi = cffi.FFI()
    ffi.cdef(_CDEF)
    ffi.set_source("_gc_cupti_records", "#include <cupti.h>", include_dirs=[str(cupti_include())])
    out = _build_dir()
    so = ffi.compile(tmpdir=str(out), verbose=False)
    spec = importlib.util.spec_from_file_location("_gc_cupti_records", so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.ffi, mod.lib


def _new(type_name: str, **fields):
    ffi, lib = records()
    rec = ffi.new(f"{type_name} *")
    for k, v in fields.items():
        setattr(rec, k, v)
    return rec


def kernel(start, end, device=0, corr=1, stream=7, graph_id=0, graph_node=0, concurrent=True):
    _, lib = records()
    kind = lib.CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL if concurrent else lib.CUPTI_ACTIVITY_KIND_KERNEL
    return _new(KERNEL_T, kind=kind, start=start, end=end, deviceId=device, streamId=stream,
                correlationId=corr, graphId=graph_id, graphNodeId=graph_node)


def memcpy(copy_kind: str, nbytes, start, end, src="device", dst="device", device=0, corr=1, stream=7):
    _, lib = records()
    return _new(MEMCPY_T, kind=lib.CUPTI_ACTIVITY_KIND_MEMCPY,
                copyKind=getattr(lib, "CUPTI_ACTIVITY_MEMCPY_KIND_" + copy_kind.upper()),
                srcKind=getattr(lib, "CUPTI_ACTIVITY_MEMORY_KIND_" + src.upper()),
                dstKind=getattr(lib, "CUPTI_ACTIVITY_MEMORY_KIND_" + dst.upper()),
                bytes=nbytes, start=start, end=end, deviceId=device, streamId=stream, correlationId=corr)


def peer(nbytes, start, end, src_device, dst_device, corr=1, stream=7):
    _, lib = records()
    return _new(PTOP_T, kind=lib.CUPTI_ACTIVITY_KIND_MEMCPY2, copyKind=lib.CUPTI_ACTIVITY_MEMCPY_KIND_PTOP,
                srcKind=lib.CUPTI_ACTIVITY_MEMORY_KIND_DEVICE, dstKind=lib.CUPTI_ACTIVITY_MEMORY_KIND_DEVICE,
                bytes=nbytes, start=start, end=end, deviceId=src_device, srcDeviceId=src_device,
                dstDeviceId=dst_device, streamId=stream, correlationId=corr)


def memset(nbytes, start, end, device=0, corr=1, value=0):
    _, lib = records()
    return _new(MEMSET_T, kind=lib.CUPTI_ACTIVITY_KIND_MEMSET, value=value, bytes=nbytes, start=start,
                end=end, deviceId=device, streamId=7, correlationId=corr)


def graph_trace(start, end, device=0, corr=1, graph_id=1):
    _, lib = records()
    return _new(GRAPH_T, kind=lib.CUPTI_ACTIVITY_KIND_GRAPH_TRACE, correlationId=corr, start=start, end=end,
                deviceId=device, graphId=graph_id)


def external(corr, external_id, custom=2):
    _, lib = records()
    kind = getattr(lib, f"CUPTI_EXTERNAL_CORRELATION_KIND_CUSTOM{custom}")
    return _new(EXT_T, kind=lib.CUPTI_ACTIVITY_KIND_EXTERNAL_CORRELATION, externalKind=kind,
                externalId=external_id, correlationId=corr)


def unified(counter: str, value, start, end=0, src=0, dst=0):
    """A unified-memory counter record (counter: BYTES_TRANSFER_HTOD, GPU_PAGE_FAULT, ...; src/dst: CPU or device ids
    as CUPTI fills them for that counter)."""
    _, lib = records()
    return _new(UM_T, kind=lib.CUPTI_ACTIVITY_KIND_UNIFIED_MEMORY_COUNTER,
                counterKind=getattr(lib, "CUPTI_ACTIVITY_UNIFIED_MEMORY_COUNTER_KIND_" + counter), value=value,
                start=start, end=end, srcId=src, dstId=dst)


def other(kind_name="NAME"):
    """A record of a kind the census does not count (only the kind field matters to it)."""
    _, lib = records()
    return _new("CUpti_Activity", kind=getattr(lib, "CUPTI_ACTIVITY_KIND_" + kind_name))


# ---- the native library under test --------------------------------------------------------

@functools.lru_cache(maxsize=None)
def native():
    """(ffi, lib, path): the census library built from native/ for this test session."""
    # the package's own binding of gpu_census.h: the tests read what users read
    from otel_gpu_census import _native
    path = os.environ.get("OTEL_GPU_CENSUS_LIB")
    if not path:
        build = _build_dir() / "native"
        try:
            subprocess.run(["make", "-s", "-C", str(ROOT / "native"), f"BUILD={build}",
                            f"CUPTI_INCLUDE={cupti_include()}", f"PYTHON={sys.executable}"], check=True)
            path = str(build / "libotel_gpu_census.so")
        except (subprocess.CalledProcessError, RuntimeError):
            # e.g. a GPU machine whose only CUPTI headers are torch's 13.0: use the installed build
            installed = _native.find_library()
            if installed is None:
                raise
            path = str(installed)
    return _native.ffi, _native.ffi.dlopen(path), path
