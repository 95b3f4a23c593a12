"""How a replica behaves while PostgreSQL hangs: one `recycle serve --database` replica on a throw-away
server (bench/pg_cluster.py), a client polling the schedule every 20 ms (answered from memory), then
the server's processes SIGSTOPped (they keep their sockets open and answer nothing, like a hung server
or a partition behind a proxy) for --outage seconds while events are posted. Prints the worst and
median poll time during the outage, each event's answer time and status, and the load average.
`--mode stop` stops the server cleanly (pg_ctl stop -m fast) instead.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.pg_cluster import PgCluster


def server_pids(pg: PgCluster) -> list[int]:
    """The postmaster of `pg` and its children (started by this benchmark)."""
    main = int((pg.data / "postmaster.pid").read_text().split()[0])
    pids = [main]
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == main
            ):
                pids.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            pass
    return pids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.pg_stall", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["sigstop", "stop"], default="sigstop")
    parser.add_argument("--outage", type=float, default=6.0, help="seconds the server is gone (default 6)")
    args = parser.parse_args(argv)
    from tests.jobs import service_job_doc
    from tests.pg_replica import Replica, create_job, event

    with PgCluster() as pg, tempfile.TemporaryDirectory(prefix="recycle-pg-stall-") as tmp:
        replica = Replica(pg.create_database("stall"), Path(tmp) / "replica.log")
        try:
            job_id, worker = create_job(replica.base, service_job_doc(3, 2, 2))
            polls: list[tuple[float, float]] = []
            stop = threading.Event()

            def poll() -> None:
                with httpx.Client(timeout=5) as client:
                    while not stop.is_set():
                        t0 = time.monotonic()
                        with contextlib.suppress(httpx.TransportError):
                            client.get(f"{replica.base}/v1/jobs/{job_id}/schedule?worker=0,0", headers=worker)
                        polls.append((t0, time.monotonic() - t0))
                        time.sleep(0.02)

            poller = threading.Thread(target=poll)
            poller.start()
            time.sleep(1)
            start, pids = time.monotonic(), server_pids(pg)
            if args.mode == "sigstop":
                for pid in pids:
                    os.kill(pid, signal.SIGSTOP)
            else:
                pg.stop()
            events = []
            for i in range(3):
                t0 = time.monotonic()
                try:
                    status: object = event(replica.base, job_id, f"outage-{i}", "slow", [[0, 1]]).status_code
                except httpx.TransportError as exc:
                    status = type(exc).__name__
                events.append(f"{time.monotonic() - t0:.2f} s -> {status}")
                time.sleep(0.5)
            time.sleep(max(0.0, args.outage - (time.monotonic() - start)))
            if args.mode == "sigstop":
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
            else:
                pg.start()
            end = time.monotonic()
            time.sleep(2)
            stop.set()
            poller.join()
            during = sorted(took for t0, took in polls if start <= t0 <= end)
            print(f"mode {args.mode}, outage {end - start:.1f} s, load average {os.getloadavg()[0]:.2f}")
            median_ms = during[len(during) // 2] * 1000
            print(
                f"polls during the outage: {len(during)}, worst {during[-1]:.3f} s, median {median_ms:.1f} ms"
            )
            print(f"events: {'; '.join(events)}")
        finally:
            replica.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
