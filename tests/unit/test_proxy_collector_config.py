"""collector-config for traces: every pipeline names defined components, and the default ports of the
collector's exporters are where the Jaeger and Tempo configs listen."""
import re
from pathlib import Path

import yaml

CFG = Path(__file__).resolve().parents[2] / "collector-config"


def _load(name):
    return yaml.safe_load((CFG / name).read_text())


def _default(value: str) -> str:
    """'${env:X:-127.0.0.1:4317}' or '${X:-...}' -> '127.0.0.1:4317'."""
    m = re.fullmatch(r"\$\{(?:env:)?\w+:-(.+)\}", value)
    assert m, f"{value!r} should be an env variable with a default"
    return m.group(1)


def test_pipelines_use_defined_components():
    for name in ("otelcol-traces.yaml", "jaeger-v2.yaml"):
        c = _load(name)
        for pname, p in c["service"]["pipelines"].items():
            for kind in ("receivers", "processors", "exporters"):
                for comp in p.get(kind, []):
                    assert comp in (c.get(kind) or {}), f"{name}: {pname} uses undefined {kind[:-1]} {comp}"
        for ext in c["service"].get("extensions", []):
            assert ext in c["extensions"], f"{name}: undefined extension {ext}"


def test_collector_sends_where_jaeger_and_tempo_listen():
    col = _load("otelcol-traces.yaml")
    jaeger = _load("jaeger-v2.yaml")
    tempo = _load("tempo.yaml")
    assert _default(col["exporters"]["otlp/jaeger"]["endpoint"]) == \
        _default(jaeger["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])
    assert _default(col["exporters"]["otlp/tempo"]["endpoint"]) == \
        _default(tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])
    listen = {_default(col["receivers"]["otlp"]["protocols"][p]["endpoint"]) for p in ("grpc", "http")}
    assert listen == {"127.0.0.1:4317", "127.0.0.1:4318"}     # the OTLP defaults the proxy exports to
    assert not listen & {_default(jaeger["receivers"]["otlp"]["protocols"][p]["endpoint"]) for p in ("grpc", "http")}
    assert set(col["service"]["pipelines"]) == {"traces"}
