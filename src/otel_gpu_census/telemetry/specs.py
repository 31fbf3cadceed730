"""Instruments as docs/metrics.md lists them: the spec of one, the attribute keys they share, and
how an observable one is made (the census's and NVML's instruments are all observable)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

METER_NAME = "otel_gpu_census"

# Attribute keys.
HW_ID = "hw.id"                              # GPU UUID ("GPU-…", as nvidia-smi prints it)
PROCESS_PID = "process.pid"
PROCESS_EXE = "process.executable.name"
COPY_DIRECTION = "gpu_census.copy.direction"  # census.DIRECTIONS
COPY_MEMORY = "gpu_census.copy.memory_kind"   # census.MEMORY_KINDS: the host side of the copy
IO_DIRECTION = "network.io.direction"         # receive | transmit, for hw.gpu.io


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
