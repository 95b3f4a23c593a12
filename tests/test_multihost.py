"""Several hosts on one machine: the planner service and `recycle store` in namespace "ctl", three
hosts h0, h1, h2 (network namespaces on one bridge, tests/netns.py), each running one `recycle agent`
with the two workers of one pipeline of a D=3, P=2 job. Scenarios and timings:
bench/multihost_cluster.py (`run_scenario`), figures: bench/multihost.py.

Skipped with a one-line reason where `ip netns add` is not permitted (no CAP_NET_ADMIN).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.multihost_cluster import (
    EVERYONE,
    HOSTS,
    STAGE_VICTIMS,
    STORE_VICTIM,
    SURVIVORS,
    VICTIM_HOST,
    VICTIMS,
    MultiHost,
    Outcome,
)
from runtime_adapter.accounting import committed
from tests.jobs import tiny_job
from tests.netns import Netns, leftovers, namespaces, skip_unless_netns, tail
from tests.test_runtime_process import assert_exactly_once, assert_matches_reference, records

pytestmark = pytest.mark.timeout(240)  # each test; the whole file takes ~2-3 min on 2 cores

HEARTBEAT_TIMEOUT_S = 2.0
ITERATIONS = 30
# Partition -> every survivor stepped under the new version, at most: the heartbeat timeout, counted
# from the cut-off workers' last poll (at or before the cut), + the service's check period (0.2 s)
# + the event and its publication (a precomputed plan: milliseconds) + the survivors' recovery (new
# groups, agreement, rollback: 0.13-0.19 s measured on loopback in docs/runtime.md; allow 0.6 s on 2
# loaded cores) + one iteration of the tiny model (under 0.3 s with 4 workers on 2 cores) + this
# test's polling (10 ms files, 50 ms job state) = timeout + 1.5 s; doubled to 3 s so that a plan
# still being precomputed or a loaded CI machine cannot fail it, while the old behaviour (a parked
# long-poll kept a cut-off worker alive until its 30 s wait ended: ~28 s) still does. Issue 9's
# target, timeout + 1 s, is for "running the new version" (`running_s`, reported by
# bench/multihost.py, which is where the target is checked).
PARTITION_MARGIN_S = 3.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MultiHost]:
    skip_unless_netns()
    with MultiHost(tmp_path_factory.mktemp("multihost"), heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as mh:
        pid = mh.net.pid
        yield mh
    assert leftovers(pid) == [], "namespaces left behind"


def run(cluster: MultiHost, scenario: str, out: Path) -> Outcome:
    """Run a scenario; on any failure print the tails of every log, then fail."""
    with logs_on_failure(cluster, out):
        return cluster.run_scenario(scenario, out, ITERATIONS)


def dump_logs(cluster: MultiHost, out: Path) -> None:
    for path in cluster.logs(out):
        print(f"----- {path.name} (last lines) -----\n{tail(path)}")


@contextmanager
def logs_on_failure(cluster: MultiHost, out: Path) -> Iterator[None]:
    """Print the tails of every log of the run in `out` if the block fails."""
    try:
        yield
    except BaseException:
        dump_logs(cluster, out)
        raise


def never_restarted(out: Path, o: Outcome, workers: list[tuple[int, int]]) -> None:
    """One process per worker, trained to the end: the same pid as at the fault, one `done`, no
    `rejoin`, no `resume` from a restart (an in-place restore's `resume` names its version)."""
    for w in workers:
        key = f"{w[0]},{w[1]}"
        assert o.pids_after[key] == o.pids_before[key], (w, o.pids_before, o.pids_after)
        events = records(out, w)
        assert [r["event"] for r in events].count("done") == 1, (w, events)
        assert not [r for r in events if r["event"] == "rejoin"], (w, events)
        assert not [r for r in events if r["event"] == "resume" and "version" not in r], (w, events)


def agents_exited(o: Outcome, hosts: list[str]) -> None:
    """The agents of `hosts` exited 0 (their workers finished, or the job did without them)."""
    assert all(o.agent(h) == 0 for h in hosts), o.agent_codes


def test_harness_isolates_and_cleans_up() -> None:
    """Two namespaces on a bridge: they talk, the root namespace has no new interface or address, a
    downed link drops packets silently (a connect times out instead of being refused), `link_up`
    heals it, and nothing is left after `close()`."""
    skip_unless_netns()
    links_before = root_links()
    with Netns(["a", "b"]) as net:
        server = net.popen("b", [sys.executable, "-c", ECHO, net.addr("b")])
        assert net.call("a", connect, net.addr("b"), 5.0) == "ok"  # the server is up, b reachable from a
        assert root_links() == links_before, "an interface appeared in the root namespace"
        addrs = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
        assert f"{net.subnet}." not in addrs, "an address of the harness in the root namespace"
        net.link_down("b")
        assert net.call("a", connect, net.addr("b"), 1.0) == "timeout"  # silent: no refusal, no reset
        assert server.poll() is None  # no process noticed anything
        net.link_up("b")
        assert net.call("a", connect, net.addr("b"), 5.0) == "ok"
        net.kill("b")
        assert server.wait(timeout=5) == -9
        names = [net.ns("a"), net.ns("b"), net.bridge]
    assert leftovers(net.pid) == [] and not set(names) & set(namespaces())


def root_links() -> set[str]:
    """The interface names of the root namespace."""
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


ECHO = (
    "import socket, sys\n"
    "s = socket.create_server((sys.argv[1], 7000))\n"
    "while True:\n"
    "    c, _ = s.accept(); c.sendall(b'ok'); c.close()\n"
)


def connect(host: str, timeout_s: float) -> str:
    """Connect to host:7000 and read its greeting; 'timeout' or the error's name when that fails."""
    import socket
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, 7000), timeout=max(0.05, deadline - time.monotonic())) as c:
                return c.recv(16).decode()
        except TimeoutError:
            return "timeout"
        except ConnectionRefusedError:  # the server is still starting
            if time.monotonic() > deadline:
                return "refused"
            time.sleep(0.05)
        except OSError as e:
            return type(e).__name__


def test_host_crash_survivors_keep_training(cluster: MultiHost, tmp_path: Path) -> None:
    """kill -9 of every process of h2 (its agent and both workers) after 3 iterations: only the
    service's heartbeat timeout can tell; the survivors on h0 and h1 re-route without a restart and end
    with the parameters of single-process training; every micro-batch counted once; the job ends
    `finished` with exactly h2's workers failed (the survivors' silence after `done` is no failure)."""
    o = run(cluster, "crash", tmp_path)
    job = tiny_job(3, 2)
    with logs_on_failure(cluster, tmp_path):
        assert o.agent(VICTIM_HOST) == -9, o.agent_codes
        agents_exited(o, [h for h in HOSTS if h != VICTIM_HOST])
        assert sorted(o.failed_at_detection) == [list(w) for w in VICTIMS], o.failed_at_detection
        assert o.detect_s < HEARTBEAT_TIMEOUT_S + 10, f"detected after {o.detect_s:.1f} s"
        never_restarted(tmp_path, o, SURVIVORS)
        assert (o.final_state, o.final_failed) == ("finished", [list(w) for w in VICTIMS]), o
        assert_exactly_once(tmp_path, job, ITERATIONS)
        assert_matches_reference(tmp_path, job, ITERATIONS, SURVIVORS)
    print(f"host crash: detected {o.detect_s:.2f} s, survivors running v{o.fault_version} "
          f"{o.running_s:.2f} s, first step {o.step_s:.2f} s after the kill")  # fmt: skip


def test_partition_survivors_continue_then_cut_off_workers_rejoin(cluster: MultiHost, tmp_path: Path) -> None:
    """h2's link goes down mid-run (no process dies): the survivors continue under a version without
    h2. When the link comes back, the cut-off workers find themselves failed and leave (EXIT_DROPPED)
    without a traceback, and h2's agent restarts them as fresh re-joiners: they copy their state from
    a peer and train to the end. Nothing the cut-off processes did after the cut counts; every
    worker, the re-joiners too, ends with the failure-free parameters."""
    o = run(cluster, "partition", tmp_path)
    job = tiny_job(3, 2)
    with logs_on_failure(cluster, tmp_path):
        agents_exited(o, list(HOSTS))
        assert sorted(o.failed_at_detection) == [list(w) for w in VICTIMS], o.failed_at_detection
        never_restarted(tmp_path, o, SURVIVORS)
        assert (o.final_state, o.final_failed) == ("finished", []), o
        for w in VICTIMS:
            key = f"{w[0]},{w[1]}"
            assert o.pids_after[key] != o.pids_before[key], "the cut-off process should have been replaced"
            text = (tmp_path / f"worker_{w[0]}_{w[1]}.log").read_text()
            assert "Traceback" not in text, tail(tmp_path / f"worker_{w[0]}_{w[1]}.log")
            rejoins = [r for r in records(tmp_path, w) if r["event"] == "rejoin"]
            assert rejoins and all(r["version"] > o.fault_version for r in rejoins), rejoins
        # The survivors replayed from iteration k under the new version: from k on, only records of
        # that version or newer count, none of the cut-off processes' (which never ran it).
        k = min(o.resumed_from.values())
        for (_, it), recs in committed(tmp_path, job.num_pipelines, job.num_stages).items():
            if it >= k:
                assert all(r["version"] >= o.fault_version for r in recs), (it, recs)
        assert_exactly_once(tmp_path, job, ITERATIONS)
        assert_matches_reference(tmp_path, job, ITERATIONS, EVERYONE)
    print(f"partition: detected {o.detect_s:.2f} s, survivors running v{o.fault_version} "
          f"{o.running_s:.2f} s, first step {o.step_s:.2f} s after the cut; cut-off workers exited "
          f"{o.cutoff_exit_s:.2f} s and re-joined {o.rejoin_s:.2f} s after the link came back")  # fmt: skip
    limit = HEARTBEAT_TIMEOUT_S + PARTITION_MARGIN_S
    assert o.step_s < limit, (
        f"partition to every survivor stepping under the new version took {o.step_s:.1f} s "
        f"(heartbeat timeout {HEARTBEAT_TIMEOUT_S:g} s + {PARTITION_MARGIN_S:g} s = {limit:g} s)"
    )


def test_store_restart_costs_nothing_and_a_later_failure_recovers(cluster: MultiHost, tmp_path: Path) -> None:
    """kill -9 of the store mid-run: every worker keeps stepping (the store is only used to build a
    version's groups); it is restarted empty on the same port and nothing is rolled back. Then a
    worker is killed -9: its agent posts the `fail` at once (well before the heartbeat timeout could),
    and the others build the new version's groups on the restarted store and finish with the
    failure-free parameters."""
    o = run(cluster, "store", tmp_path)
    job = tiny_job(3, 2)
    others = [w for w in EVERYONE if w != STORE_VICTIM]
    with logs_on_failure(cluster, tmp_path):
        agents_exited(o, list(HOSTS))
        assert o.steps_without_store is not None and o.steps_without_store >= 2, o
        assert o.lost_iterations == 0, f"{o.lost_iterations} iterations rolled back by the store's restart"
        assert o.failed_at_detection == [list(STORE_VICTIM)], o.failed_at_detection
        assert o.detect_s < HEARTBEAT_TIMEOUT_S, f"the fail came after {o.detect_s:.2f} s: not from the agent"
        never_restarted(tmp_path, o, others)
        assert (o.final_state, o.final_failed) == ("finished", [list(STORE_VICTIM)]), o
        assert_exactly_once(tmp_path, job, ITERATIONS)
        assert_matches_reference(tmp_path, job, ITERATIONS, others)
    print(f"store restart: {o.steps_without_store} steps without it, {o.lost_iterations} iterations lost; "
          f"worker kill detected {o.detect_s:.2f} s, others running v{o.fault_version} "
          f"{o.running_s:.2f} s after it")  # fmt: skip


def test_stage_lost_across_hosts_is_restored_from_the_shared_checkpoint(
    cluster: MultiHost, tmp_path: Path
) -> None:
    """kill -9 of worker [d, 1] on every host (stage 1 lost; the agents live): the agents post the
    fails, the service restores at once from the newest checkpoint every stage reported, the agents
    restart their dead workers with it and the stage-0 workers load it in place (same processes).
    Every worker ends with the failure-free parameters; every micro-batch counted once."""
    o = run(cluster, "stage", tmp_path)
    job = tiny_job(3, 2)
    with logs_on_failure(cluster, tmp_path):
        agents_exited(o, list(HOSTS))
        assert o.restore is not None and o.restore["epoch"] == 1, o.restore
        assert o.restore["iteration"] is not None and o.restore["iteration"] >= 2, o.restore
        never_restarted(tmp_path, o, [w for w in EVERYONE if w not in STAGE_VICTIMS])
        for w in STAGE_VICTIMS:
            key = f"{w[0]},{w[1]}"
            assert o.pids_after[key] != o.pids_before[key], (w, "was not restarted")
        assert (o.final_state, o.final_failed) == ("finished", []), o
        assert_exactly_once(tmp_path, job, ITERATIONS)
        assert_matches_reference(tmp_path, job, ITERATIONS, EVERYONE)
    print(f"stage lost: restore {o.restore} seen {o.detect_s:.2f} s after the kills, every worker "
          f"running it {o.running_s:.2f} s, stepping {o.step_s:.2f} s")  # fmt: skip
