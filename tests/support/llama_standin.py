"""A stand-in for llama-server (b11434) and Ollama speaking their wire formats, for tests.

Formats follow llama.cpp tools/server (server-task.cpp, server-context.cpp, format_oai_sse):
- ``/completion``: ``data: {json}\\n\\n`` per token (``stop:false``, ``id_slot``, ``tokens_predicted``,
  ``tokens_evaluated``), a last event with ``stop:true``, ``stop_type`` and ``timings``; no ``[DONE]``.
- ``/v1/completions`` and ``/v1/chat/completions``: OpenAI chunks with ``id`` ``cmpl-…``/``chatcmpl-…``,
  the chat role delta sent in the same write as the first token, ``timings`` on the last chunk,
  then ``data: [DONE]``.
- ``/v1/embeddings``; ``/health``; errors as ``{"error": {"code", "message", "type"}}``.
- Ollama ``/api/generate`` and ``/api/chat``: NDJSON lines; the last has ``done:true``,
  ``prompt_eval_count``, ``eval_count`` and durations in ns.
JSON is compact (nlohmann ``dump()`` style). Behaviour knobs live in ``Standin.opts`` and can be changed
between requests; every request is recorded in ``Standin.seen``.

Run by hand: ``python tests/support/llama_standin.py --port 8080``.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from aiohttp import web

FINGERPRINT = "b11434-standin"


def dump(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass
class Opts:
    tokens: int = 5                       # tokens generated per request (unless n_predict asks fewer)
    token_delay: float = 0.0              # seconds between tokens
    first_token_delay: float = 0.0        # seconds before the first token (prompt processing)
    close_after: bool = False             # close the connection after every response
    close_unannounced: bool = False       # close it after every streamed answer without saying so in the
                                          # headers (they say keep-alive), as llama-server does
    hang_before_headers: float = 0.0      # sleep this long before answering at all
    hang_after_tokens: Optional[int] = None   # stop sending (and sleep hang_for) after this many tokens
    hang_for: float = 3600.0
    drop_after_tokens: Optional[int] = None   # drop the TCP connection after this many tokens
    drop_before_headers: bool = False     # drop the connection without answering
    malformed: bool = False               # send a non-JSON data event in the middle of streams
    status: Optional[int] = None          # answer every generation request with this error status
    model: str = "standin-model"
    id_slot: int = 0
    prompt_tokens: int = 7
    ping_every_tokens: Optional[int] = None   # send a ":\n\n" SSE ping after this many tokens
    gzip: bool = False                    # gzip streamed answers (Content-Encoding: gzip, flushed per write)
    tokens_per_event: int = 1             # /completion: tokens one event carries (llama-server holds back an
                                          # incomplete UTF-8 sequence and sends it with the next token)
    held_at_end: int = 0                  # /completion: the last tokens sent only in the final (stop) event, as
                                          # llama-server does when they end inside a UTF-8 sequence


@dataclass
class Seen:
    method: str
    path: str
    headers: Dict[str, str]
    body: bytes
    raw_path: str
    finished: bool = False
    cancelled: bool = False
    elapsed: float = 0.0
    sent: bytes = b""                      # body bytes written to the proxy
    peer: Any = None                       # (host, port) of the connection it came on
    received_ns: int = 0                   # wall clock when the whole request had arrived


class _Forgetful(list):
    """A `seen` list that keeps nothing."""

    def append(self, item) -> None:
        pass


class Standin:
    def __init__(self, **opts):
        self.opts = Opts(**opts)
        self.seen: List[Seen] = []
        self.port: Optional[int] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._runner: Optional[web.AppRunner] = None
        self._thread: Optional[threading.Thread] = None
        self.app = self._make_app()

    # -- lifecycle ----------------------------------------------------------------------
    def start(self, host: str = "127.0.0.1", port: int = 0, unix_path: Optional[str] = None) -> "Standin":
        ready = threading.Event()

        def main():
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)

            async def up():
                # handler_cancellation: a proxy that drops the connection cancels the handler,
                # as llama-server stops generating when its client goes away.
                self._runner = web.AppRunner(self.app, handle_signals=False, handler_cancellation=True)
                await self._runner.setup()
                if unix_path:
                    site = web.UnixSite(self._runner, unix_path)
                    await site.start()
                else:
                    site = web.TCPSite(self._runner, host, port)
                    await site.start()
                    self.port = site._server.sockets[0].getsockname()[1]
                ready.set()
            self._loop.run_until_complete(up())
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

        self._thread = threading.Thread(target=main, name="llama-standin", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("stand-in did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- app -----------------------------------------------------------------------------
    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/health", self.health)
        for p in ("/completion", "/completions"):
            app.router.add_post(p, self.completion)
        app.router.add_post("/v1/completions", self.oai_completion)
        for p in ("/v1/chat/completions", "/chat/completions"):
            app.router.add_post(p, self.chat)
        for p in ("/v1/embeddings", "/embeddings", "/embedding"):
            app.router.add_post(p, self.embeddings)
        app.router.add_post("/api/generate", self.ollama_generate)
        app.router.add_post("/api/chat", self.ollama_chat)
        app.router.add_route("*", "/echo", self.echo)
        app.router.add_post("/slow-upload", self.slow_upload)
        app.router.add_get("/slots", self.slots)
        return app

    async def _record(self, request: web.Request) -> Seen:
        body = await request.read()
        s = Seen(request.method, request.path, dict(request.headers), body, request.raw_path,
                 peer=request.transport.get_extra_info("peername") if request.transport else None,
                 received_ns=time.time_ns())
        self.seen.append(s)
        return s

    async def health(self, request):
        await self._record(request)
        return web.json_response({"status": "ok"})

    async def slots(self, request):
        await self._record(request)
        return web.Response(body=dump([{"id": 0, "is_processing": False}]), content_type="application/json")

    async def echo(self, request):
        s = await self._record(request)
        out = dump({"method": s.method, "path": s.path, "raw_path": s.raw_path, "headers": s.headers,
                    "body_len": len(s.body)})
        return web.Response(body=out, content_type="application/json", headers={"X-Upstream": "standin"})

    async def slow_upload(self, request):
        n = 0
        async for chunk in request.content.iter_any():
            n += len(chunk)
        return web.Response(body=dump({"received": n}), content_type="application/json")

    # -- helpers ---------------------------------------------------------------------------
    def _body(self, s: Seen) -> Dict[str, Any]:
        try:
            obj = json.loads(s.body or b"{}")
        except ValueError:
            obj = None
        return obj if isinstance(obj, dict) else {}

    def _error(self, code: int, message: str, typ: str = "invalid_request_error") -> web.Response:
        return web.Response(status=code, body=dump({"error": {"code": code, "message": message, "type": typ}}),
                            content_type="application/json")

    def _n_tokens(self, body: Dict[str, Any]) -> int:
        for k in ("n_predict", "max_tokens", "max_completion_tokens"):
            v = body.get(k)
            if isinstance(v, int) and v >= 0:
                return min(v, self.opts.tokens)
        opts = body.get("options")
        if isinstance(opts, dict) and isinstance(opts.get("num_predict"), int):
            return min(opts["num_predict"], self.opts.tokens)
        return self.opts.tokens

    def _timings(self, n: int, prompt_ms: float, gen_ms: float) -> Dict[str, Any]:
        p = self.opts.prompt_tokens
        return {"cache_n": 0, "prompt_n": p, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / p, "prompt_per_second": 1e3 * p / max(prompt_ms, 1e-9),
                "predicted_n": n, "predicted_ms": gen_ms,
                "predicted_per_token_ms": gen_ms / max(n, 1), "predicted_per_second": 1e3 * n / max(gen_ms, 1e-9)}

    async def _pre(self, request: web.Request):
        """Record, then apply the failure knobs that act before any answer."""
        s = await self._record(request)
        o = self.opts
        if o.drop_before_headers:
            request.transport.close()
            raise asyncio.CancelledError()
        if o.hang_before_headers:
            try:
                await asyncio.sleep(o.hang_before_headers)
            except asyncio.CancelledError:
                s.cancelled = True
                raise
        if o.status is not None:
            return s, self._error(o.status, "Loading model" if o.status == 503 else "stand-in error",
                                  "unavailable_error" if o.status == 503 else "server_error")
        return s, None

    async def _stream(self, request: web.Request, s: Seen, events, content_type: str):
        """Write pre-encoded events with the configured timing; events: list of (bytes, is_token)."""
        o = self.opts
        headers = {"Content-Type": content_type}
        z = None
        if o.gzip:
            headers["Content-Encoding"] = "gzip"
            z = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        resp = web.StreamResponse(status=200, headers=headers)
        if o.close_after:
            resp.force_close()
        t0 = time.monotonic()
        if o.first_token_delay:
            await asyncio.sleep(o.first_token_delay)
        await resp.prepare(request)
        tokens = 0
        raw_write = resp.write

        async def write(data: bytes) -> None:
            if z is not None:
                data = z.compress(data) + z.flush(zlib.Z_SYNC_FLUSH)
            s.sent += data          # before writing: the client may have it before this task resumes
            await raw_write(data)
        try:
            for data, is_token in events:
                if is_token:
                    if tokens and o.token_delay:
                        await asyncio.sleep(o.token_delay)
                    if o.hang_after_tokens is not None and tokens == o.hang_after_tokens:
                        await asyncio.sleep(o.hang_for)
                    if o.drop_after_tokens is not None and tokens == o.drop_after_tokens:
                        request.transport.close()
                        return resp
                    tokens += 1
                    if o.ping_every_tokens and tokens % o.ping_every_tokens == 0:
                        await write(b":\n\n")
                    if o.malformed and tokens == 2:
                        await write(b"data: {not json\n\n" if content_type == "text/event-stream"
                                    else b"{not json\n")
                await write(data)
            if z is not None:
                tail = z.flush()
                s.sent += tail
                await raw_write(tail)
            await resp.write_eof()
            s.finished = True
            if o.close_unannounced and request.transport is not None:
                request.transport.close()
        except (asyncio.CancelledError, ConnectionResetError):
            s.cancelled = True
            raise
        finally:
            s.elapsed = time.monotonic() - t0
        return resp

    # -- llama-server endpoints ------------------------------------------------------------
    async def completion(self, request):
        s, err = await self._pre(request)
        if err is not None:
            return err
        body = self._body(s)
        if not body or "prompt" not in body:
            return self._error(400, "\"prompt\" must be provided")
        n, o = self._n_tokens(body), self.opts
        final = {"index": 0, "content": "" if body.get("stream") else "tok" * n, "tokens": [],
                 "id_slot": o.id_slot, "stop": True, "model": o.model, "tokens_predicted": n,
                 "tokens_evaluated": o.prompt_tokens, "generation_settings": {"n_predict": n},
                 "prompt": body.get("prompt"), "has_new_line": False, "truncated": False,
                 "stop_type": "limit", "stopping_word": "", "tokens_cached": o.prompt_tokens + n,
                 "timings": self._timings(n, 12.5, 3.0 * n)}
        if not body.get("stream"):
            return web.Response(body=dump(final), content_type="application/json")
        k, sent = max(1, o.tokens_per_event), max(0, n - o.held_at_end)
        events = [(b"data: " + dump({"index": 0, "content": "tok" * (min(i + k, sent) - i), "tokens": [],
                                     "stop": False, "id_slot": o.id_slot, "tokens_predicted": min(i + k, sent),
                                     "tokens_evaluated": o.prompt_tokens}) + b"\n\n", True)
                  for i in range(0, sent, k)]
        events.append((b"data: " + dump(final) + b"\n\n", False))
        return await self._stream(request, s, events, "text/event-stream")

    async def oai_completion(self, request):
        s, err = await self._pre(request)
        if err is not None:
            return err
        body = self._body(s)
        n, o = self._n_tokens(body), self.opts
        cid, t = "cmpl-" + uuid.uuid4().hex[:24], int(time.time())
        usage = {"completion_tokens": n, "prompt_tokens": o.prompt_tokens, "total_tokens": n + o.prompt_tokens,
                 "prompt_tokens_details": {"cached_tokens": 0}}

        def chunk(text, fr, extra=None):
            d = {"choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": fr}],
                 "created": t, "model": o.model, "system_fingerprint": FINGERPRINT,
                 "object": "text_completion", "id": cid}
            d.update(extra or {})
            return d
        if not body.get("stream"):
            return web.Response(body=dump(chunk("tok" * n, "length", {"usage": usage,
                                "timings": self._timings(n, 12.5, 3.0 * n)})), content_type="application/json")
        events = [(b"data: " + dump(chunk("tok", None)) + b"\n\n", True) for _ in range(n)]
        events.append((b"data: " + dump(chunk("", "length", {"usage": usage,
                       "timings": self._timings(n, 12.5, 3.0 * n)})) + b"\n\n", False))
        events.append((b"data: [DONE]\n\n", False))
        return await self._stream(request, s, events, "text/event-stream")

    async def chat(self, request):
        s, err = await self._pre(request)
        if err is not None:
            return err
        body = self._body(s)
        if not isinstance(body.get("messages"), list):
            return self._error(400, "'messages' is required")
        n, o = self._n_tokens(body), self.opts
        cid, t = "chatcmpl-" + uuid.uuid4().hex[:24], int(time.time())
        usage = {"completion_tokens": n, "prompt_tokens": o.prompt_tokens, "total_tokens": n + o.prompt_tokens,
                 "prompt_tokens_details": {"cached_tokens": 0}}

        def chunk(delta, fr=None, extra=None):
            d = {"choices": [{"finish_reason": fr, "index": 0, "delta": delta}], "created": t, "id": cid,
                 "model": o.model, "system_fingerprint": FINGERPRINT, "object": "chat.completion.chunk"}
            d.update(extra or {})
            return d
        timings = self._timings(n, 12.5, 3.0 * n)
        if not body.get("stream"):
            msg = {"role": "assistant", "content": "tok" * n}
            return web.Response(body=dump({"choices": [{"finish_reason": "length", "index": 0, "message": msg}],
                                           "created": t, "model": o.model, "system_fingerprint": FINGERPRINT,
                                           "object": "chat.completion", "usage": usage, "id": cid,
                                           "timings": timings}), content_type="application/json")
        events = []
        for i in range(n):
            data = b""
            if i == 0:   # the role delta goes out in the same write as the first token
                data += b"data: " + dump(chunk({"role": "assistant", "content": None})) + b"\n\n"
            data += b"data: " + dump(chunk({"content": "tok"})) + b"\n\n"
            events.append((data, True))
        last = [chunk({}, "length")]
        so = body.get("stream_options")
        if isinstance(so, dict) and so.get("include_usage"):
            last.append({"choices": [], "created": t, "id": cid, "model": o.model,
                         "system_fingerprint": FINGERPRINT, "object": "chat.completion.chunk", "usage": usage})
        last[-1]["timings"] = timings
        events.append((b"".join(b"data: " + dump(x) + b"\n\n" for x in last), False))
        events.append((b"data: [DONE]\n\n", False))
        return await self._stream(request, s, events, "text/event-stream")

    async def embeddings(self, request):
        s, err = await self._pre(request)
        if err is not None:
            return err
        body = self._body(s)
        o = self.opts
        return web.Response(body=dump({"model": o.model, "object": "list",
                                       "usage": {"prompt_tokens": o.prompt_tokens, "total_tokens": o.prompt_tokens},
                                       "data": [{"embedding": [0.25, -0.5, 0.125], "index": 0,
                                                 "object": "embedding"}]}),
                            content_type="application/json")

    # -- Ollama ------------------------------------------------------------------------------
    async def _ollama(self, request, chat: bool):
        s, err = await self._pre(request)
        if err is not None:
            return err
        body = self._body(s)
        n, o = self._n_tokens(body), self.opts
        model = body.get("model") or o.model
        created = "2026-11-29T10:00:00.000000Z"

        def line(tok, done, extra=None):
            d = {"model": model, "created_at": created}
            if chat:
                d["message"] = {"role": "assistant", "content": tok}
            else:
                d["response"] = tok
            d["done"] = done
            d.update(extra or {})
            return dump(d) + b"\n"
        final = {"done_reason": "length", "total_duration": 52_000_000, "load_duration": 1_000_000,
                 "prompt_eval_count": o.prompt_tokens, "prompt_eval_duration": 12_500_000,
                 "eval_count": n, "eval_duration": 3_000_000 * n}
        if not chat:
            final["context"] = [1, 2, 3]
        if body.get("stream") is False:
            return web.Response(body=line("tok" * n, True, final)[:-1], content_type="application/json")
        events = [(line("tok", False), True) for _ in range(n)]
        events.append((line("", True, final), False))
        return await self._stream(request, s, events, "application/x-ndjson")

    async def ollama_generate(self, request):
        return await self._ollama(request, chat=False)

    async def ollama_chat(self, request):
        return await self._ollama(request, chat=True)


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--token-delay", type=float, default=0.02)
    ap.add_argument("--first-token-delay", type=float, default=0.0, help="seconds of 'prompt processing'")
    ap.add_argument("--prompt-tokens", type=int, default=7)
    ap.add_argument("--forget", action="store_true", help="keep no record of requests (long benchmarks)")
    a = ap.parse_args()
    st = Standin(tokens=a.tokens, token_delay=a.token_delay, first_token_delay=a.first_token_delay,
                 prompt_tokens=a.prompt_tokens)
    if a.forget:
        st.seen = _Forgetful()
    web.run_app(st.app, host=a.host, port=a.port, print=None)
