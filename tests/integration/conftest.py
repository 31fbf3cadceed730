"""Fixtures the proxy's integration tests share: the llama-server stand-in, one per module."""
from __future__ import annotations

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
