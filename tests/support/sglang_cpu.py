"""Import SGLang's real classes on a CPU-only machine (the environment of tests/sglang_env.sh).

SGLang reaches torchvision through its model configs (``sglang.srt.configs`` -> internvl_utils). PyPI
has only CUDA builds of torchvision, whose C ops cannot load beside a CPU torch; torchvision then fails at
import while registering fake kernels for two of those ops (``torchvision::nms``, ``qnms``). Declaring
the two ops first lets it import (nothing here calls them). A machine whose torchvision works is left
alone.
"""
from __future__ import annotations

import importlib.util

TORCHVISION_OPS = ("nms", "qnms")


def prepare() -> None:
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("torchvision") is None:
        return
    import torch
    for op in TORCHVISION_OPS:
        try:
            torch.library.define(f"torchvision::{op}", "(Tensor x) -> Tensor")
        except RuntimeError:
            pass                         # declared already (torchvision's own ops loaded)
