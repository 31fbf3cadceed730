"""A screenshot of a web page by headless Chromium (Debian's `chromium`), driven over the DevTools
protocol so that a tab can be clicked first (`--screenshot` alone can only take the page as it loads).

    png = shoot("http://127.0.0.1:6006/redirects/spans/ab12...", Path("out.png"), click="Attributes",
                wait_for="gpu_census.copy.dtoh.bytes")
"""
from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

import aiohttp

from ports import free_port

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars")

# Click the first tab (or else button) whose text is exactly `text`; true when one was found.
_CLICK = """(text => {
  const els = [...document.querySelectorAll('[role=tab]'), ...document.querySelectorAll('button')];
  const el = els.find(e => e.textContent.trim() === text);
  if (el) { el.click(); return true; } return false; })(%s)"""


def shoot(url: str, out: Path, width: int = 1600, height: int = 1000, click: Optional[str] = None,
          wait_for: Optional[str] = None, timeout: float = 60.0) -> Path:
    chromium = shutil.which("chromium")
    if not chromium:
        raise RuntimeError("no chromium (Debian: apt-get install -y chromium)")
    port = free_port()
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.Popen([chromium, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}",
                                 "--remote-debugging-address=127.0.0.1", f"--remote-debugging-port={port}",
                                 "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            png = asyncio.run(_drive(port, url, width, height, click, wait_for, timeout))
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(png)
    return out


async def _drive(port, url, width, height, click, wait_for, timeout) -> bytes:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        ws_url = None
        while ws_url is None:
            try:
                async with http.get(f"http://127.0.0.1:{port}/json/list") as r:
                    ws_url = next(t["webSocketDebuggerUrl"] for t in await r.json() if t["type"] == "page")
            except (aiohttp.ClientError, StopIteration):
                if time.monotonic() > deadline:
                    raise RuntimeError("chromium's DevTools port did not answer")
                await asyncio.sleep(0.2)
        async with http.ws_connect(ws_url, max_msg_size=64 << 20) as ws:
            ids = iter(range(1, 1 << 30))

            async def call(method, **params):
                i = next(ids)
                await ws.send_str(json.dumps({"id": i, "method": method, "params": params}))
                while True:
                    msg = json.loads((await ws.receive(timeout=max(1.0, deadline - time.monotonic()))).data)
                    if msg.get("id") == i:
                        if "error" in msg:
                            raise RuntimeError(f"{method}: {msg['error']}")
                        return msg.get("result", {})

            async def page_has(text) -> bool:
                r = await call("Runtime.evaluate", expression=f"document.body.innerText.includes({json.dumps(text)})",
                               returnByValue=True)
                return bool(r.get("result", {}).get("value"))

            await call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                       mobile=False)
            await call("Page.navigate", url=url)
            clicked = click is None
            while True:
                if not clicked:
                    r = await call("Runtime.evaluate", expression=_CLICK % json.dumps(click), returnByValue=True)
                    clicked = bool(r.get("result", {}).get("value"))
                if clicked and (wait_for is None or await page_has(wait_for)):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the page never showed {click if not clicked else wait_for!r}")
                await asyncio.sleep(0.3)
            await asyncio.sleep(1.0)               # let the last paint settle
            shot = await call("Page.captureScreenshot", format="png")
            return base64.b64decode(shot["data"])
