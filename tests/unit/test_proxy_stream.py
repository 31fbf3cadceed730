"""Reading facts from a copy of the answer: every split of the bytes gives the same facts."""
import gzip
import json
import zlib

import pytest

from otel_gpu_census.integrations.llamacpp import stream
from otel_gpu_census.integrations.llamacpp.stream import BodyReader, parse_request_body


def sse(*objs, done=False, sep=b"\n"):
    out = b""
    for o in objs:
        out += b"data: " + json.dumps(o, separators=(",", ":")).encode() + sep + sep
    if done:
        out += b"data: [DONE]" + sep + sep
    return out


COMPLETION = sse(
    {"index": 0, "content": "He", "tokens": [], "stop": False, "id_slot": -1, "tokens_predicted": 1,
     "tokens_evaluated": 4},
    {"index": 0, "content": "llo", "tokens": [], "stop": False, "id_slot": -1, "tokens_predicted": 2,
     "tokens_evaluated": 4},
    {"index": 0, "content": "", "id_slot": 3, "stop": True, "model": "m.gguf", "tokens_predicted": 2,
     "tokens_evaluated": 4, "stop_type": "limit",
     "timings": {"cache_n": 1, "prompt_n": 3, "prompt_ms": 5.5, "predicted_n": 2, "predicted_ms": 9.0,
                 "predicted_per_second": 222.2}})


def read(body: bytes, ct="text/event-stream", splits=None, enc=""):
    r = BodyReader(ct, enc)
    t = 0
    if splits is None:
        splits = [body]
    for part in splits:
        t += 1
        r.feed(part, t)
    return r.close(t + 1)


def test_completion_facts():
    f = read(COMPLETION)
    assert f.kind == "sse" and f.done
    assert f.first_token_ns == 1 and f.token_events == 2
    assert f.id_slot == 3 and f.model == "m.gguf"
    assert f.input_tokens == 4 and f.output_tokens == 2 and f.finish_reason == "limit"
    assert f.timings == {"cache_n": 1, "prompt_n": 3, "prompt_ms": 5.5, "predicted_n": 2, "predicted_ms": 9.0}


@pytest.mark.parametrize("sep", [b"\n", b"\r\n", b"\r"])
def test_every_split_point_gives_the_same_facts(sep):
    body = COMPLETION.replace(b"\n", sep) if sep != b"\n" else COMPLETION
    whole = read(body)
    for i in range(1, len(body)):
        f = read(body, splits=[body[:i], body[i:]])
        assert (f.output_tokens, f.id_slot, f.timings, f.done, f.token_events) == \
            (whole.output_tokens, whole.id_slot, whole.timings, whole.done, whole.token_events), i
    f = read(body, splits=[bytes([b]) for b in body])      # one byte at a time
    assert f.timings == whole.timings and f.token_events == 2


def test_first_token_time_is_the_chunk_that_carried_it():
    body = sse({"choices": [], "prompt_progress": {"processed": 10}, "id": "c1"}) + COMPLETION
    cut = body.index(b"data: {\"index\"")
    f = read(body, splits=[body[:cut], body[cut:cut + 10], body[cut + 10:]])
    assert f.first_token_ns == 3          # the progress event (chunk 1) and the partial head (2) do not count


def test_each_chunk_is_read_after_the_next_and_the_last_at_the_end():
    body = sse({"choices": [], "prompt_progress": {"processed": 10}}) + COMPLETION
    cut1, cut2 = body.index(b"data: {\"index\""), body.index(b"data: {\"index\":0,\"content\":\"llo")
    firsts = []
    r = BodyReader("text/event-stream", on_first_token=firsts.append)
    r.feed(body[:cut1], 1)
    r.feed(body[cut1:cut2], 2)
    assert r.facts.events == 1 and firsts == []            # the progress event was read, the token not yet
    r.feed(body[cut2:], 3)
    assert firsts == [2] and r.facts.first_token_ns == 2   # the time of the chunk that carried it
    assert not r.facts.done                                # the last chunk (the final event) waits
    f = r.close(4)
    assert f.done and f.output_tokens == 2 and f.token_events == 2 and firsts == [2]
    r = BodyReader("text/event-stream", on_first_token=firsts.append)
    r.feed(COMPLETION, 7)
    r.catch_up()                                           # an answer in one chunk: read on demand
    assert r.facts.first_token_ns == 7 and firsts == [2, 7]


def test_chat_stream_ids_usage_and_done():
    body = sse({"choices": [{"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}],
                "id": "chatcmpl-1", "model": "x", "object": "chat.completion.chunk"},
               {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": "a"}}], "id": "chatcmpl-1"},
               {"choices": [{"finish_reason": "stop", "index": 0, "delta": {}}], "id": "chatcmpl-1"},
               {"choices": [], "id": "chatcmpl-1", "usage": {"prompt_tokens": 9, "completion_tokens": 1,
                                                             "prompt_tokens_details": {"cached_tokens": 4}},
                "timings": {"prompt_n": 5, "cache_n": 4, "predicted_n": 1}}, done=True)
    f = read(body)
    assert f.response_id == "chatcmpl-1" and f.done and f.finish_reason == "stop"
    assert (f.input_tokens, f.output_tokens, f.cached_tokens) == (9, 1, 4)
    assert f.first_token_ns == 1


def test_comments_and_multiline_data_and_other_fields():
    body = b": ping\n\nevent: x\nid: 7\ndata: {\"content\":\"a\",\ndata: \"stop\":false}\n\n"
    f = read(body)
    assert f.token_events == 1 and f.unparsed == 0


def test_malformed_and_error_events():
    body = b"data: {nope\n\n" + sse({"error": {"code": 500, "message": "boom", "type": "server_error"}})
    f = read(body)
    assert f.unparsed == 1 and f.error == "boom" and f.first_token_ns is None


def test_oversized_event_is_skipped_not_buffered(monkeypatch):
    monkeypatch.setattr(stream, "MAX_EVENT_BYTES", 1000)
    big = b"data: {\"content\":\"" + b"x" * 5000 + b"\",\"stop\":false}\n\n"
    f = read(big + COMPLETION, splits=[big[:700], big[700:] + COMPLETION])
    assert f.unparsed == 1 and f.output_tokens == 2 and f.token_events == 2


def test_ollama_ndjson():
    lines = [{"model": "l3", "response": "a", "done": False}, {"model": "l3", "response": "b", "done": False},
             {"model": "l3", "response": "", "done": True, "done_reason": "stop", "prompt_eval_count": 11,
              "eval_count": 2, "eval_duration": 2000, "prompt_eval_duration": 500, "total_duration": 9999}]
    body = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    for i in range(1, len(body)):
        f = read(body, "application/x-ndjson", [body[:i], body[i:]])
        assert (f.input_tokens, f.output_tokens, f.finish_reason, f.done) == (11, 2, "stop", True), i
        assert f.ollama["eval_duration"] == 2000 and f.token_events == 2
    f = read(body, "application/x-ndjson", [body[:-1], body[-1:]])
    assert f.first_token_ns == 1


def test_ollama_chat_and_line_without_newline_at_end():
    body = b'{"message":{"role":"assistant","content":"x"},"done":false}\n{"done":true,"eval_count":1}'
    f = read(body, "application/x-ndjson")
    assert f.token_events == 1 and f.output_tokens == 1


def test_json_body_and_array_answer():
    f = read(json.dumps({"id": "cmpl-9", "usage": {"prompt_tokens": 3, "completion_tokens": 2}}).encode(),
             "application/json; charset=utf-8")
    assert f.kind == "json" and f.response_id == "cmpl-9" and f.output_tokens == 2 and f.first_token_ns is None
    f = read(json.dumps([{"stop": True, "tokens_predicted": 4, "tokens_evaluated": 1}]).encode(), "application/json")
    assert f.output_tokens == 4


def test_compressed_bodies_are_read_from_a_copy():
    z = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    gz = z.compress(COMPLETION) + z.flush()
    assert gzip.decompress(gz) == COMPLETION
    f = read(gz, enc="gzip", splits=[gz[:20], gz[20:]])
    assert f.output_tokens == 2 and f.id_slot == 3
    f = read(zlib.compress(COMPLETION), enc="deflate")
    assert f.output_tokens == 2
    f = read(b"\x00garbage", enc="br")
    assert f.note.startswith("content-encoding br") and f.events == 0


def test_a_broken_body_never_raises():
    f = read(b"\x1f\x8b not gzip at all", enc="gzip")
    assert f.note.startswith("body reader stopped")
    f = read(b"<html>", "text/html")
    assert f.events == 0 and "text/html" in f.note


def test_request_body_fields():
    assert parse_request_body(b'{"model":"m","stream":true,"n_predict":5}') == {"model": "m", "stream": True,
                                                                                "max_tokens": 5}
    assert parse_request_body(b'{"options":{"num_predict":7}}') == {"max_tokens": 7}
    assert parse_request_body(b"[1,2]") == {} and parse_request_body(b"{oops") == {}
    assert parse_request_body(b'{"model": 5, "stream": "yes"}') == {}
    # the sampling settings the GenAI conventions name (gen_ai.request.temperature, .top_p, .seed)
    assert parse_request_body(b'{"temperature": 0, "top_p": 0.9, "seed": 42}') == {"temperature": 0.0, "top_p": 0.9,
                                                                                   "seed": 42}
    assert parse_request_body(b'{"options": {"temperature": 0.7, "seed": 3, "top_p": 1}}') == {
        "temperature": 0.7, "seed": 3, "top_p": 1.0}
    assert parse_request_body(b'{"temperature": "hot", "top_p": NaN, "seed": 1.5, "options": {"temperature": 1e400}}'
                              ) == {}
