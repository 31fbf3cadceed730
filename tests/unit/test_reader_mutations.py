"""A hostile or damaged segment, made by flipping bytes of a real one (header, device totals, rings): the
reader reads it or refuses it with a SegmentError, and `report` on a folder holding it prints a report or one
line, never a traceback. Seeded, so a failure replays."""
from __future__ import annotations

import random

import pytest

from otel_gpu_census.census import reader
from otel_gpu_census.cli import main as cli

MS = 1_000_000
T0 = 5_000 * 20 * MS
MUTANTS = 600
HEAD = 1 << 16          # most flips land here: identity, state, device totals


def mutant(good: bytes, rnd: random.Random) -> bytes:
    b = bytearray(good)
    for _ in range(rnd.choice((1, 2, 4, 16, 64))):
        at = rnd.randrange(HEAD if rnd.random() < 0.8 else len(b))
        for j in range(min(rnd.choice((1, 4, 8)), len(b) - at)):
            b[at + j] = rnd.choice((0x00, 0xFF, 0x7F, 0x80, rnd.randrange(256)))
    return bytes(b)


@pytest.fixture
def good(census_dir, segments, records):
    recs = [records.kernel(T0, T0 + 2 * MS, stream=1), records.kernel(T0 + MS, T0 + 3 * MS, stream=2),
            records.memcpy("htod", 4096, T0, T0 + MS, src="pinned"), records.memcpy("dtoh", 999, T0, T0 + MS),
            records.kernel(T0 + 10 * MS, T0 + 11 * MS, device=1), records.external(5, 77),
            records.graph_trace(T0, T0 + MS), records.memset(64, T0, T0 + MS)]
    path = segments.segment(census_dir, recs)
    with open(path, "rb") as f:
        return path, f.read()


def test_a_mutated_segment_is_read_or_refused_never_anything_else(good, tmp_path):
    path, data = good
    rnd = random.Random(20261204)
    read = refused = 0
    for _ in range(MUTANTS):
        p = tmp_path / path.name
        p.write_bytes(mutant(data, rnd))
        try:
            c = reader.read_segment(p)
            c.totals()
            reader.read_segment(p, detail=False)
            reader.read_steps(p, 0, 1 << 62)
            read += 1
        except reader.SegmentError:
            refused += 1
    assert read + refused == MUTANTS and read > MUTANTS // 2     # most flips leave a segment that still parses


@pytest.mark.parametrize("seed", range(6))
def test_report_of_a_folder_with_a_mutated_segment_prints_a_report_or_one_line(good, tmp_path, capsys, seed):
    path, data = good
    folder = tmp_path / "damaged"
    folder.mkdir(mode=0o700)
    (folder / path.name).write_bytes(mutant(data, random.Random(seed)))
    for args in ([], ["--json"]):
        rc = cli.main(["report", str(folder), *args])
        out, err = capsys.readouterr()
        assert rc in (0, 1) and "Traceback" not in out + err, (seed, args, err)
        assert (out if rc == 0 else err).strip()
