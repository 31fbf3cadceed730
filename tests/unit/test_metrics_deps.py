"""Why an exporter cannot be imported: the dependency metadata names what is missing or too old.

Fake distributions on a temporary sys.path stand for an install made with `pip --no-deps` (as on
the GPU machine, where opentelemetry-exporter-otlp-proto-grpc 1.45.2 lacked its new dependency
opentelemetry-exporter-otlp-common and the warning said only "No module named ...")."""
from __future__ import annotations

import logging
import os
import textwrap

import pytest

from otel_gpu_census.telemetry import setup as exporters


def _dist(root, name, version, requires=(), module_code=None):
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(lines) + "\n")
    if module_code is not None:
        pkg = root / name.replace("-", "_")
        pkg.mkdir()
        (pkg / "__init__.py").write_text(textwrap.dedent(module_code))


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    """fake-exporter 1.0 imports a module that fake-common (never installed) would provide; it
    also needs an opentelemetry-api newer than any, and fake-mid, whose own dependency is missing."""
    _dist(tmp_path, "fake-exporter", "1.0", [
        "fake-common==0.66b2",
        "opentelemetry-api>=99",
        "fake-mid[extra1]~=2.0",
        "opentelemetry-sdk",
        "only-for-an-extra; extra == 'gcp'",
        "only-for-old-pythons<1; python_version < '3'",
    ], module_code="import fake_common_module\nOTLPMetricExporter = object\n")
    _dist(tmp_path, "fake-mid", "2.0.1", ["fake-deep==1.0; extra == 'extra1'", "fake-unused; extra == 'other'"])
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_unmet_requirements_walk_the_closure_with_versions_markers_and_extras(fake_site):
    from importlib.metadata import version
    unmet = exporters.unmet_requirements("fake-exporter")
    assert "fake-common==0.66b2 is not installed (needed by fake-exporter 1.0)" in unmet
    assert f"opentelemetry-api>=99 is needed but {version('opentelemetry-api')} is installed " \
           "(needed by fake-exporter 1.0)" in unmet
    assert "fake-deep==1.0 is not installed (needed by fake-mid 2.0.1)" in unmet     # through the extra
    text = " ".join(unmet)
    assert "only-for-an-extra" not in text and "only-for-old-pythons" not in text and "fake-unused" not in text
    assert "opentelemetry-sdk" not in text          # installed, any version
    assert len(unmet) == 3


def test_import_failure_names_the_missing_distribution(fake_site):
    with pytest.raises(exporters.ExporterUnavailable) as e:
        exporters.import_exporter("fake_exporter", "fake-exporter")
    msg = str(e.value)
    assert msg.startswith("fake-exporter 1.0 cannot be imported (ModuleNotFoundError: No module named "
                          "'fake_common_module'): ")
    assert "fake-common==0.66b2 is not installed" in msg
    assert msg.endswith("Install them, or install fake-exporter==1.0 with its dependencies (pip without --no-deps)")


def test_otlp_exporter_that_cannot_be_imported_costs_one_precise_warning(fake_site, monkeypatch, caplog):
    monkeypatch.setitem(exporters.OTLP_MODULES, "grpc", ("fake_exporter", "fake-exporter"))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    with caplog.at_level(logging.WARNING, logger="otel_gpu_census.metrics"):
        out = exporters.build_readers(["otlp"], env=os.environ)
    assert out.readers == [] and out.otlp is None
    [rec] = caplog.records
    assert rec.getMessage().startswith("metrics: otlp exporter not started: fake-exporter 1.0 cannot be imported")
    assert "fake-common==0.66b2 is not installed" in rec.getMessage()


def test_not_installed_and_declared_dependencies_all_present(fake_site):
    assert exporters.why_not_importable("nope", "fake-not-there", ImportError("x")) == \
        "the fake-not-there package is not installed (pip install fake-not-there)"
    _dist(fake_site, "fake-complete", "3.0", ["opentelemetry-sdk"])
    err = ModuleNotFoundError("No module named 'shadowed.mod'", name="shadowed.mod")
    assert exporters.why_not_importable("fake_complete", "fake-complete", err).endswith(
        "though its declared dependencies are installed: module shadowed.mod is missing or shadowed")


def test_without_packaging_missing_names_are_still_found(fake_site, monkeypatch):
    monkeypatch.setattr(exporters, "_packaging", lambda: None)
    unmet = exporters.unmet_requirements("fake-exporter")
    assert "fake-common==0.66b2 is not installed (needed by fake-exporter 1.0)" in unmet
    assert "fake-deep==1.0 is not installed (needed by fake-mid 2.0.1)" in unmet
    assert not any("only-for" in u or "fake-unused" in u for u in unmet)


def test_the_real_exporters_import_here():
    """The module paths are right for the installed OTel release (1.45.2 in the test venv)."""
    for module, dist in list(exporters.OTLP_MODULES.values()) + [exporters.PROMETHEUS_MODULE]:
        assert exporters.unmet_requirements(dist) == [], dist
        exporters.import_exporter(module, dist)


def test_doctor_warns_about_an_exporter_that_cannot_be_imported(fake_site, monkeypatch):
    from otel_gpu_census import doctor
    monkeypatch.setitem(exporters.OTLP_MODULES, "grpc", ("fake_exporter", "fake-exporter"))
    checks = doctor.check_exporters(doctor.Facts())
    assert checks[0].status == doctor.OK and "OTLP http/protobuf" in checks[0].detail
    assert "OTLP grpc" not in checks[0].detail
    [warn] = [c for c in checks if c.status == doctor.WARN]
    assert warn.what == "OTLP grpc exporter" and "fake-common==0.66b2 is not installed" in warn.detail
