"""The reader's view of the segment (cffi reading gpu_census.h) matches the C compiler's, field by field."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from otel_gpu_census import _native
from otel_gpu_census._native import ffi

STRUCTS = ("gc_stat", "gc_device", "gc_window", "gc_step", "gc_segment")


def test_segment_size_matches_what_the_library_writes(native):
    nffi, lib, _ = native
    seg = nffi.new("gc_segment *")
    lib.gc_segment_init(seg, b"x", 0, 0)
    assert ffi.sizeof("gc_segment") == seg.segment_size == _native.SEGMENT_SIZE
    assert lib.gc_layout_version() == _native.LAYOUT_VERSION == seg.layout_version
    assert seg.magic == _native.MAGIC


def test_every_offset_matches_the_c_compiler(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler")
    lines, expected = [], {}
    for s in STRUCTS:
        lines.append(f'printf("{s} sizeof %zu\\n", sizeof({s}));')
        expected[f"{s} sizeof"] = ffi.sizeof(s)
        for name, f in ffi.typeof(s).fields:
            lines.append(f'printf("{s} {name} %zu\\n", offsetof({s}, {name}));')
            expected[f"{s} {name}"] = f.offset
    src = tmp_path / "layout.c"
    src.write_text('#include <stddef.h>\n#include <stdio.h>\n#include "gpu_census.h"\nint main(void) {\n'
                   + "\n".join(lines) + "\nreturn 0;\n}\n")
    exe = tmp_path / "layout"
    subprocess.run([cc, "-std=c11", "-I", str(_native.header_path().parent), str(src), "-o", str(exe)], check=True)
    got = {}
    for line in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines():
        key, _, value = line.rpartition(" ")
        got[key] = int(value)
    assert got == expected
    assert len(expected) > 60       # every field of every struct was compared


def test_cdef_source_keeps_integer_defines_only():
    text = "\n".join([
        "#ifndef X_H", "#define X_H", "#include <stdint.h>", "#ifdef __cplusplus", 'extern "C" {', "#endif",
        "#define A 0x10ULL  /* hex */", "#define B 7u", "#define C (1 << 3)", "typedef struct t { uint64_t a; } t;",
        "#ifdef __cplusplus", "}", "#endif", "#endif"])
    out = _native.cdef_source(text)
    assert "#define A 0x10ULL" in out and "#define B 7u" in out
    assert "(1 << 3)" not in out and "extern" not in out and "#include" not in out and "X_H" not in out
    assert "typedef struct t" in out and "}" not in out.replace("uint64_t a; }", "")


def test_library_search_order(monkeypatch, tmp_path):
    lib = tmp_path / "libotel_gpu_census.so"
    lib.write_bytes(b"")
    monkeypatch.setenv("OTEL_GPU_CENSUS_LIB", str(lib))
    assert _native.find_library() == lib.resolve()
    monkeypatch.setenv("OTEL_GPU_CENSUS_LIB", str(tmp_path / "missing.so"))
    assert _native.find_library() is None       # an explicit path that is wrong is not silently replaced


def test_device_totals_read_from_bytes_match_the_struct_field_by_field(tmp_path):
    """The reader takes device totals out of the copied bytes (not through cffi): every field of
    every device slot in use, each copy cell included, must come out as the struct holds it."""
    from otel_gpu_census.census import DIRECTIONS, MEMORY_KINDS, ZERO, reader
    from segments import map_segment

    FIELDS = ("kernel_count", "kernel_ns", "busy_ns", "first_ns", "last_ns", "graph_launches", "graph_ns",
              "graph_kernel_count", "eager_launches", "eager_traced", "eager_traced_ns")
    mm, seg = map_segment(tmp_path / "gpu-census-1-1.seg", b"x")
    n = iter(range(1, 1 << 20))
    used = (0, 3, 15)                   # first, middle and last slot; the others stay unused
    for k in used:
        d = seg.devices[k]
        d.in_use, d.device_id = 1, 10 + k
        d.uuid = bytes(range(k, k + 16))
        for f in FIELDS:
            setattr(d, f, next(n))
        for i in range(len(DIRECTIONS)):
            for j in range(len(MEMORY_KINDS)):
                if (i + j + k) % 3:     # some cells all zero: those are absent
                    c = d.copy[i][j]
                    c.count, c.bytes, c.ns = next(n), next(n), next(n)
        d.copy[0][0].count, d.copy[0][0].bytes, d.copy[0][0].ns = 0, 0, 7      # only a duration: kept
        if k:
            d.memset.count, d.memset.bytes, d.memset.ns = next(n), next(n), next(n)
            d.peer_recv.count, d.peer_recv.bytes, d.peer_recv.ns = next(n), next(n), next(n)
    mm.flush()
    got = reader.read_segment(tmp_path / "gpu-census-1-1.seg", detail=False).devices
    assert sorted(got) == [10 + k for k in used]
    for k in used:
        d, t = seg.devices[k], got[10 + k]
        assert t.device_id == 10 + k and t.uuid == reader.format_uuid(bytes(range(k, k + 16)))
        for f in FIELDS:
            assert getattr(t, f) == getattr(d, f), f
        want = {(DIRECTIONS[i], MEMORY_KINDS[j]): (d.copy[i][j].count, d.copy[i][j].bytes, d.copy[i][j].ns)
                for i in range(len(DIRECTIONS)) for j in range(len(MEMORY_KINDS))
                if (d.copy[i][j].count, d.copy[i][j].bytes, d.copy[i][j].ns) != (0, 0, 0)}
        assert {key: (s.count, s.bytes, s.ns) for key, s in t.copies.cells.items()} == want
        assert (t.memset.count, t.memset.bytes, t.memset.ns) == (d.memset.count, d.memset.bytes, d.memset.ns)
        assert (t.peer_recv.count, t.peer_recv.bytes, t.peer_recv.ns) == \
            (d.peer_recv.count, d.peer_recv.bytes, d.peer_recv.ns)
        if not k:
            assert t.memset == ZERO and t.peer_recv == ZERO
    del seg
    mm.close()
