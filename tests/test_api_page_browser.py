"""The human job page rendered by headless Chromium: the screenshot shows the Gantt chart's bars."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.test_api_live import CTL, JOB, TOKEN, free_port, server

pytestmark = pytest.mark.timeout(120)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")

OP_COLORS = {
    "F": (0x4C, 0x78, 0xA8),
    "B": (0x59, 0xA1, 0x4F),
    "W": (0xF2, 0x8E, 0x2B),
    "OPT": (0x9D, 0x9D, 0x9D),
}


def screenshot(url: str, out: Path) -> None:
    assert CHROMIUM is not None
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           f"--screenshot={out}", "--window-size=1200,900", url]  # fmt: skip
    subprocess.run(cmd, capture_output=True, timeout=60, check=True)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium installed (apt-get install chromium)")
def test_job_page_screenshot_shows_gantt(tmp_path: Path) -> None:
    import matplotlib.image

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with server(tmp_path / "data", port):
        r = httpx.post(
            f"{base}/v1/jobs", json={"job": JOB, "heartbeat_enabled": False}, headers=CTL, timeout=30
        )
        job_id = r.json()["id"]
        body = {"event_id": "e1", "kind": "fail", "workers": [[1, 1]]}
        assert (
            httpx.post(f"{base}/v1/jobs/{job_id}/events", json=body, headers=CTL, timeout=30).status_code
            == 200
        )
        png = tmp_path / "page.png"
        screenshot(f"{base}/jobs/{job_id}?token={TOKEN}", png)
        denied = tmp_path / "denied.png"
        screenshot(f"{base}/jobs/{job_id}", denied)
    pixels = (matplotlib.image.imread(png)[:, :, :3] * 255).round().astype(int)
    for op, rgb in OP_COLORS.items():  # every op's bars (and the legend) are painted
        hits = int(np.all(np.abs(pixels - np.array(rgb)) <= 3, axis=2).sum())
        assert hits > 200, f"{op}: only {hits} pixels of its colour"
    blank = (matplotlib.image.imread(denied)[:, :, :3] * 255).round().astype(int)
    assert int(np.all(np.abs(blank - np.array(OP_COLORS["F"])) <= 3, axis=2).sum()) == 0  # 401: no chart
