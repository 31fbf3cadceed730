"""Instruments as docs/metrics.md lists them: the spec of one, the attribute keys they share, and
how an observable one is made (the census's and NVML's instruments are all observable)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

METER_NAME = "otel_gpu_census"

# Attribute keys.
HW_ID = "hw.id"                              # GPU UUID ("GPU-…", as nvidia-smi prints it)
HW_TYPE, HW_VENDOR = "hw.type", "hw.vendor"  # "gpu" (required by the hardware conventions), "NVIDIA"
# recommended by the conventions, set where NVML knows the GPU: its name (e.g. "NVIDIA <model>"), its device node
# ("nvidia0", as /dev and dcgm-exporter's `device` label name it) and the driver's version
HW_MODEL, HW_NAME, HW_DRIVER = "hw.model", "hw.name", "hw.driver_version"
GPU = (HW_ID, HW_TYPE, HW_VENDOR)            # on every series of a GPU
PROCESS_PID = "process.pid"
PROCESS_EXE = "process.executable.name"
COPY_DIRECTION = "gpu_census.copy.direction"  # census.DIRECTIONS
COPY_MEMORY = "gpu_census.copy.memory_kind"   # census.MEMORY_KINDS: the host side of the copy
IO_DIRECTION = "network.io.direction"         # receive (into the GPU) | transmit (out of it)


@dataclass(frozen=True)
class Spec:
    """One instrument as docs/metrics.md lists it. Every instrument here is observable."""

    name: str
    instrument: str          # "counter" | "gauge" | "updowncounter"
    unit: str
    attributes: Tuple[str, ...]
    description: str


def create_observable(meter, spec: Spec, callback) -> object:
    make = {"counter": meter.create_observable_counter,
            "gauge": meter.create_observable_gauge,
            "updowncounter": meter.create_observable_up_down_counter}[spec.instrument]
    return make(spec.name, callbacks=[callback], unit=spec.unit, description=spec.description)


def gpu_attributes(hw_id: str, known=None) -> dict:
    """The attributes of GPU `hw_id` on its series: GPU's keys, and what `known` ({hw.id: {hw.model: …}},
    from NVML) adds."""
    return {HW_ID: hw_id, HW_TYPE: "gpu", HW_VENDOR: "NVIDIA", **((known or {}).get(hw_id) or {})}
