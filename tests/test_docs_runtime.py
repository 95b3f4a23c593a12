"""docs/runtime.md's example runs as written: the `bash` blocks of its "Example" section (profile,
precompute, launch, kill a worker) are run in an empty directory, so the documented commands cannot
rot. One real 2 x 2 run with torch workers: ~30 s on two idle cores."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "runtime.md"
SECTION = "## Example: profile, precompute, launch, kill a worker"


def example_commands() -> str:
    """The bash blocks of the example section, in order, as one script."""
    text = DOC.read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    section = text[start : end if end >= 0 else None]
    blocks = re.findall(r"^```bash\n(.*?)^```", section, flags=re.S | re.M)
    assert len(blocks) >= 2, "the example section lost its bash blocks"
    return "\n".join(blocks)


def test_the_example_has_the_whole_story() -> None:
    script = example_commands()
    for step in ("recycle profile", "recycle precompute", "recycle launch", "kill -9", "loss.csv"):
        assert step in script, step


@pytest.mark.timeout(240)
def test_the_documented_example_runs(tmp_path: Path) -> None:
    env = dict(
        os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    )
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", example_commands()],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: on a timeout everything it started is stopped
    )
    try:
        out, _ = proc.communicate(timeout=220)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the example did not finish within 220 s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert "worker [1, 1] died in iteration" in out and "summary: 20/20 iterations" in out, out[-3000:]
    assert "failures: 1" in out and "restores from a checkpoint: none" in out
    run = tmp_path / "run"
    assert all((run / f"final_{d}_{s}.pt").is_file() for d, s in [(0, 0), (0, 1), (1, 0)])
    rows = (run / "loss.csv").read_text().splitlines()
    assert len(rows) == 21 and "iteration  19/19  loss" in out, out[-3000:]  # a loss every iteration
    assert rows[-1].endswith(",2")  # the last iterations ran under the re-routed schedule v2
