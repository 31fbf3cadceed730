"""A real Prometheus server (the Debian `prometheus` binary) that scrapes exporters on this host every
second, and its query API: what a user's Prometheus does with the census's endpoint and the dashboards'
queries."""
from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

from ports import free_port


class Prometheus:
    """A Prometheus (its config and storage in tmp_path) scraping {job name: port on 127.0.0.1}."""

    def __init__(self, tmp_path, jobs: dict):
        self.port = free_port()
        cfg = tmp_path / "prometheus.yml"
        cfg.write_text("global:\n  scrape_interval: 1s\nscrape_configs:\n" + "".join(
            f"  - job_name: {job}\n    static_configs:\n      - targets: ['127.0.0.1:{port}']\n"
            for job, port in jobs.items()))
        self.proc = subprocess.Popen(["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def query(self, expr: str) -> dict:
        """The API's answer to an instant query (a bad query's too: a 400 with the reason in the body)."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            return json.loads(urllib.request.urlopen(url, timeout=5).read())
        except urllib.error.HTTPError as e:
            return json.loads(e.read())

    def wait_until(self, ready, failure: str, timeout: float = 60.0) -> None:
        """Until ready() is true (an OSError from it counts as not yet); the server must stay up."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.proc.stderr.read()
            try:
                if ready():
                    return
            except OSError:
                pass
            assert time.monotonic() < deadline, failure
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
