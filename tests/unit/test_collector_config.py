"""collector-config/: one Collector config carries traces and metrics on one OTLP port; every pipeline
names defined components; the collector's exporters send where the Jaeger, Tempo and Prometheus configs
listen or scrape; and every address the configs bind by default is on the loopback and distinct, so they
all run together on one host."""
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
    for name in ("otelcol.yaml", "jaeger-v2.yaml"):
        c = _load(name)
        for pname, p in c["service"]["pipelines"].items():
            for kind in ("receivers", "processors", "exporters"):
                assert p.get(kind), f"{name}: pipeline {pname} has no {kind}"
                for comp in p[kind]:
                    assert comp in (c.get(kind) or {}), f"{name}: {pname} uses undefined {kind[:-1]} {comp}"
        for ext in c["service"].get("extensions", []):
            assert ext in c["extensions"], f"{name}: undefined extension {ext}"


def test_one_collector_takes_both_signals_on_one_port():
    col = _load("otelcol.yaml")
    pipes = col["service"]["pipelines"]
    assert set(pipes) == {"traces", "metrics"}
    assert pipes["traces"]["receivers"] == pipes["metrics"]["receivers"] == ["otlp"]
    listen = {_default(col["receivers"]["otlp"]["protocols"][p]["endpoint"]) for p in ("grpc", "http")}
    assert listen == {"127.0.0.1:4317", "127.0.0.1:4318"}     # the OTLP defaults the run and the proxy export to
    assert pipes["metrics"]["exporters"] == ["prometheus"]
    assert set(pipes["traces"]["exporters"]) == {"otlp_grpc/jaeger", "otlp_grpc/tempo"}


def test_collector_sends_where_jaeger_and_tempo_listen_and_prometheus_scrapes():
    col = _load("otelcol.yaml")
    jaeger, tempo, prom = _load("jaeger-v2.yaml"), _load("tempo.yaml"), _load("prometheus.yml")
    assert _default(col["exporters"]["otlp_grpc/jaeger"]["endpoint"]) == \
        _default(jaeger["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])
    assert _default(col["exporters"]["otlp_grpc/tempo"]["endpoint"]) == \
        _default(tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"])
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    assert jobs["otel-collector"]["static_configs"][0]["targets"] == \
        [_default(col["exporters"]["prometheus"]["endpoint"])]
    assert jobs["otel-gpu-census"]["static_configs"][0]["targets"] == ["localhost:9464"]   # `run --exporter prometheus`


def test_default_addresses_are_loopback_and_distinct():
    col, jaeger, tempo = _load("otelcol.yaml"), _load("jaeger-v2.yaml"), _load("tempo.yaml")
    bound = {
        "collector otlp grpc": _default(col["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]),
        "collector otlp http": _default(col["receivers"]["otlp"]["protocols"]["http"]["endpoint"]),
        "collector prometheus": _default(col["exporters"]["prometheus"]["endpoint"]),
        "jaeger otlp grpc": _default(jaeger["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]),
        "jaeger otlp http": _default(jaeger["receivers"]["otlp"]["protocols"]["http"]["endpoint"]),
        "jaeger ui": _default(jaeger["extensions"]["jaeger_query"]["http"]["endpoint"]),
        "tempo otlp grpc": _default(tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]),
    }
    for what, addr in bound.items():
        assert addr.startswith("127.0.0.1:"), f"{what} binds {addr} by default (listen beyond loopback by choice only)"
    for side in ("http", "grpc"):
        assert tempo["server"][f"{side}_listen_address"] == "127.0.0.1", f"tempo {side} binds beyond loopback"
    ports = [int(a.rsplit(":", 1)[1]) for a in bound.values()]
    ports += [tempo["server"]["http_listen_port"], tempo["server"]["grpc_listen_port"], 9464, 9090]
    assert len(ports) == len(set(ports)), f"two configs bind one port: {sorted(ports)}"
