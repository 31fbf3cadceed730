"""cffi binding to the census segment layout and the native library.

The layout comes from the one header, ``gpu_census.h``, parsed at import (cffi ABI mode): there is
no second copy of the structs to drift. The native library is optional here — reading segments
needs only the header; the tally API (``gc_tally_*``, ``gc_segment_*``) and ``gc_layout_version``
need the library, which tests and ``doctor`` open through :func:`load_library`.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterator, Optional

import cffi

_PKG_DIR = Path(__file__).resolve().parent
_CHECKOUT_NATIVE = _PKG_DIR.parent.parent / "native"   # src/otel_gpu_census -> repo root
LIB_NAME = "libotel_gpu_census.so"
HEADER_NAME = "gpu_census.h"

# cdef accepts declarations and `#define NAME <integer literal>` only.
_INT_DEFINE = re.compile(r"^\s*#\s*define\s+[A-Za-z_]\w*\s+(0[xX][0-9a-fA-F]+|\d+)[uUlL]*\s*(/\*.*\*/)?\s*$")


class NativeError(RuntimeError):
    """The header or the library cannot be found or does not fit."""


def header_path() -> Path:
    """The installed copy of the header, else the source checkout's."""
    for p in (_PKG_DIR / "_lib" / HEADER_NAME, _CHECKOUT_NATIVE / "include" / HEADER_NAME):
        if p.is_file():
            return p
    raise NativeError(f"{HEADER_NAME} not found in {_PKG_DIR / '_lib'} or {_CHECKOUT_NATIVE / 'include'}: "
                      "the package is incomplete (reinstall it)")


def cdef_source(text: str) -> str:
    """The header as cffi's cdef takes it: preprocessor lines other than integer #defines dropped,
    together with the ``extern "C" {`` guard and its closing brace."""
    out = []
    skipping_cplusplus = False
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("#"):
            if s.startswith("#ifdef __cplusplus"):
                skipping_cplusplus = True
            elif s.startswith("#endif") and skipping_cplusplus:
                skipping_cplusplus = False
            elif _INT_DEFINE.match(line):
                out.append(line)
            continue
        if skipping_cplusplus:      # `extern "C" {` or its `}`
            continue
        out.append(line)
    return "\n".join(out)


def _make_ffi() -> cffi.FFI:
    # Without the layout nothing here works: fail the import, with a message that says why.
    try:
        path = header_path()
        f = cffi.FFI()
        f.cdef(cdef_source(path.read_text()))
    except NativeError as e:
        raise ImportError(str(e)) from e
    except Exception as e:   # a cffi parse error: name the header rather than show cffi's internals
        raise ImportError(f"cannot parse {path}: {e}") from e
    return f


ffi = _make_ffi()
# In ABI mode the header's integer constants live on a library object; the process itself serves.
consts = ffi.dlopen(None)
LAYOUT_VERSION: int = consts.GC_LAYOUT_VERSION
MAGIC: int = consts.GC_MAGIC
SEGMENT_SIZE: int = ffi.sizeof("gc_segment")
SEQ_OFFSET: int = ffi.offsetof("gc_segment", "seq")


def library_candidates() -> Iterator[Path]:
    """Where the native library may be, in order: $OTEL_GPU_CENSUS_LIB, the installed copy,
    the source checkout's build folder."""
    env = os.environ.get("OTEL_GPU_CENSUS_LIB")
    if env:
        yield Path(env)
    yield _PKG_DIR / "_lib" / LIB_NAME
    yield _CHECKOUT_NATIVE / "build" / LIB_NAME


def find_library() -> Optional[Path]:
    """The first existing candidate (an explicit $OTEL_GPU_CENSUS_LIB wins even if missing: the
    caller then reports that path rather than silently using another library)."""
    env = os.environ.get("OTEL_GPU_CENSUS_LIB")
    if env:
        return Path(env).resolve() if Path(env).is_file() else None
    for p in library_candidates():
        if p.is_file():
            return p.resolve()
    return None


_lib = None


def load_library():
    """dlopen the native library (once) for gc_layout_version and the tally API."""
    global _lib
    if _lib is None:
        path = find_library()
        if path is None:
            where = ", ".join(str(p) for p in library_candidates())
            raise NativeError(f"{LIB_NAME} not found (looked in: {where}); build it with `make -C native`")
        try:
            _lib = ffi.dlopen(str(path))
        except OSError as e:
            why = str(e).split("  Additionally,")[0]     # cffi appends a find_library note
            raise NativeError(f"cannot load {path}: {why}") from e
    return _lib
