"""precompute (resumable, atomic, normalization savings) and the three commands end to end, tiny."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pytest

from planner.errors import InvalidInputError
from tests.jobs import uniform_job
from whatif.cache import PlanCache
from whatif.cli import add_whatif_parsers
from whatif.precompute import precompute

JOB = uniform_job(2, 2, 2, optimizer_ms=0.0, activation_mib=1.0, weight_grad_mib=1.0)


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="recycle")
    add_whatif_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


@pytest.fixture
def job_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.json"
    path.write_text(JOB.model_dump_json())
    return path


def test_precompute_plans_everything_once_then_nothing(tmp_path: Path) -> None:
    cache = PlanCache(tmp_path / "plans")
    first = precompute(JOB, 2, cache, num_workers=1, progress=False)
    # 1 + 4 + 6 physical sets; canonical: {}, {0}, {1}, {0,1} same pipeline, {0},{0} / {1},{1} / {0},{1}
    assert first.physical_scenarios == 1 + 4 + math.comb(4, 2)
    assert first.canonical_scenarios == 1 + 2 + 4
    assert first.planned == 7 and first.already_cached == 0
    assert first.unrecoverable == 2  # stage 0, or stage 1, failed in both pipelines
    # one file per plan (an index-<fingerprint>.json next to them lists the plans)
    files = sorted(f for f in (tmp_path / "plans").glob("*.json") if not f.name.startswith("index-"))
    assert len(files) == 7 and not list((tmp_path / "plans").glob("*.tmp"))
    second = precompute(JOB, 2, PlanCache(tmp_path / "plans"), num_workers=1, progress=False)
    assert second.planned == 0 and second.already_cached == 7
    rec = json.loads(files[0].read_text())
    assert rec["key"] == files[0].stem


def test_torn_cache_file_is_replanned(tmp_path: Path) -> None:
    cache = PlanCache(tmp_path)
    precompute(JOB, 1, cache, num_workers=1, progress=False)
    victim = sorted(f for f in tmp_path.glob("*.json") if not f.name.startswith("index-"))[0]
    victim.write_text('{"key": ')
    again = precompute(JOB, 1, PlanCache(tmp_path), num_workers=1, progress=False)
    assert again.planned == 1


def test_whatif_command_writes_table_json_and_plot(
    job_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json, out_png = tmp_path / "w.json", tmp_path / "w.png"
    code = run(
        [
            "whatif",
            str(job_file),
            "--max-failures",
            "2",
            "--workers",
            "1",
            "--json",
            str(out_json),
            "--plot",
            str(out_png),
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "recycle" in text and "bamboo" in text and "*" in text  # k=2 has unrecoverable placements
    data = json.loads(out_json.read_text())
    cell = next(c for c in data["cells"] if c["strategy"] == "recycle" and c["num_failures"] == 2)
    assert cell["fallback_share"] == pytest.approx(2 / 6)  # 2 of the 6 placements lose a whole stage
    assert out_png.stat().st_size > 1000


def test_simulate_command_generated_and_csv(
    job_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace, out_json = tmp_path / "t.csv", tmp_path / "s.json"
    args = ["simulate", str(job_file), "--mtbf", "2h", "--repair", "30m", "--duration", "1d", "--seed", "3"]
    assert (
        run(
            [
                *args,
                "--workers",
                "1",
                "--write-trace",
                str(trace),
                "--json",
                str(out_json),
                "--plot",
                str(tmp_path / "s.png"),
            ]
        )
        == 0
    )
    first = json.loads(out_json.read_text())
    assert set(first["strategies"]) >= {"recycle", "checkpoint-restart", "shrink", "oobleck", "bamboo"}
    # the written trace replays to the same figures
    assert (
        run(
            [
                "simulate",
                str(job_file),
                "--trace",
                str(trace),
                "--mtbf",
                "2h",
                "--duration",
                "1d",
                "--json",
                str(out_json),
            ]
        )
        == 0
    )
    second = json.loads(out_json.read_text())
    for name, fig in first["strategies"].items():
        assert second["strategies"][name]["samples"] == pytest.approx(fig["samples"])
    assert "recycle / oobleck" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("rows", "header"),
    [
        ("", "0 failures over 24.0 h, job MTBF above 24.00 h (no failure within --duration)"),
        ("1h,0:1,fail\n", "1 failures over 24.0 h, job MTBF 24.00 h (the trace's)"),
    ],
)
def test_a_trace_without_mtbf_says_where_the_job_mtbf_comes_from(
    job_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], rows: str, header: str
) -> None:
    # duration / failures; a trace without failures has no MTBF to measure (it was printed as 24 h)
    trace = tmp_path / "t.csv"
    trace.write_text("time,worker,event\n" + rows)
    args = ["simulate", str(job_file), "--trace", str(trace), "--duration", "1d", "--workers", "1"]
    assert run(args) == 0
    assert header in capsys.readouterr().out


def test_bad_strategy_name_is_an_input_error(job_file: Path) -> None:
    with pytest.raises(InvalidInputError, match="unknown strategy"):
        run(["whatif", str(job_file), "--strategies", "recycle,magic"])


def test_precompute_without_ray_installed(
    job_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--ray (or RECYCLE_RAY_ADDRESS) without Ray is an input error naming both, before anything is
    written; without them the local path never imports Ray (`--ray ""` overrides the variable)."""
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    out = tmp_path / "plans"
    with pytest.raises(InvalidInputError, match=r"--ray/RECYCLE_RAY_ADDRESS: Ray is not installed"):
        run(["precompute", str(job_file), "-o", str(out), "--ray", "auto"])
    monkeypatch.setenv("RECYCLE_RAY_ADDRESS", "127.0.0.1:6379")
    with pytest.raises(InvalidInputError, match="Ray is not installed"):
        run(["precompute", str(job_file), "-o", str(out)])
    assert not out.exists()
    assert run(["precompute", str(job_file), "--max-failures", "1", "-o", str(out), "--ray", ""]) == 0
    assert "planned now" in capsys.readouterr().out and PlanCache(out).index_max_failures(JOB) == 1
