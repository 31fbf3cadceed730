"""Request logs: JSON lines and OTLP JSON traces read into records; bad input is one clear error."""
from __future__ import annotations

import json

import pytest

from otel_gpu_census.request_log import RequestLogError, RequestRecord, load, parse, peak_in_flight

T = 1_764_400_000_000_000_000


def test_json_lines_with_and_without_first_token():
    lines = [json.dumps({"start_time_unix_nano": T + 500, "end_time_unix_nano": T + 900}), "",
             json.dumps({"start_time_unix_nano": str(T), "end_time_unix_nano": str(T + 400),
                         "first_token_time_unix_nano": T + 100})]
    assert parse(lines) == [RequestRecord(T, T + 400, T + 100), RequestRecord(T + 500, T + 900)]


def test_a_first_token_outside_its_request_is_dropped():
    [r] = parse([json.dumps({"start_time_unix_nano": T, "end_time_unix_nano": T + 10,
                             "first_token_time_unix_nano": T + 11})])
    assert r.first_token_ns is None


def _span(kind, start, end, ttft=None, ttft_key="gen_ai.response.time_to_first_chunk"):
    attrs = [{"key": "gen_ai.request.model", "value": {"stringValue": "m"}}]
    if ttft is not None:
        attrs.append({"key": ttft_key, "value": {"doubleValue": ttft}})
    return {"kind": kind, "startTimeUnixNano": str(start), "endTimeUnixNano": str(end), "attributes": attrs}


def test_otlp_json_server_spans_one_export_a_line():
    export = {"resourceSpans": [{"scopeSpans": [{"spans": [
        _span(2, T, T + 2_000_000_000, ttft=0.25), _span(3, T, T + 10)]}]}]}        # a CLIENT span: not a request
    second = {"resourceSpans": [{"scopeSpans": [{"spans": [_span("SPAN_KIND_SERVER", T + 5, T + 9)]}]}]}
    recs = parse([json.dumps(export), json.dumps(second)])
    assert recs == [RequestRecord(T, T + 2_000_000_000, T + 250_000_000), RequestRecord(T + 5, T + 9)]


def test_the_first_token_of_vllms_own_spans_too():
    """vLLM's llm_request span says its TTFT under vLLM's name, not the GenAI conventions' one."""
    export = {"resourceSpans": [{"scopeSpans": [{"spans": [
        _span(2, T, T + 2_000_000_000, ttft=0.5, ttft_key="gen_ai.latency.time_to_first_token"),
        _span(2, T, T + 2_000_000_000, ttft=0.5, ttft_key="some.other.ttft")]}]}]}
    assert parse([json.dumps(export)]) == [RequestRecord(T, T + 2_000_000_000, T + 500_000_000),
                                           RequestRecord(T, T + 2_000_000_000)]


def test_otlp_json_pretty_printed_over_several_lines():
    export = {"resourceSpans": [{"scopeSpans": [{"spans": [_span(2, T, T + 7)]}]}]}
    assert parse(json.dumps(export, indent=2).splitlines(True)) == [RequestRecord(T, T + 7)]


@pytest.mark.parametrize("lines, message", [
    (["{not json"], "requests.jsonl, line 1: not JSON"),
    (['{"start_time_unix_nano": 5, "end_time_unix_nano": 4}'], "line 1: end (4) before start (5)"),
    (['{"end_time_unix_nano": 4}'], "line 1: start_time_unix_nano is not a whole number of nanoseconds: None"),
    (['{"start_time_unix_nano": 1.5, "end_time_unix_nano": 4}'], "is not a whole number of nanoseconds: 1.5"),
    (["[1, 2]"], "line 1: expected a JSON object per line"),
    (["", "  "], "requests.jsonl: no requests in it"),
    (['{"resourceSpans": []}'], "requests.jsonl: no requests in it"),
])
def test_bad_logs_say_where(lines, message):
    with pytest.raises(RequestLogError) as e:
        parse(lines, "requests.jsonl")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_load_missing_and_binary_files(tmp_path):
    with pytest.raises(RequestLogError, match="cannot read request log .*nope.jsonl: No such file"):
        load(str(tmp_path / "nope.jsonl"))
    b = tmp_path / "b.jsonl"
    b.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(RequestLogError, match="not a text file"):
        load(str(b))


def test_peak_in_flight_inside_a_range():
    recs = [RequestRecord(0, 10), RequestRecord(5, 20), RequestRecord(10, 30), RequestRecord(40, 50)]
    assert peak_in_flight(recs, 0, 100) == 2          # an end and a start at 10: not three at once
    assert peak_in_flight(recs, 35, 100) == 1
    assert peak_in_flight(recs, 30, 40) == 0


def test_the_vllm_integrations_request_log_reads_with_its_summary_line():
    from otel_gpu_census.request_log import parse
    lines = ['{"id":"cmpl-a-0","start_time_unix_nano":1000,"end_time_unix_nano":5000,'
             '"first_token_time_unix_nano":2000,"gpu":{"kernel.count":3}}',
             '{"id":"cmpl-b-0","start_time_unix_nano":1500,"end_time_unix_nano":6000,"gpu":{"kernel.count":1},'
             '"kernel_tracing":"100/1000","kernel_traced_ratio":0.25}',         # sampled kernel tracing
             '{"summary":{"method":"step_tokens","total":{"kernel.count":3}}}']
    r, r2 = parse(lines)
    assert (r.start_ns, r.first_token_ns, r.end_ns) == (1000, 2000, 5000)
    assert (r2.start_ns, r2.first_token_ns, r2.end_ns) == (1500, None, 6000)
