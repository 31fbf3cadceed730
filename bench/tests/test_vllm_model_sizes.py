"""bench/device/vllm_model_sizes.py adds its sizes to the shared model writer and hands it the one asked for."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "device"))
import vllm_model_sizes  # noqa: E402

# the writer's interface as the shared vllm_model.py has it: SIZES and make(out_dir, size)
WRITER = '''import json, os
SIZES = {"small": dict(hidden_size=1024), "tiny": dict(hidden_size=128)}
def make(out_dir, size):
    os.makedirs(out_dir, exist_ok=True)
    json.dump({"size": size, **SIZES[size]}, open(os.path.join(out_dir, "config.json"), "w"))
'''


@pytest.fixture
def writer(tmp_path):
    p = tmp_path / "vllm_model.py"
    p.write_text(WRITER)
    return p


def test_a_larger_size_reaches_the_writer_with_its_shape(writer, tmp_path):
    assert vllm_model_sizes.main([str(tmp_path / "m"), "--size", "1b", "--writer", str(writer)]) == 0
    got = json.loads((tmp_path / "m" / "config.json").read_text())
    assert got == {"size": "1b", **vllm_model_sizes.SIZES["1b"]}
    assert got["max_position_embeddings"] >= 8192 + 192        # an 8k prompt and a long answer fit


def test_the_writers_own_sizes_stay_and_an_unknown_one_is_one_line(writer, tmp_path):
    vllm_model_sizes.make(str(tmp_path / "t"), "tiny", writer)
    assert json.loads((tmp_path / "t" / "config.json").read_text()) == {"size": "tiny", "hidden_size": 128}
    with pytest.raises(SystemExit, match="no size 'huge'"):
        vllm_model_sizes.make(str(tmp_path / "h"), "huge", writer)
    with pytest.raises(SystemExit, match="no model writer"):
        vllm_model_sizes.make(str(tmp_path / "x"), "1b", tmp_path / "absent.py")
