"""telemetry.redact: the one place where what users, clients and upstreams supplied is made safe for
telemetry and logs."""
from __future__ import annotations

import math

import pytest

from otel_gpu_census.telemetry import redact


@pytest.mark.parametrize("given, shown", [
    ("http://u:pw@h:8080/p", "http://REDACTED:REDACTED@h:8080/p"),
    ("https://token@h", "https://REDACTED:REDACTED@h"),
    ("http://u:p@ss@h:1/x?y=1", "http://REDACTED:REDACTED@h:1/x?y=1"),     # the last '@' ends the userinfo
    ("http://u:pa/ss@h:80", "http://REDACTED:REDACTED@h:80"),             # malformed: still hidden
    ("http://h:1/p?api_key=K&q=2#f", "http://h:1/p?api_key=REDACTED&q=2#f"),
    ("http://h:1/a@b", "http://REDACTED:REDACTED@b"),                     # over-redacts, never leaks
    ("unix:/run/llama.sock", "unix:/run/llama.sock"),
    ("http://h:1", "http://h:1"),
])
def test_url(given, shown):
    assert redact.url(given) == shown


def test_query_redacts_secret_names_only():
    q = ("api_key=1&apikey=2&key=3&token=4&access_token=5&Signature=6&sig=7&X-Amz-Credential=8&password=9"
         "&client_secret=10&api%5Fkey=11&model=m&max_tokens=5&keyword=k&flag&=x")
    assert redact.query(q) == ("api_key=REDACTED&apikey=REDACTED&key=REDACTED&token=REDACTED&access_token=REDACTED"
                               "&Signature=REDACTED&sig=REDACTED&X-Amz-Credential=REDACTED&password=REDACTED"
                               "&client_secret=REDACTED&api%5Fkey=REDACTED&model=m&max_tokens=5&keyword=k&flag&=x")


def test_text_scrubs_urls_headers_and_escapes():
    t = redact.text("cannot connect to http://a:b@h:1/x?token=t: Authorization: Bearer xyz\n\x1b[2J\u202e")
    assert t == ("cannot connect to http://REDACTED:REDACTED@h:1/x?token=REDACTED: Authorization: REDACTED"
                 "\\n\\x1b[2J\\u202e")
    assert redact.text("x" * 5000, 100).startswith("x" * 100 + "… (5000 characters)")


def test_reason_drops_what_a_parser_quotes():
    assert redact.reason("bad request: BadHttpMessage: Invalid header value char:\n\n  b'Authorization: "
                         "Bearer s3cr\\x01'\n  ^") == "bad request: BadHttpMessage: Invalid header value char"
    assert redact.reason("Invalid HTTP header: 'X-Api-Key s3cr'") == "Invalid HTTP header: …"
    assert redact.reason('Bad status line "GET /?token=s3cr HTTP/1.1"') == "Bad status line …"


def test_attribute_values_are_printable_bounded_and_carriable():
    out = redact.attributes({"s": "a\x00b", "long": "y" * 5000, "big": 1 << 63, "ok": (1 << 63) - 1,
                             "neg": -(1 << 63), "nan": math.nan, "inf": -math.inf, "f": 1.5, "b": True,
                             "seq": ["a\x1b", "b"], "badseq": [1, 1 << 70]})
    assert out["s"] == "a\\x00b" and len(out["long"]) < 1100
    assert out["ok"] == (1 << 63) - 1 and out["neg"] == -(1 << 63) and out["f"] == 1.5 and out["b"] is True
    assert out["seq"] == ["a\\x1b", "b"]
    assert not {"big", "nan", "inf", "badseq"} & set(out)
