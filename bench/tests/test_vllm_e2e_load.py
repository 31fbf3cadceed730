"""CPU tests of bench/device/vllm_e2e.py's load against a stand-in /v1/completions (aiohttp): tokens
counted from the stream's events, or from the usage of one JSON answer when not streaming; the
caller's traceparent sent with every request; errors counted, not raised."""
from __future__ import annotations

import asyncio
import json
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "device"))
sys.path.insert(0, str(REPO / "tests" / "support"))
import vllm_e2e  # noqa: E402
from ports import free_port  # noqa: E402


@pytest.fixture
def server():
    from aiohttp import web
    seen = []

    async def completions(request):
        body = await request.json()
        seen.append((request.headers.get("traceparent"), body))
        n = body["max_tokens"]
        if body.get("prompt", "").startswith("omicron"):        # one prompt of the seed fails
            return web.Response(status=500)
        if not body["stream"]:
            return web.json_response({"id": f"cmpl-{len(seen)}", "usage": {"completion_tokens": n}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            ev = {"id": f"cmpl-{len(seen)}", "choices": [{"text": f"t{i}"}]}
            await resp.write(f"data: {json.dumps(ev)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    port = free_port()
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    yield port, seen
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(5)
    loop.call_soon_threadsafe(loop.stop)
    t.join(5)


@pytest.mark.parametrize("stream", [True, False])
def test_tokens_are_counted_streaming_or_not(server, stream):
    port, seen = server
    res = asyncio.run(vllm_e2e.load(port, clients=3, per_client=2, max_tokens=5, seed=7, stream=stream))
    ok = [r for r in res["requests"]]
    assert len(ok) + len(res["errors"]) == 6 and len(seen) == 6
    assert all(r["tokens"] == 5 and r["id"] for r in ok)
    assert all((r["ttft_s"] is not None) == stream for r in ok)
    assert res["tok_per_s"] > 0 and all(e == 500 for e in res["errors"])
    sent = {tp for tp, _ in seen}
    assert {f"00-{r['trace_id']}-{r['span_id']}-01" for r in ok} <= sent and len(sent) == 6
    assert all(b["stream"] is stream and b["ignore_eos"] for _, b in seen)
