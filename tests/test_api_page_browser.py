"""The human job page in headless Chromium, driven over the DevTools protocol: the screenshot shows
the Gantt chart's bars, and a failure posted while the page is open shows up in its chart (a crossed
row, the new version) without a reload, through the page's own long-poll."""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.test_api_live import CTL, JOB, TOKEN, free_port, server

ws_client = pytest.importorskip("websockets.sync.client")

pytestmark = pytest.mark.timeout(150)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")

OP_COLORS = {
    "F": (0x4C, 0x78, 0xA8),
    "B": (0x59, 0xA1, 0x4F),
    "W": (0xF2, 0x8E, 0x2B),
    "OPT": (0x9D, 0x9D, 0x9D),
}


class Page:
    """One Chromium tab over the DevTools protocol (just the calls this test needs)."""

    def __init__(self, ws: Any) -> None:
        self.ws, self.ids = ws, itertools.count(1)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:  # skip protocol events until our answer
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == msg_id:
                assert "error" not in msg, msg
                result: dict[str, Any] = msg["result"]
                return result

    def eval(self, expression: str) -> Any:
        out = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return out["result"].get("value")

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete' && location.href === " + json.dumps(url))

    def wait_for(self, expression: str, seconds: float = 30) -> None:
        deadline = time.monotonic() + seconds
        while not self.eval(expression):
            assert time.monotonic() < deadline, f"timed out waiting for {expression}"
            time.sleep(0.2)

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))


@contextmanager
def chromium(profile: Path) -> Iterator[Page]:
    assert CHROMIUM is not None
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--remote-debugging-port=0", f"--user-data-dir={profile}", "--window-size=1200,900",
           "about:blank"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            assert proc.poll() is None and time.monotonic() < deadline, "chromium did not start"
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        with ws_client.connect(url, max_size=None, open_timeout=30) as ws:
            yield Page(ws)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def colour_pixels(png: Path, rgb: tuple[int, int, int]) -> int:
    import matplotlib.image

    pixels = (matplotlib.image.imread(png)[:, :, :3] * 255).round().astype(int)
    return int(np.all(np.abs(pixels - np.array(rgb)) <= 3, axis=2).sum())


FAILED_ROWS = "document.querySelectorAll('#live svg rect.failed-row').length"


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium installed (apt-get install chromium)")
def test_job_page_shows_gantt_and_updates_live(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with server(tmp_path / "data", port), chromium(tmp_path / "profile") as page:
        r = httpx.post(
            f"{base}/v1/jobs", json={"job": JOB, "heartbeat_enabled": False}, headers=CTL, timeout=30
        )
        job_id = r.json()["id"]
        page.goto(f"{base}/jobs/{job_id}")  # no token: 401, no chart
        assert page.eval("document.querySelectorAll('svg').length") == 0
        page.goto(f"{base}/jobs/{job_id}?token={TOKEN}")
        assert page.eval("document.getElementById('live').dataset.version") == "1"
        assert page.eval(FAILED_ROWS) == 0
        page.eval("window.notReloaded = true")
        time.sleep(0.5)  # the page's long-poll is open
        body = {"event_id": "e1", "kind": "fail", "workers": [[1, 1]]}
        assert httpx.post(f"{base}/v1/jobs/{job_id}/events", json=body, headers=CTL, timeout=30).is_success
        page.wait_for(f"{FAILED_ROWS} === 1", seconds=20)
        assert page.eval("window.notReloaded") is True  # swapped in place, not reloaded
        assert int(page.eval("document.getElementById('live').dataset.version")) >= 2
        assert "[1,1] failed" in page.eval("document.querySelector('#live svg').textContent")
        assert page.eval("document.getElementById('live-status').textContent").startswith("live: version")
        png = tmp_path / "page.png"
        page.screenshot(png)
        if os.environ.get("RECYCLE_KEEP_SCREENSHOT"):
            shutil.copy(png, os.environ["RECYCLE_KEEP_SCREENSHOT"])
    for op, rgb in OP_COLORS.items():  # every op's bars (and the legend) are painted
        hits = colour_pixels(png, rgb)
        assert hits > 200, f"{op}: only {hits} pixels of its colour"
