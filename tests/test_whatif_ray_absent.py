"""`recycle precompute` with RECYCLE_RAY_ADDRESS (or --ray) set where Ray is not installed: one line,
exit 2, the output directory untouched (Ray's absence made real in a fresh interpreter: `import ray`
fails there as it does without the package)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.jobs import uniform_job
from whatif.cache import PlanCache
from whatif.precompute import precompute

WITHOUT_RAY = (
    "import runpy, sys; sys.modules['ray'] = None; sys.argv[0] = 'recycle'; "
    "runpy.run_module('recycle_cli', run_name='__main__', alter_sys=True)"
)


@pytest.mark.timeout(60)
def test_ray_address_set_without_ray_is_one_line_exit_2(tmp_path: Path) -> None:
    job = uniform_job(2, 2, 4)
    path = tmp_path / "job.json"
    path.write_text(job.model_dump_json())
    out = tmp_path / "plans"
    precompute(job, 0, PlanCache(out), num_workers=1, progress=False)
    before = sorted(p.name for p in out.iterdir())
    for flags, env in (([], {"RECYCLE_RAY_ADDRESS": "127.0.0.1:6379"}), (["--ray", "auto"], {})):
        args = ["precompute", str(path), "--max-failures", "1", "-o", str(out), *flags]
        run = subprocess.run(
            [sys.executable, "-c", WITHOUT_RAY, *args],
            capture_output=True,
            text=True,
            timeout=50,
            env={**os.environ, **env},
        )
        assert run.returncode == 2, run.stderr
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and "Ray is not installed" in lines[0], run.stderr
    assert sorted(p.name for p in out.iterdir()) == before
