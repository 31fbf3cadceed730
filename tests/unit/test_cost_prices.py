"""One machine's prices live in bench/results/census_cost_prices.json, not in the package: the census's cost is
estimated only where that file is read, and without it the report says nothing of a cost."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from otel_gpu_census.report import cost

from otel_gpu_census.report import render as report
from otel_gpu_census.census import reader

ROOT = Path(__file__).resolve().parents[2]
PRICES = ROOT / "bench" / "results" / "census_cost_prices.json"


@pytest.fixture
def no_prices(tmp_path):
    assert not cost.load_prices(tmp_path / "missing.json")
    yield
    assert cost.load_prices(PRICES)


def test_the_file_prices_every_name_the_estimate_uses_and_says_where_each_comes_from():
    data = json.loads(PRICES.read_text())
    assert set(data["prices_s"]) == set(cost.PRICE_NAMES) == set(data["sources"])
    assert all(0 < v < 1e-4 for v in data["prices_s"].values())
    assert cost.load_prices(PRICES) and cost.EAGER_KERNEL_S == data["prices_s"]["EAGER_KERNEL_S"]


def test_the_package_holds_no_price():
    text = (ROOT / "src" / "otel_gpu_census" / "report" / "cost.py").read_text()
    for v in json.loads(PRICES.read_text())["prices_s"].values():
        assert repr(v) not in text and f"{v * 1e6:g}e-6" not in text


def test_a_file_without_every_price_gives_none(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"prices_s": {"EAGER_KERNEL_S": 1e-6}}))
    try:
        assert not cost.load_prices(f) and cost.EAGER_KERNEL_S is None and not cost.prices_known()
    finally:
        assert cost.load_prices(PRICES)


def one_kernel(census_dir, segments, records):
    def edit(seg):
        seg.wall_start_ns, seg.wall_update_ns = 5 * 10**9, 6 * 10**9
    return reader.read_segment(segments.segment(census_dir, [records.kernel(10**6, 10**6 + 10)], edit=edit))


def test_without_prices_no_estimate_and_no_cost_line(no_prices, census_dir, segments, records):
    c = one_kernel(census_dir, segments, records)
    assert cost.estimate(c) is None
    assert not any("census cost" in line for line in report.render_text([c]).splitlines())
    assert report.to_dict([c])["processes"][0]["census_cost_estimate"] is None


def test_with_prices_the_same_census_has_its_estimate(census_dir, segments, records):
    c = one_kernel(census_dir, segments, records)
    assert cost.estimate(c).seconds > 0
    assert any("census cost, estimated" in line and "census_cost_prices.json" in line
               for line in report.render_text([c]).splitlines())
