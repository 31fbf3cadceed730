"""Fixtures the integration tests share: the llama-server stand-in (one per module) and proxies in front of
it for the proxy's tests, and the mock libcupti (native/tests/mock_cupti.c) for the injector's life in a process."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from llama_standin import Opts, Standin


@pytest.fixture(scope="module")
def standin():
    st = Standin().start()
    yield st
    st.stop()


@pytest.fixture
def fresh_standin(standin):
    """The module's stand-in with its default behaviour and no requests seen: each test's own."""
    standin.opts = Opts()
    standin.seen.clear()
    return standin


@pytest.fixture
def proxy(standin):
    """make(**options): proxies on threads of this process in front of the module's stand-in (a test file
    may name its own `proxy`)."""
    from proxy_process import in_thread_proxies
    with in_thread_proxies(standin.url) as make:
        yield make


@pytest.fixture(scope="session")
def mock_cuda(tmp_path_factory):
    """Path of the mock driver (native/tests/mock_cuda.c), a libcuda.so.1 whose one primary context the
    test switches on: what the injector's attach watch polls."""
    out = tmp_path_factory.mktemp("mockcuda") / "libcuda.so.1"
    root = Path(__file__).resolve().parents[2]
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-O1", "-Wall", "-Werror",
                    "-Wl,-soname,libcuda.so.1", str(root / "native" / "tests" / "mock_cuda.c"), "-o", str(out)],
                   check=True)
    return str(out)


@pytest.fixture(scope="session")
def mock_lib(native, tmp_path_factory):
    """Path of the mock libcupti, built once (OTEL_GPU_CENSUS_CUPTI points the injector at it)."""
    import cupti_records
    out = tmp_path_factory.mktemp("mock") / "libmock_cupti.so"
    root = Path(__file__).resolve().parents[2]
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-O1", "-Wall", "-Werror",
                    f"-I{cupti_records.cupti_include()}", str(root / "native" / "tests" / "mock_cupti.c"),
                    "-o", str(out)], check=True)
    return str(out)
