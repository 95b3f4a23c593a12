"""The Hugging Face example end to end, as a user runs it: profile the transformers GPT-2 through
`--entry`, precompute the plans, launch 2 x 2 workers, kill -9 one after its first step. The loss
goes down, loss.png is drawn with the failure marked, and the survivors' final parameters equal
single-process training of the same Training (dropout, AdamW, global-norm clipping, warm-up)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from runtime_adapter.entry import load_entry
from runtime_adapter.reference import relative_error, train_reference

ROOT = Path(__file__).resolve().parent.parent
ENTRY = "examples.hf_gpt2:training"
MODEL = {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq_len": 32, "microbatch_size": 4, "clip": 1.0,
         "clip_scope": "global"}  # fmt: skip
ITERATIONS = 12
TOL = 1e-6  # float64 gradient sums (grad_sum.py): in practice bitwise equal


def recycle(*args: str) -> list[str]:
    return [sys.executable, "-m", "recycle_cli", *args]


@pytest.mark.timeout(420)
def test_hf_gpt2_trains_and_survives_a_kill(tmp_path: Path) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    model = json.dumps(MODEL)
    job, plans, run = tmp_path / "job.json", tmp_path / "plans", tmp_path / "run"
    common = ["--entry", ENTRY, "--model", model]
    grid = ["--stages", "2", "--pipelines", "2", "--microbatches", "2", "--repeats", "1"]
    for args in (["profile", *grid, *common, "-o", str(job)], ["precompute", str(job), "-o", str(plans)]):
        subprocess.run(recycle(*args), cwd=ROOT, env=env, check=True, timeout=180, stdout=subprocess.DEVNULL)
    launch_args = ["launch", "--job", str(job), "--schedules", str(plans), "--out", str(run)]
    launch_args += ["--iterations", str(ITERATIONS), "--pace-ms", "300", *common]
    launch = subprocess.Popen(
        recycle(*launch_args), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 240
        acct = run / "acct_1_1.jsonl"
        while not (acct.exists() and '"step"' in acct.read_text()):
            assert launch.poll() is None and time.monotonic() < deadline, "worker [1, 1] never stepped"
            time.sleep(0.2)
        os.kill(int((run / "worker_1_1.pid").read_text()), signal.SIGKILL)
        output, _ = launch.communicate(timeout=300)
    finally:
        if launch.poll() is None:
            launch.kill()
    assert launch.returncode == 0, output
    assert "worker [1, 1] died" in output, output
    rows = [line.split(",") for line in (run / "loss.csv").read_text().splitlines()[1:]]
    losses = {int(it): float(loss) for it, loss, _ in rows}
    assert sorted(losses) == list(range(ITERATIONS)), losses
    assert losses[ITERATIONS - 1] < losses[0] - 1.0, losses  # from ~ln(256) = 5.5
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    torch.set_num_threads(1)
    ref = train_reference(load_entry(ENTRY, MODEL), 2, 2, 2, ITERATIONS)
    for d, s in [(0, 0), (1, 0), (0, 1)]:
        err = relative_error(torch.load(run / f"final_{d}_{s}.pt"), ref[s])
        assert err < TOL, f"worker [{d}, {s}]: relative error {err:.2e} vs single-process training"
