"""bench/server/make_model.py: the random-weight GGUFs it writes, read back by gguf-py and by a real llama-server.

The GGUF checks always run (a small vocab-only GGUF is written here with gguf-py). The llama-server
checks need a CPU build of b11434: $LLAMA_SERVER_BIN, else the default output of
``examples/llamacpp/build_llama_server.sh --cpu``; the vocabulary comes from $LLAMA_VOCAB_GGUF, else
from the llama.cpp source tree that build used. Without them those tests are skipped, saying so.
"""
from __future__ import annotations

import http.client
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

import llama_cpu

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "server" / "make_model.py"
_spec = importlib.util.spec_from_file_location("make_model", SCRIPT)
mm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mm)

N_VOCAB = 300


@pytest.fixture(scope="module")
def vocab(tmp_path_factory) -> Path:
    """A vocab-only GGUF with a few non-tokenizer keys that must not be copied."""
    path = tmp_path_factory.mktemp("vocab") / "vocab.gguf"
    w = GGUFWriter(str(path), "llama")
    w.add_string("general.name", "not-copied")
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(N_VOCAB)])
    w.add_array("tokenizer.ggml.scores", [float(-i) for i in range(N_VOCAB)])
    w.add_array("tokenizer.ggml.token_type", [1] * N_VOCAB)
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _write(tmp_path: Path, vocab: Path, preset: str, **over) -> tuple:
    c = dict(mm.PRESETS[preset], preset=preset, **over)
    out = tmp_path / f"{preset}.gguf"
    info = mm.write_model(out, vocab, c, seed=3)
    return c, info, GGUFReader(str(out))


def _value(reader: GGUFReader, key: str):
    f = reader.fields[key]
    if f.types[0] == GGUFValueType.ARRAY:
        if f.types[1] == GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode() for i in f.data]
        return [f.parts[i][0].item() for i in f.data]
    if f.types[0] == GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode()
    return f.parts[f.data[0]][0].item()


def _expected_hybrid_shapes(c: dict, n_vocab: int) -> dict:
    """Name -> ggml ne, written out from llama.cpp b11434 llama_model_granite_hybrid::load_arch_tensors."""
    e, di, ds, nh, ng, dc = c["n_embd"], 2 * c["n_embd"], c["d_state"], c["n_ssm_head"], c["n_group"], c["d_conv"]
    hd = e // c["n_head"]
    shapes = {"token_embd.weight": [e, n_vocab], "output_norm.weight": [e]}
    if not c.get("tied_output"):
        shapes["output.weight"] = [e, n_vocab]
    attn = [i for i in range(c["n_layer"]) if i % c["attn_every"] == c["attn_every"] // 2]
    for i in range(c["n_layer"]):
        b = f"blk.{i}."
        shapes.update({b + "attn_norm.weight": [e], b + "ffn_norm.weight": [e], b + "ffn_gate.weight": [e, c["n_ff"]],
                       b + "ffn_up.weight": [e, c["n_ff"]], b + "ffn_down.weight": [c["n_ff"], e]})
        if i in attn:
            shapes.update({b + "attn_q.weight": [e, c["n_head"] * hd],
                           b + "attn_k.weight": [e, c["n_head_kv"] * hd],
                           b + "attn_v.weight": [e, c["n_head_kv"] * hd],
                           b + "attn_output.weight": [c["n_head"] * hd, e]})
        else:
            shapes.update({b + "ssm_in.weight": [e, 2 * di + 2 * ng * ds + nh],
                           b + "ssm_conv1d.weight": [dc, di + 2 * ng * ds], b + "ssm_conv1d.bias": [di + 2 * ng * ds],
                           b + "ssm_dt.bias": [nh], b + "ssm_a": [1, nh], b + "ssm_d": [1, nh],
                           b + "ssm_norm.weight": [di // ng, ng], b + "ssm_out.weight": [di, e]})
    return shapes


def test_hybrid_tiny_gguf_has_every_key_and_tensor_llama_cpp_reads(tmp_path, vocab):
    c, info, r = _write(tmp_path, vocab, "hybrid-tiny")
    assert _value(r, "general.architecture") == "granitehybrid"
    assert _value(r, "general.name") == "random-hybrid-tiny"
    a = "granitehybrid."
    # the keys load_hparams and granite-hybrid's load_arch_hparams require, with their values
    want = {"block_count": c["n_layer"], "context_length": c["ctx"], "embedding_length": c["n_embd"],
            "feed_forward_length": c["n_ff"], "attention.head_count": c["n_head"],
            "ssm.conv_kernel": c["d_conv"], "ssm.inner_size": 2 * c["n_embd"], "ssm.state_size": c["d_state"],
            "ssm.time_step_rank": c["n_ssm_head"], "ssm.group_count": c["n_group"]}
    for k, v in want.items():
        assert _value(r, a + k) == v, k
    assert _value(r, a + "attention.layer_norm_rms_epsilon") == pytest.approx(1e-5)
    # a layer is recurrent where head_count_kv is 0
    kv = _value(r, a + "attention.head_count_kv")
    assert len(kv) == c["n_layer"] and 0 < kv.count(0) < c["n_layer"]
    assert set(kv) == {0, c["n_head_kv"]}
    # the tokenizer keys are copied, nothing else from the vocab file
    assert _value(r, "tokenizer.ggml.tokens") == [f"tok{i}" for i in range(N_VOCAB)]
    assert _value(r, "tokenizer.ggml.bos_token_id") == 1
    assert not any(k.startswith("llama.") for k in r.fields)

    shapes = {t.name: [int(d) for d in t.shape] for t in r.tensors}
    assert shapes == _expected_hybrid_shapes(c, N_VOCAB)
    assert info["n_vocab"] == N_VOCAB and info["bytes"] == os.path.getsize(tmp_path / "hybrid-tiny.gguf")


def test_hybrid_weights_are_finite_and_the_scan_decays(tmp_path, vocab):
    _, _, r = _write(tmp_path, vocab, "hybrid-tiny")
    t = {x.name: np.asarray(x.data) for x in r.tensors}
    w = t["blk.0.ssm_in.weight"].astype(np.float32)
    assert np.isfinite(w).all() and 0 < np.abs(w).max() < 0.016 and w.std() > 0
    assert (t["blk.0.ssm_a"] < 0).all()                    # exp(dt*A) < 1: the state cannot blow up
    assert (t["blk.2.ssm_norm.weight"] == 1).all() and (t["output_norm.weight"] == 1).all()
    for name, x in t.items():
        assert np.isfinite(x.astype(np.float32)).all(), name


def test_llama_presets_still_write_llama(tmp_path, vocab):
    c, _, r = _write(tmp_path, vocab, "tiny")
    assert _value(r, "general.architecture") == "llama"
    assert _value(r, "llama.attention.head_count_kv") == c["n_head_kv"]
    names = {t.name for t in r.tensors}
    assert "output.weight" in names and not any(".ssm_" in n for n in names)
    assert len(r.tensors) == 3 + 9 * c["n_layer"]


def test_big_hybrid_preset_is_8b_class_and_runs_the_ssm_on_cuda():
    c = dict(mm.PRESETS["hybrid"], preset="hybrid")
    ts = mm.tensors(c, 128256)
    assert {n: list(d) for n, d, _, _ in ts} == _expected_hybrid_shapes(c, 128256)
    params = sum(int(np.prod(d)) for _, d, _, _ in ts)
    assert 6e9 < params < 10e9
    assert mm.cuda_ssm_problem(c) == "" and mm.shape_problem(c) == ""
    # the state estimate grows with every recurrent layer's SSM state (d_state x d_inner F32)
    fewer = dict(c, n_layer=c["n_layer"] - c["attn_every"])
    per_layer = 4 * c["d_state"] * 2 * c["n_embd"]
    assert mm.recurrent_state_bytes(c) - mm.recurrent_state_bytes(fewer) > (c["attn_every"] - 1) * per_layer
    assert mm.recurrent_state_bytes(dict(mm.PRESETS["8b"])) == 0


@pytest.mark.parametrize("args, message", [
    (["--preset", "tiny", "--d-state", "128"], "is for the hybrid presets"),
    (["--preset", "hybrid-tiny", "--attn-every", "9"], "at least one attention and one recurrent layer"),
    (["--preset", "hybrid-tiny", "--n-ssm-head", "3"], "must divide by n_ssm_head"),
    (["--preset", "hybrid-tiny", "--n-layer", "0"], "positive integer"),
])
def test_cli_refuses_shapes_llama_cpp_cannot_load(tmp_path, vocab, args, message):
    out = tmp_path / "m.gguf"
    p = subprocess.run([sys.executable, str(SCRIPT), str(out), "--vocab", str(vocab)] + args,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr
    assert not out.exists()


def test_cli_warns_when_cuda_would_not_run_the_ssm(tmp_path, vocab):
    p = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "m.gguf"), "--vocab", str(vocab),
                        "--preset", "hybrid-tiny", "--d-state", "64"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "d_state 64 not 96/128/256" in p.stderr
    assert re.search(r"recurrent state \d+ B", p.stdout)


# ---- the real llama-server (CPU build) ------------------------------------------------------------







PROMPTS = ["Once upon a time there was a little robot who", "The quick brown fox jumps over the lazy dog and then",
           "In a galaxy far far away a small ship"]


def _serve_and_ask(binary: str, model: Path, log_path: Path, flags: list) -> list:
    """Start llama-server (trace-level log: checkpoint and prompt-cache lines are LOG_TRC), stream the
    prompts one after another, stop it. Returns each request's SSE events."""
    proc, port = llama_cpu.start(binary, model, log_path, ["-lv", "4", *flags])
    try:
        answers = []
        for prompt in PROMPTS:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            c.request("POST", "/completion", json.dumps({"prompt": prompt, "n_predict": 6, "stream": True}),
                      {"Content-Type": "application/json"})
            resp = c.getresponse()
            assert resp.status == 200
            events = [json.loads(line[6:]) for line in resp.read().decode().splitlines() if line.startswith("data: ")]
            answers.append(events)
            c.close()
        return answers
    finally:
        llama_cpu.stop(proc)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    binary, v = llama_cpu.binary_and_vocab()
    d = tmp_path_factory.mktemp("hybrid-server")
    c = dict(mm.PRESETS["hybrid-tiny"], preset="hybrid-tiny")
    mm.write_model(d / "hybrid-tiny.gguf", Path(v), c)
    runs = {}
    for name, flags in (("default", []), ("off", ["--cache-ram", "0", "--ctx-checkpoints", "0"])):
        log = d / f"{name}.log"
        runs[name] = (_serve_and_ask(binary, d / "hybrid-tiny.gguf", log, flags), log.read_text(errors="replace"))
    return c, runs


@pytest.mark.timeout(120)
def test_llama_server_loads_hybrid_tiny_and_streams(served):
    _, runs = served
    for name, (answers, log) in runs.items():
        assert "granitehybrid" in log and "llama_memory_recurrent" in log, name
        for events in answers:
            # Random weights can sample a token that ends inside a UTF-8 character or starts a stop
            # word: llama-server holds such a token back and sends its text with a later event, so
            # there is at most one event per token, and the count of generated tokens is in the last.
            tokens = [e for e in events if not e.get("stop")]
            assert 1 <= len(tokens) <= 6, name
            last = events[-1]
            assert last["stop"] is True and last["timings"]["prompt_n"] > 0, name
            assert last["timings"]["predicted_n"] == 6 and last["tokens_predicted"] == 6, name


def _mib(log: str, pattern: str) -> list:
    return [float(m) for m in re.findall(pattern, log)]


@pytest.mark.timeout(120)
def test_default_flags_save_checkpoints_of_the_recurrent_state_size(served):
    c, runs = served
    log = runs["default"][1]
    state = mm.recurrent_state_bytes(c)
    # a context checkpoint of a hybrid holds only the recurrent state: the estimate is exact to the MiB print
    ckpt = _mib(log, r"created context checkpoint \d+ of \d+ \(.*size = ([\d.]+) MiB\)")
    assert ckpt and all(abs(x - state / 2**20) <= 0.001 for x in ckpt), (ckpt, state)
    # a prompt-cache save holds that plus the attention KV of its tokens
    saves = re.findall(r"saving prompt with length (\d+), total state size = ([\d.]+) MiB", log)
    assert saves
    for n, mib in saves:
        assert abs(float(mib) - (state + int(n) * mm.kv_bytes_per_token(c)) / 2**20) <= 0.002, (n, mib)
    assert re.search(r"cache state: [1-9]\d* prompts", log)


@pytest.mark.timeout(120)
def test_cache_ram_0_and_ctx_checkpoints_0_save_nothing(served):
    _, runs = served
    log = runs["off"][1]
    assert "prompt cache is disabled" in log and "context checkpoints disabled" in log
    assert "created context checkpoint" not in log and "saving prompt" not in log and "cache state:" not in log
