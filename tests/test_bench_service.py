"""bench.service in its quick mode against real services: 50 raw-socket pollers in 2 client processes,
on the single-process SQLite service and (when PostgreSQL and `recycle serve --database` are there)
on 2 replicas sharing one PostgreSQL; plus its error counting and its bad options."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import service as bench
from bench.pg_cluster import find_bindir
from bench.service_clients import ClientPool
from bench.service_cluster import port_free


def check(result: dict, replicas: int) -> None:
    events = result["events"]
    assert (result["replicas"], result["pollers"], events) == (replicas, 50, 2)
    assert result["errors"] == {} and result["answered"] == 50 * events
    assert result["parked_at_post"] == [50.0] * events
    fan = result["fan_out_event_to_all_pollers"]
    assert fan["n"] == 50 * events and 0 < fan["p50_ms"] <= fan["p99_ms"] < 10_000
    assert result["immediate_poll"]["n"] == 50 * events
    assert result["precomputed_event_post_no_pollers"]["n"] == 5
    assert result["service_cpu_ms"]["per_long_poll"] > 0
    assert len(result["load_average"]["before"]) == 3


def run(tmp_path: Path, *argv: str) -> dict:
    out = tmp_path / "figures.json"
    assert bench.main(["--quick", "--json", str(out), *argv]) == 0
    figures = json.loads(out.read_text())
    assert figures["limits"]["fits"] and figures["limits"]["nofile"][0] > 1024
    return figures


@pytest.mark.timeout(60)
def test_quick_sqlite(tmp_path: Path) -> None:
    figures = run(tmp_path, "--backend", "sqlite")
    check(figures["results"]["sqlite"], 1)
    assert "| sqlite, 1 replica |" in figures["table"]


@pytest.mark.timeout(90)
@pytest.mark.skipif(find_bindir() is None, reason="no PostgreSQL binaries (initdb, pg_ctl)")
def test_quick_two_replicas_on_postgres(tmp_path: Path) -> None:
    figures = run(tmp_path, "--backend", "postgres", "--replicas", "2")
    check(figures["results"]["postgres"], 2)


@pytest.mark.timeout(30)
def test_unanswered_pollers_are_counted_not_raised() -> None:
    """Pollers against a port nobody listens on: every one counted as an error, none answered."""
    pool = ClientPool([("127.0.0.1", port_free())], pollers=20, procs=2, dims=(2, 2))
    try:
        pool.start_round("/v1/jobs/x/schedule?worker={d},{s}&after_version=1&wait=1", "t", 1, 5)
        assert pool.wait_sent(10)
        times, errors = pool.results(15)
    finally:
        pool.close()
    assert times == [] and errors == {"refused": 20}


@pytest.mark.parametrize(
    ("argv", "field"),
    [(["--pollers", "0"], "--pollers"), (["--replicas", "9"], "--replicas"), (["--wait", "1"], "--wait")],
)
def test_bad_options_exit_2_naming_the_field(
    argv: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    assert field in capsys.readouterr().err.splitlines()[-1]


def test_ceiling_names_the_limit() -> None:
    limit = bench.ceiling(10**9, 1, 1)
    assert not limit["fits"] and 0 < limit["ceiling"] < 10**9
    assert "RLIMIT_NOFILE" in limit["bound_by"] or "ip_local_port_range" in limit["bound_by"]
    assert bench.ceiling(50, 1, 2)["fits"]
