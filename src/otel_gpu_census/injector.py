"""The census injector inside this process, for engine hooks: steps, flushes, the final flush.

CUDA loads the injector itself (``CUDA_INJECTION64_PATH``) when the process first initialises CUDA;
this module finds that same library (``dlopen`` with ``RTLD_NOLOAD``: it never loads a second copy)
and calls its C API (``gpu_census.h``). Every call is safe without the injector: it answers "no"
and costs one attribute check.

    from otel_gpu_census import injector
    if injector.step_begin(step_id):      # GPU work this thread launches is tallied under step_id
        try: run_the_step()
        finally: injector.step_end()
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Optional

log = logging.getLogger("otel_gpu_census.injector")

_CDEF = """
int gc_active(void);
int gc_step_begin(uint64_t id);
int gc_step_end(uint64_t *id);
int gc_flush(void);
int gc_finish(void);
const char *gc_segment_path(void);
"""

_lock = threading.Lock()
_lib = None          # the injector's functions once found
_ffi = None
_looked = 0          # how many times we looked (CUDA may load it after our first look)
_LOOKS = 1000        # then give up: the process runs without the census


def _find():
    """The injector CUDA loaded in this process, or None (not loaded yet, or not under the census)."""
    global _lib, _ffi, _looked
    if _lib is not None or _looked >= _LOOKS:
        return _lib
    with _lock:
        if _lib is not None or _looked >= _LOOKS:
            return _lib
        _looked += 1
        path = os.environ.get("CUDA_INJECTION64_PATH")
        if not path:
            _looked = _LOOKS
            return None
        import cffi
        ffi = cffi.FFI()
        ffi.cdef(_CDEF)
        try:
            lib = ffi.dlopen(path, ffi.RTLD_NOW | ffi.RTLD_NOLOAD)
        except OSError:
            return None      # CUDA has not initialised yet in this process: look again later
        try:
            lib.gc_active     # an older injector without this API: not ours to drive
            lib.gc_finish
        except AttributeError:
            _looked = _LOOKS
            log.warning("otel-gpu-census: the injector at %s lacks the step API; steps are off", path)
            return None
        _ffi, _lib = ffi, lib
        return lib


def under_census() -> bool:
    """True when this process was started with the injector (whether or not CUDA loaded it yet)."""
    from otel_gpu_census import settings
    return bool(os.environ.get("CUDA_INJECTION64_PATH")) and not settings.disabled()


def active() -> bool:
    lib = _find()
    return bool(lib is not None and lib.gc_active())


def wait_attached(timeout_s: float = 10.0) -> bool:
    """Wait until the census counts in this process; True once it does (the injector starts inside cuInit, so
    once any CUDA call returned it counts or has said why not). False at once without a census."""
    if not under_census():
        return False
    import time
    deadline = time.monotonic() + timeout_s
    while not active():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.001)
    return True


def step_begin(step_id: int) -> bool:
    """Tag the GPU work this thread launches with `step_id` (1 .. 2**32-1) until step_end()."""
    lib = _find()
    return lib is not None and lib.gc_step_begin(step_id) == 0


def step_end() -> Optional[int]:
    """End this thread's innermost step; its id, or None when none was open."""
    lib = _find()
    if lib is None:
        return None
    out = _ffi.new("uint64_t *")
    return int(out[0]) if lib.gc_step_end(out) == 0 else None


def flush() -> bool:
    lib = _find()
    return lib is not None and lib.gc_flush() == 0


def finish() -> bool:
    """The final flush now (totals complete, segment marked exited); the census stops counting here."""
    lib = _find()
    return lib is not None and lib.gc_finish() == 0


def segment_path() -> str:
    lib = _find()
    return _ffi.string(lib.gc_segment_path()).decode() if lib is not None else ""
