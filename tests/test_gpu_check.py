"""`python -m bench.gpu_check`: the one-command end-to-end check (here on CPU, gloo)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu_check import killed_iteration, pick_backend
from runtime_adapter.summary import RECOVERED, recovery_times


def test_backend_falls_back_to_gloo_when_workers_share_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    assert pick_backend("cpu", "gloo", 4) == ("cpu", "gloo", "")
    assert pick_backend("cpu", "auto", 4)[:2] == ("cpu", "gloo")
    gpus = [1]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus[0])
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    device, backend, note = pick_backend("auto", "auto", 4)  # one GPU, four workers
    assert (device, backend) == ("cuda", "gloo") and "4 workers share each device" in note
    assert pick_backend("cuda", "nccl", 4)[1] == "gloo"
    assert pick_backend("cuda:0", "auto", 2)[:2] == ("cuda:0", "gloo")  # both on one GPU
    gpus[0] = 4
    assert pick_backend("cuda", "auto", 4)[:2] == ("cuda", "nccl")
    assert pick_backend("cuda", "gloo", 4) == ("cuda", "gloo", "")


def test_launch_output_parsing() -> None:
    text = (
        "iteration   1/5  loss 4.2701  schedule v1  alive 4/4\n"
        "worker [1, 1] died in iteration 2 (exit -9); schedule now v2\n"
        f"    worker [1, 1] died in iteration 2 (exit -9) under v1: {RECOVERED.format(0.1634)}\n"
    )
    assert killed_iteration(text, (1, 1)) == 2 and killed_iteration(text, (0, 1)) is None
    assert recovery_times(text) == [0.16]


@pytest.mark.timeout(300)
def test_cpu_end_to_end() -> None:
    cmd = [sys.executable, "-m", "bench.gpu_check", "--device", "cpu", "--iterations", "6", "--json"]
    cmd += ["--microbatches", "2", "--repeats", "1", "--pace-ms", "200"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
    res = json.loads(proc.stdout)
    for key in ("param_rel_diff", "measured_iteration_ms", "predicted_iteration_ms", "recovery_s", "backend"):
        assert res[key] is not None, key
    assert res["ok"] is True and res["reason"] == ""
    assert res["param_rel_diff"] < 1e-4
    assert res["backend"] == "gloo" and res["device"] == "cpu"
    assert res["recovery_s"] > 0
    assert res["measured_iteration_ms"] > 0 and res["predicted_iteration_ms"] > 0
    assert res["predicted_failed_iteration_ms"] >= res["predicted_iteration_ms"] * 0.5
    assert res["victim"] == [1, 1] and res["outputs"] is None
    assert "profiling" in proc.stderr


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--tolerance", "-1"], "--tolerance -1.0: a relative difference >= 0"),  # ran 23 s, then failed
        (["--pipelines", "1"], "--pipelines >= 2"),
        (["--keep", "AFILE"], "exists and is not a directory"),  # was a NotADirectoryError, exit 1
        (["--backend", "nccl", "--device", "cpu"], "--backend nccl needs a CUDA device"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(flags: list[str], says: str, tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    flags = [str(afile) if f == "AFILE" else f for f in flags]
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", *flags], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1 and says in errors[0], proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr, proc.stderr
