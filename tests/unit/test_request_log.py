"""Request logs: JSON lines and OTLP JSON traces read into records; bad input is one clear error."""
from __future__ import annotations

import json

import pytest

from otel_gpu_census.report.request_log import RequestLogError, RequestRecord, load, parse, peak_in_flight

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
    ([f'{{"start_time_unix_nano": {T + 5}, "end_time_unix_nano": {T + 4}}}'], f"line 1: end ({T + 4}) before start ({T + 5})"),
    (['{"end_time_unix_nano": 4}'], "line 1: start_time_unix_nano is not a whole number of nanoseconds: None"),
    ([f'{{"start_time_unix_nano": 1.5, "end_time_unix_nano": {T}}}'], "is not a whole number of nanoseconds: 1.5"),
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
    from otel_gpu_census.report.request_log import parse
    lines = [f'{{"id":"cmpl-a-0","start_time_unix_nano":{T + 1000},"end_time_unix_nano":{T + 5000},'
             f'"first_token_time_unix_nano":{T + 2000},"gpu":{{"kernel.count":3}}}}',
             f'{{"id":"cmpl-b-0","start_time_unix_nano":{T + 1500},"end_time_unix_nano":{T + 6000},'
             '"gpu":{"kernel.count":1},"kernel_tracing":"100/1000","kernel_traced_ratio":0.25}',   # sampled tracing
             '{"summary":{"method":"step_tokens","total":{"kernel.count":3}}}']
    r, r2 = parse(lines)
    assert (r.start_ns, r.first_token_ns, r.end_ns) == (T + 1000, T + 2000, T + 5000)
    assert (r2.start_ns, r2.first_token_ns, r2.end_ns) == (T + 1500, None, T + 6000)


def _export(spans=None, **over):
    doc = {"resourceSpans": [{"scopeSpans": [{"spans": spans if spans is not None else [_span(2, T, T + 10)]}]}]}
    doc.update(over)
    return json.dumps(doc)


@pytest.mark.parametrize("doc, message", [
    ('{"resourceSpans": {"a": 1}}', "resourceSpans is not a list: {'a': 1}"),
    ('{"resourceSpans": ["x"]}', "an item of resourceSpans is not an object: 'x'"),
    ('{"resourceSpans": [{"scopeSpans": 5}]}', "scopeSpans is not a list: 5"),
    ('{"resourceSpans": [{"scopeSpans": [{"spans": "s"}]}]}', "spans is not a list: 's'"),
    ('{"resourceSpans": [{"scopeSpans": [{"spans": [null]}]}]}', "an item of spans is not an object: None"),
    (_export([dict(_span(2, T, T + 10), attributes={"k": 1})]), "attributes is not a list"),
    (_export([dict(_span(2, T, T + 10), attributes=[[1]])]), "an item of attributes is not an object: [1]"),
    (_export([dict(_span(2, T, T + 10), attributes=[{"key": "gen_ai.latency.time_to_first_token", "value": 3}])]),
     "the value of gen_ai.latency.time_to_first_token is not an object: 3"),
    (_export([_span(2, T, T + 10, ttft=float("inf"))]),
     "gen_ai.response.time_to_first_chunk is not a finite number of seconds: inf"),
    (_export([_span(2, T, T + 10, ttft=float("nan"))]), "is not a finite number of seconds: nan"),
    (_export([dict(_span(2, T, T + 10), attributes=[{"key": "gen_ai.latency.time_to_first_token",
                                                      "value": {"stringValue": "soon"}}])]),
     "is not a finite number of seconds: 'soon'"),
    (_export([dict(_span(2, T, T + 10), attributes=[{"key": "gen_ai.latency.time_to_first_token",
                                                      "value": {"intValue": 10 ** 400}}])]),
     "is not a finite number of seconds: 1000000000000000000000000000000000000000… (401 characters)"),
    (_export([_span(2, 1000, 2000)]), "startTimeUnixNano 1000 is not a time between the years 2000 and 2100"),
    (_export([_span(2, T, 3 * 10**21)]), "endTimeUnixNano 3000000000000000000000 is not a time between"),
    (json.dumps({"start_time_unix_nano": 1, "end_time_unix_nano": 2}), "start_time_unix_nano 1 is not a time"),
    (json.dumps({"start_time_unix_nano": T, "end_time_unix_nano": "9" * 30}),
     "end_time_unix_nano 999999999999999999999999999999 is not a time between"),
    (json.dumps({"start_time_unix_nano": T, "end_time_unix_nano": "9" * 50}),
     "end_time_unix_nano is not a whole number of nanoseconds: '" + "9" * 50 + "'"),
    (json.dumps({"start_time_unix_nano": "١٢٣", "end_time_unix_nano": T}), "is not a whole number of nanoseconds"),
    ("[" * 100_000 + "]" * 100_000, "not JSON (JSON nested too deeply to read)"),
])
def test_wrong_types_and_values_are_refused_with_one_line(doc, message):
    with pytest.raises(RequestLogError) as e:
        parse([doc], "r.jsonl")
    assert message in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 300


def test_a_huge_finite_time_to_first_token_is_outside_the_request():
    [r] = parse([_export([_span(2, T, T + 10, ttft=1e300)])])
    assert r.first_token_ns is None
