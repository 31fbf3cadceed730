"""The install's paths: a core without the extras says, in one line naming the extra, what a path needs; the
build says which of its tools are missing. (A real core install in a fresh venv: tests/install_paths.sh.)

A module set to None in sys.modules fails to import, as it does where the extra is not installed."""
from __future__ import annotations

import logging
import runpy
import sys
from pathlib import Path

import pytest

from otel_gpu_census import extras

from otel_gpu_census.cli import main as cli

from otel_gpu_census.cli import launcher

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def without(monkeypatch):
    def hide(*modules):
        for m in modules:
            monkeypatch.setitem(sys.modules, m, None)
    return hide


def test_an_extra_that_imports_is_not_missing():
    assert extras.missing("proxy") is None and extras.missing("prometheus") is None


def test_a_missing_module_names_its_extra_and_the_install_line(without):
    without("yarl")
    assert extras.missing("proxy") == ("the tracing proxy needs the [proxy] extra (yarl is not installed): "
                                       "pip install 'otel-gpu-census[proxy]'")


def test_a_broken_module_is_not_called_a_missing_extra(tmp_path, monkeypatch):
    """Installed but failing inside (its own dependency missing): the real error, not a wrong hint."""
    (tmp_path / "fake_extra_mod.py").write_text("import fake_dependency_that_is_not_there\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(extras.EXTRAS, "fake", ("a fake path", ("fake_extra_mod",)))
    with pytest.raises(ImportError, match="fake_dependency_that_is_not_there"):
        extras.missing("fake")


def test_help_needs_no_extra(without, capsys):
    without("aiohttp", "yarl", "multidict")
    for argv in (["--help"], ["proxy", "--help"], ["run", "--help"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 0
    assert "--upstream" in capsys.readouterr().out


def test_proxy_without_its_extra_says_so_in_one_line(without, capsys):
    without("aiohttp")
    code = cli.main(["proxy", "--upstream", "http://127.0.0.1:9", "--listen", "127.0.0.1:0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "[proxy] extra (aiohttp is not installed): pip install 'otel-gpu-census[proxy]'" in err[0]


def test_run_proxy_without_its_extra_stops_before_the_command(without, capsys, tmp_path):
    without("aiohttp")
    marker = tmp_path / "ran"
    code = cli.main(["run", "--dir", str(tmp_path / "c"), "--proxy", "127.0.0.1:0", "--",
                     sys.executable, "-c", f"open({str(marker)!r}, 'w')"])
    assert code == 1 and not marker.exists()
    assert "--proxy: the tracing proxy needs the [proxy] extra" in capsys.readouterr().err


def test_prometheus_without_its_extra_is_one_warning_naming_it(without, caplog):
    from otel_gpu_census.telemetry import setup
    without("opentelemetry.exporter.prometheus")
    with caplog.at_level(logging.WARNING):
        out = setup.build_readers(["prometheus", "console"])
    assert len(out.readers) == 1 and out.prometheus_port is None
    [w] = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "prometheus exporter not started" in w and "pip install 'otel-gpu-census[prometheus]'" in w


def test_doctor_names_the_prometheus_extra(without):
    from otel_gpu_census.cli import doctor
    without("prometheus_client")
    checks = doctor.check_exporters(doctor.Facts())
    assert checks[0].status == doctor.OK and "OTLP grpc, OTLP http/protobuf" in checks[0].detail
    [warn] = [c for c in checks if c.status == doctor.WARN]
    assert warn.what == "Prometheus exporter" and "[prometheus] extra (prometheus_client" in warn.detail


def test_no_cupti_is_a_warning_naming_the_extra(monkeypatch, tmp_path):
    """The default census never loads CUPTI: doctor warns (not fails), and only a run that asks for
    CUPTI's records is told what to install."""
    from otel_gpu_census.cli import doctor
    monkeypatch.setattr(launcher, "find_cupti", lambda env=None: None)
    monkeypatch.delenv("OTEL_GPU_CENSUS_CUPTI", raising=False)
    [c] = doctor.check_cupti(doctor.Facts())
    assert c.status == doctor.WARN and "pip install 'otel-gpu-census[cupti]'" in c.detail
    lib = tmp_path / "libotel_gpu_census.so"
    lib.write_bytes(b"")
    for precise in (False, True):      # only the precise collector loads CUPTI
        plan = launcher.census_env(tmp_path, precise=precise, base={}, library=lib)
        said = [w for w in plan.warnings if "[cupti] extra" in w]
        assert bool(said) == precise, (precise, plan.warnings)


def test_the_build_names_the_tools_it_lacks(tmp_path):
    check = runpy.run_path(str(ROOT / "setup.py"), run_name="not_main")["missing_build_tools"]
    assert check({"PATH": str(tmp_path)}).startswith(
        "otel-gpu-census: building the native census library needs make and a C compiler; `make` and `cc` are "
        "not on PATH")
    for tool in ("make", "mycc"):
        (tmp_path / tool).write_text("#!/bin/sh\n")
        (tmp_path / tool).chmod(0o755)
    assert "`cc` is not on PATH" in check({"PATH": str(tmp_path)})
    assert check({"PATH": str(tmp_path), "CC": "mycc -m64"}) == ""


@pytest.mark.parametrize("hidden", ["numpy", "gguf"])
def test_the_random_model_script_names_what_it_needs(hidden):
    """examples/llamacpp step 3 on a core install: one line saying what to install, not a traceback."""
    import subprocess
    script = ROOT / "examples" / "llamacpp" / "make_random_gguf.py"
    code = (f"import sys, runpy; sys.modules[{hidden!r}] = None; sys.argv = [{str(script)!r}, '--help']; "
            f"runpy.run_path({str(script)!r}, run_name='__main__')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.strip() == (
        f"make_random_gguf: needs numpy and gguf ({hidden} is not installed): pip install numpy gguf")


def test_the_census_library_is_preloaded_first_after_a_sanitizers_runtime(tmp_path):
    """A sanitizer's runtime (an ASan-built server's libasan) must stay the process's first library; ours comes
    next, before anything else the user preloads."""
    lib = tmp_path / "libotel_gpu_census.so"
    lib.write_bytes(b"")
    for have, want in (("", [str(lib)]),
                       ("libm.so.6 /x/libjemalloc.so", [str(lib), "libm.so.6", "/x/libjemalloc.so"]),
                       ("/usr/lib/libasan.so.8:libm.so.6", ["/usr/lib/libasan.so.8", str(lib), "libm.so.6"]),
                       ("libm.so.6:libtsan.so.2", ["libtsan.so.2", str(lib), "libm.so.6"]),
                       ("/opt/libasanity.so", [str(lib), "/opt/libasanity.so"])):
        plan = launcher.census_env(tmp_path, base={"LD_PRELOAD": have}, library=lib)
        assert plan.env["LD_PRELOAD"].split(":") == want, have
