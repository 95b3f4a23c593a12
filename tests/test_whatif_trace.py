"""Trace parsing (errors name the line), the seeded generator, and normalized scenario counts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.contract import JobSpec
from tests.jobs import uniform_job
from whatif.scenarios import canonical_scenarios, count_canonical, sample_scenarios
from whatif.trace import FAIL, REJOIN, TraceError, generate_trace, parse_duration, read_trace, write_trace


def job(d: int = 2, p: int = 3) -> JobSpec:
    return uniform_job(d, p, 2, optimizer_ms=0.0, activation_mib=1.0, weight_grad_mib=1.0, name="t")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(text)
    return path


def test_reads_a_good_trace_with_units_aliases_and_unsorted_rows(tmp_path: Path) -> None:
    path = write(tmp_path, 'time,worker,event\n2h,1:2,repair\n# comment\n\n60m,1:2,fail\n30,"0,1",down\n')
    events = read_trace(path, job())
    assert [(e.time_s, e.worker, e.kind, e.line) for e in events] == [
        (30.0, (0, 1), FAIL, 6),
        (3600.0, (1, 2), FAIL, 5),
        (7200.0, (1, 2), REJOIN, 2),
    ]


@pytest.mark.parametrize(
    ("body", "line", "words"),
    [
        ("10,0:1,fail\n20,0:1,explode\n", 2, "unknown event"),
        ("10,0:1,fail\nsoon,0:1,rejoin\n", 2, "bad time"),
        ("10,0:1,fail\n20,x,fail\n", 2, "bad worker"),
        ("10,0:1,fail\n20,5:0,fail\n", 2, "outside the job's grid"),
        ("10,0:1,fail\n20,0:1\n", 2, "expected 3 fields"),
        ("10,0:1,fail\n20,0:1,fail\n", 2, "already down"),
        ("10,0:1,fail\n20,0:2,rejoin\n", 2, "not down"),
    ],
)
def test_bad_rows_name_the_line(tmp_path: Path, body: str, line: int, words: str) -> None:
    path = write(tmp_path, "time,worker,event\n" + body)
    with pytest.raises(TraceError) as err:
        read_trace(path, job())
    assert f"line {line + 1}" in str(err.value) and words in str(err.value)


def test_missing_file_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(tmp_path / "nope.csv", job())


def test_parse_duration_units() -> None:
    assert parse_duration("7d") == 7 * 86400
    assert parse_duration("1.5", "h") == 5400
    with pytest.raises(ValueError):
        parse_duration("6 hours")
    with pytest.raises(ValueError, match=r"'1e400' \(too large\)"):  # a float that overflows to inf
        parse_duration("1e400")


def test_generator_is_deterministic_per_seed_and_round_trips(tmp_path: Path) -> None:
    j = job()
    a = generate_trace(j, mtbf_s=3600, repair_s=600, duration_s=86400, seed=7)
    b = generate_trace(j, mtbf_s=3600, repair_s=600, duration_s=86400, seed=7)
    c = generate_trace(j, mtbf_s=3600, repair_s=600, duration_s=86400, seed=8)
    assert a == b and a != c
    assert 6 * 24 * 0.5 < sum(e.kind == FAIL for e in a) < 6 * 24 * 1.5  # ~ workers * duration / mtbf
    path = tmp_path / "gen.csv"
    write_trace(a, path)
    back = read_trace(path, j)
    assert [(round(e.time_s, 3), e.worker, e.kind) for e in back] == [
        (round(e.time_s, 3), e.worker, e.kind) for e in a
    ]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), mtbf=st.floats(100, 10_000), repair=st.floats(0, 5_000))
def test_generated_traces_alternate_fail_and_rejoin_per_worker(seed: int, mtbf: float, repair: float) -> None:
    events = generate_trace(job(), mtbf, repair, 20_000, seed)
    last: dict[tuple[int, int], str] = {}
    for e in events:
        assert last.get(e.worker, REJOIN) != e.kind
        last[e.worker] = e.kind
    assert all(0 <= e.time_s < 20_000 for e in events)


@pytest.mark.parametrize(("d", "p", "k"), [(2, 3, 2), (3, 2, 3), (4, 4, 2), (2, 2, 4)])
def test_canonical_placements_cover_every_physical_failure_set(d: int, p: int, k: int) -> None:
    j = job(d, p)
    scenarios = list(canonical_scenarios(j, k))
    assert len(scenarios) == count_canonical(j, k) == len({c.key for c in scenarios})
    assert sum(c.placements for c in scenarios) == math.comb(d * p, k)


def test_sampled_scenarios_are_seeded() -> None:
    j = job(4, 4)
    assert [c.key for c in sample_scenarios(j, 2, 10, 3)] == [c.key for c in sample_scenarios(j, 2, 10, 3)]
