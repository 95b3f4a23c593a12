"""bench/pair_relaxation.py: the exact period of fixed orders, the search, the model of a job."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import pytest

from bench.pair_relaxation import Machine, Pair, build_pair, initial_orders, main, move, period, search, valid
from planner.bounds import load_bound
from planner.contract import FailureScenario
from planner.errors import InvalidInputError
from tests.jobs import uniform_job

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def replayed_period(pair: Pair, su: str, sv: str, iterations: int = 400) -> float:
    """Replay the orders for many iterations, every op as early as its constraints allow (a fixed
    point by repeated relaxation, not a topological order), and average the last half's period."""
    u, v = pair.u, pair.v
    ops = [("u", t, k) for k, t in enumerate(su)] + [("v", t, k) for k, t in enumerate(sv)]
    label: dict[tuple[str, int], int] = {}
    count: dict[str, int] = {}
    for i, (m, t, _) in enumerate(ops):
        key = t + ("v" if m == "v" else "")
        label[key, count.get(key, 0)] = i
        count[key] = count.get(key, 0) + 1
    dur = [
        {"F": mach.f, "B": mach.b, "W": mach.w}[t.upper()]
        for m, t, _ in ops
        for mach in [u if m == "u" else v]
    ]
    edges: list[tuple[int, int, float]] = []  # start[y] >= start[x] + w, same iteration
    for lo, hi in ((0, len(su)), (len(su), len(ops))):
        edges += [(k - 1, k, dur[k - 1]) for k in range(lo + 1, hi)]
    for i in range(pair.own):
        edges += [
            (label["F", i], label["Fv", i], u.f + pair.down),
            (label["Fv", i], label["Bv", i], v.f),
            (label["Bv", i], label["Wv", i], v.b),
            (label["Bv", i], label["B", i], v.b + pair.up),
            (label["B", i], label["W", i], u.b),
        ]
    for i in range(pair.extra):
        edges += [(label["f", i], label["b", i], u.f + pair.extra_trip), (label["b", i], label["w", i], u.b)]
    first_u, first_v = 0, len(su)
    starts: list[list[float]] = []
    prev: list[float] | None = None
    for _ in range(iterations):
        start = [0.0] * len(ops)
        if prev is not None:  # the wraps and the stage-0 chain from the previous iteration
            start[first_u] = prev[len(su) - 1] + dur[len(su) - 1] + u.wrap
            if pair.chain:
                bvs = [prev[label["Bv", i]] + v.b + pair.chain for i in range(pair.own)]
                start[first_u] = max([start[first_u], *bvs])
            start[first_v] = prev[-1] + dur[-1] + v.wrap
        changed = True
        while changed:
            changed = False
            for x, y, w in edges:
                if start[x] + w > start[y] + 1e-12:
                    start[y] = start[x] + w
                    changed = True
        starts.append(start)
        prev = start
    half = iterations // 2
    return (starts[-1][first_u] - starts[half][first_u]) / (iterations - 1 - half)


def random_orders(pair: Pair, rng: random.Random, moves: int = 200) -> tuple[str, str]:
    su, sv = initial_orders(pair)
    for _ in range(moves):
        on_u = rng.random() < 0.6
        order, mach = (su, pair.u) if on_u else (sv, pair.v)
        moved = move(order, rng.randrange(len(order)), rng.randrange(len(order)))
        if valid(mach, moved) and math.isfinite(period(pair, *((moved, sv) if on_u else (su, moved)))):
            su, sv = (moved, sv) if on_u else (su, moved)
    return su, sv


def small_pair(rng: random.Random, own: int, extra: int) -> Pair:
    def machine() -> Machine:
        return Machine(
            f=rng.uniform(1, 3), b=rng.uniform(1, 3), w=rng.uniform(0.5, 2), wrap=rng.uniform(0, 2),
            activation=3.0, weight_grad=1.0, capacity=rng.choice([4.0, 7.0, 10.0, math.inf]),
        )  # fmt: skip

    return Pair(
        u=machine(), v=machine(), own=own, extra=extra, down=rng.uniform(0, 3), up=rng.uniform(0, 3),
        extra_trip=rng.uniform(2, 8), chain=rng.choice([0.0, rng.uniform(1, 6)]),
    )  # fmt: skip


@pytest.mark.parametrize("seed", range(12))
def test_the_period_of_fixed_orders_is_what_a_long_replay_settles_to(seed: int) -> None:
    rng = random.Random(seed)
    pair = small_pair(rng, own=rng.randint(1, 4), extra=rng.randint(0, 2))
    su, sv = random_orders(pair, rng)
    assert period(pair, su, sv) == pytest.approx(replayed_period(pair, su, sv), abs=1e-6)


def test_orders_that_wait_on_each_other_deadlock() -> None:
    pair = Pair(Machine(1, 1, 1, 0), Machine(1, 1, 1, 0), own=2, extra=0, down=0, up=0, extra_trip=0, chain=0)
    # u runs B 0 before F 1, v runs F 1 before B 0: each waits on the other
    assert period(pair, "FBFBWW", "FFBBWW") == math.inf
    assert math.isfinite(period(pair, "FFBBWW", "FFBBWW"))


@pytest.mark.parametrize("seed", range(3))
def test_the_search_finds_the_best_of_every_order_on_a_tiny_pair(seed: int) -> None:
    rng = random.Random(100 + seed)
    pair = small_pair(rng, own=2, extra=0)
    orders_u = {"".join(p) for p in itertools.permutations("FFBBWW") if valid(pair.u, "".join(p))}
    orders_v = {"".join(p) for p in itertools.permutations("FFBBWW") if valid(pair.v, "".join(p))}
    best = min(period(pair, a, b) for a in orders_u for b in orders_v)
    found, su, sv = search(pair, seconds=10.0, seed=seed, target=best)
    assert found == pytest.approx(best) and period(pair, su, sv) == pytest.approx(best)


def test_a_job_gives_the_busiest_peer_and_its_last_stage_worker() -> None:
    job = uniform_job(4, 3, 4, capacity_mib=400.0, allreduce_ms=0.5, activation_ms=0.1, cross_pipeline_ms=0.2)
    scenario = FailureScenario(failed=[(1, 1)])
    pair, wu, wv = build_pair(job, scenario)
    assert wu[1] == 1 and wv == (wu[0], 2)
    assert (pair.own, pair.extra) == (4, 2)  # 4 micro-batches of pipeline 1 over 3 peers: 2 at most
    assert pair.down == pytest.approx(0.1) and pair.up == pytest.approx(0.1)  # adjacent stages
    assert pair.extra_trip == pytest.approx(2 + 2 * 0.2)  # F and B at stage 2, a cross hop each way
    assert pair.chain == pytest.approx(2 + 1 + 0.5 + 1 + 1 + 3 * 0.1)  # B 1..0, W, all-reduce, OPT, F 0
    lb = load_bound(job, scenario)
    busiest = (pair.own + pair.extra) * (pair.u.f + pair.u.b + pair.u.w) + pair.u.wrap
    assert busiest == pytest.approx(lb)
    su, sv = initial_orders(pair)
    assert period(pair, su, sv) >= lb - 1e-9  # u's own wrap cycle holds all its ops


def test_refuses_what_it_does_not_model(capsys: pytest.CaptureFixture[str]) -> None:
    job = uniform_job(3, 3, 2)
    with pytest.raises(InvalidInputError, match="exactly one failed worker"):
        build_pair(job, FailureScenario(failed=[(0, 1), (1, 1)]))
    with pytest.raises(InvalidInputError, match="the last stage"):
        build_pair(job, FailureScenario(failed=[(0, 2)]))
    example = str(EXAMPLES / "gpt3-6.7b-p8d4.json")
    with pytest.raises(SystemExit):
        main([example, "--failed", "x"])
    assert "--failed x: give the failed worker as D,S" in capsys.readouterr().err
    assert main([example, "--failed", "9,1"]) == 2
    assert "error: failed[0]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([example, "--failed", "1,1", "--seconds=--"])
    assert "argument --seconds: expected one argument" in capsys.readouterr().err
