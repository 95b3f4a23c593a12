"""Service benchmark: thousands of long-polling workers (raw sockets, several client processes) against
real `recycle serve` replicas on loopback: 2 replicas on one PostgreSQL, and the single-process SQLite
service, side by side.

    python -m bench.service [--pollers 10000] [--backend both|sqlite|postgres] [--replicas 2]
                            [--rounds 1] [--json OUT] [--quick]

Per back-end: starts the replicas (bench/service_cluster.py), registers the job on the first and waits
for its precompute, then per event (a fail, then a rejoin, per round):
  * every poller (spread over the replicas, `--client-procs` processes each running a selectors loop,
    bench/service_clients.py) long-polls for the next version; the time until the replicas report all
    of them parked is "connect";
  * immediate polls (answer at once, `--concurrency` in flight, alternating replicas) are timed;
  * a precomputed event is POSTed to the first replica; the time from the POST to each poller holding
    the new version is the fan-out latency; a poller that does not get it counts as an error by kind;
  * the service CPU (utime + stime from /proc of every replica's process tree, and PostgreSQL's) is
    read around each phase: per immediate poll, per long-poll (parking plus answer), per event.
Then `--extra-events` precomputed events are timed with no poller waiting. RLIMIT_NOFILE is raised to
its hard limit; if `--pollers` does not fit the limits, the ceiling and its reason are reported and
that many pollers are used. Every loop is bounded in count and time; loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from bench.service_clients import ClientPool
from bench.service_cluster import CTL, ROOT, Service, service
from bench.service_report import ceiling, summary, table


async def immediate_polls(
    bases: list[str], job_id: str, token: str, n: int, conc: int, dims: tuple[int, int]
) -> list[float]:
    """n polls that answer at once (no after_version) over `conc` keep-alive sockets, each on replica
    k % len(bases); latencies in seconds."""
    lat: list[float] = []

    async def loop(k: int) -> None:
        u = httpx.URL(bases[k % len(bases)])
        reader, writer = await asyncio.open_connection(u.host, u.port)
        for i in range(k, n, conc):
            t0 = time.perf_counter()
            target = f"/v1/jobs/{job_id}/schedule?worker={i % dims[0]},{(i // dims[0]) % dims[1]}"
            writer.write(
                f"GET {target} HTTP/1.1\r\nHost: {u.host}\r\nAuthorization: Bearer {token}\r\n\r\n".encode()
            )
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")
            )
            await reader.readexactly(length)
            lat.append(time.perf_counter() - t0)
            assert head.startswith(b"HTTP/1.1 200"), head[:40]
        writer.close()

    await asyncio.gather(*(loop(k) for k in range(conc)))
    return lat


def post_event(client: httpx.Client, base: str, job_id: str, event: dict[str, Any]) -> float:
    """POST a precomputed event; its latency in seconds."""
    t0 = time.perf_counter()
    r = client.post(f"{base}/v1/jobs/{job_id}/events", json=event, headers=CTL)
    took = time.perf_counter() - t0
    assert r.status_code == 200 and r.json()["source"] == "precomputed", r.text
    return took


def fan_out_round(
    svc: Service,
    client: httpx.Client,
    pool: ClientPool,
    job: dict[str, Any],
    args: argparse.Namespace,
    event: dict[str, Any],
) -> dict[str, Any]:
    """Park every poller, time immediate polls, post `event` to the first replica, collect the answers."""
    base, job_id, dims = svc.bases[0], job["id"], (job["D"], job["P"])
    current = client.get(f"{base}/v1/jobs/{job_id}", headers=CTL).json()["version"]
    target = f"/v1/jobs/{job_id}/schedule?worker={{d}},{{s}}&after_version={current}&wait={args.wait}"
    cpu0, t_start = svc.cpu_s(), time.perf_counter()
    pool.start_round(target, job["token"], current, args.wait + 30)
    pool.wait_sent(120)
    deadline, parked = time.monotonic() + 120, 0.0
    while time.monotonic() < deadline:  # until the replicas report every poller parked
        parked = svc.connected_pollers(client)
        if parked >= args.pollers:
            break
        time.sleep(0.1)
    connect_s = time.perf_counter() - t_start
    cpu1 = svc.cpu_s()
    coro = immediate_polls(svc.bases, job_id, job["token"], args.immediate, args.concurrency, dims)
    immediate = asyncio.run(coro)
    cpu2 = svc.cpu_s()
    t0 = time.perf_counter()
    post_s = post_event(client, base, job_id, event)
    times, errors = pool.results(args.wait + 60)
    cpu3 = svc.cpu_s()
    errors["early"] = sum(1 for _, t in times if t < t0)
    return {
        "connect_s": connect_s,
        "parked_at_post": parked,
        "fan_out": [t - t0 for _, t in times if t >= t0],
        "fan_out_by_replica": {
            port: [t - t0 for q, t in times if q == port and t >= t0] for port in svc.ports
        },
        "errors": +errors,
        "post_s": post_s,
        "immediate": immediate,
        "cpu_s": {"park": cpu1 - cpu0, "immediate": cpu2 - cpu1, "event": cpu3 - cpu2},
    }


def register(client: httpx.Client, bases: list[str], path: str, timeout: float) -> dict[str, Any]:
    """Register the job (max_failures 1, heartbeats off) and wait for its precompute."""
    spec = json.loads(Path(path).read_text())
    body = {"job": spec, "max_failures": 1, "heartbeat_enabled": False}
    base = bases[0]
    r = client.post(f"{base}/v1/jobs", json=body, headers=CTL)
    r.raise_for_status()
    job: dict[str, Any] = {"id": r.json()["id"], "token": r.json()["worker_token"], "name": spec["name"]}
    job |= {"D": int(spec["num_pipelines"]), "P": int(spec["num_stages"])}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pre = client.get(f"{base}/v1/jobs/{job['id']}", headers=CTL).json()["precompute"]
        if pre["total"] and pre["done"] >= pre["total"]:
            break
        time.sleep(0.2)
    job["precompute"] = pre
    for other in bases[1:]:  # replicas share one store: each knows the job registered on the first
        r = client.get(f"{other}/v1/jobs/{job['id']}", headers=CTL)
        if r.status_code != 200:
            raise SystemExit(
                f"replica {other} does not know job {job['id']} ({r.status_code}): no shared store"
            )
    return job


def run_backend(backend: str, replicas: int, args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()
    with service(backend, replicas) as svc, httpx.Client(timeout=60) as client:
        job = register(client, svc.bases, args.job, args.precompute_timeout)
        dims = (job["D"], job["P"])
        warm_up = immediate_polls(svc.bases, job["id"], job["token"], 200, args.concurrency, dims)
        asyncio.run(warm_up)
        addrs = [("127.0.0.1", port) for port in svc.ports]
        pool = ClientPool(addrs, args.pollers, args.client_procs, dims)
        try:
            rounds = []
            for k in range(args.rounds):
                w = [k % dims[0], (k + 1) % dims[1]]
                for kind in ("fail", "rejoin"):
                    event = {"event_id": f"bench-{k}-{kind}", "kind": kind, "workers": [w]}
                    rounds.append(fan_out_round(svc, client, pool, job, args, event))
            quiet = [  # more POST samples, to each replica in turn: no poller waiting (sockets idle)
                post_event(
                    client,
                    svc.bases[k % len(svc.bases)],
                    job["id"],
                    {"event_id": f"extra-{k}", "kind": "rejoin" if k % 2 else "fail", "workers": [[0, 1]]},
                )
                for k in range(args.extra_events)
            ]
        finally:
            pool.close()
    errors: Counter[str] = sum((Counter(r["errors"]) for r in rounds), Counter())
    cpu = {key: sum(r["cpu_s"][key] for r in rounds) for key in ("park", "immediate", "event")}
    immediate = [x for r in rounds for x in r["immediate"]]
    answered = sum(len(r["fan_out"]) for r in rounds)
    return {
        "backend": backend,
        "replicas": replicas,
        "job": job["name"],
        "precompute": job["precompute"],
        "pollers": args.pollers,
        "events": len(rounds),
        "connect_all_s": [round(r["connect_s"], 2) for r in rounds],
        "parked_at_post": [r["parked_at_post"] for r in rounds],
        "answered": answered,
        "errors": dict(errors),
        "fan_out_event_to_all_pollers": summary([x for r in rounds for x in r["fan_out"]]),
        "fan_out_by_replica": [  # the first replica takes the POST, the others hear of it from the store
            summary([x for r in rounds for x in r["fan_out_by_replica"][port]]) for port in svc.ports
        ],
        "immediate_poll": summary(immediate),
        "precomputed_event_post_with_pollers": summary([r["post_s"] for r in rounds]),
        "precomputed_event_post_no_pollers": summary(quiet),
        "service_cpu_ms": {  # every replica's process tree, and PostgreSQL's
            "per_immediate_poll": 1000 * cpu["immediate"] / max(1, len(immediate)),
            "per_long_poll": 1000 * (cpu["park"] + cpu["event"]) / max(1, answered + sum(errors.values())),
            "per_event_post_and_fan_out": 1000 * cpu["event"] / max(1, len(rounds)),
        },
        "load_average": {"before": load_before, "after": os.getloadavg()},
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench.service", description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--pollers", type=int, default=10000, help="long-pollers connected at once (<= 20000)")
    p.add_argument("--backend", choices=["both", "sqlite", "postgres"], default="both")
    p.add_argument("--replicas", type=int, default=2, help="replicas on PostgreSQL (1..4; SQLite: 1)")
    p.add_argument("--rounds", type=int, default=1, help="fail+rejoin rounds (1..20)")
    p.add_argument("--immediate", type=int, default=1000, help="immediate polls timed per event (<= 10000)")
    p.add_argument("--concurrency", type=int, default=4, help="immediate polls in flight (1..64)")
    p.add_argument("--extra-events", type=int, default=40, help="events timed with no pollers (<= 200)")
    p.add_argument("--client-procs", type=int, default=4, help="client processes (1..16)")
    p.add_argument("--wait", type=int, default=120, help="long-poll wait parameter, seconds (10..280)")
    p.add_argument("--job", default=str(ROOT / "examples" / "gpt3-1.3b-p4d4.json"))
    p.add_argument("--precompute-timeout", type=float, default=120.0, help="seconds to wait for precompute")
    p.add_argument("--json", "--out", dest="json", help="write the figures as JSON here")
    p.add_argument("--quick", action="store_true", help="smoke test: 50 pollers, tiny job, few samples")
    args = p.parse_args(argv)
    if args.quick:
        args.pollers, args.immediate, args.extra_events, args.client_procs = min(args.pollers, 50), 50, 5, 2
        args.job, args.rounds = str(ROOT / "docker" / "tiny-d2p2.json"), 1
    bounds = {"pollers": (1, 20000), "replicas": (1, 4), "rounds": (1, 20), "immediate": (1, 10000),
              "concurrency": (1, 64), "extra_events": (0, 200), "client_procs": (1, 16),
              "wait": (10, 280)}  # fmt: skip
    for name, (lo, hi) in bounds.items():
        if not lo <= getattr(args, name) <= hi:
            p.error(f"--{name.replace('_', '-')}: {getattr(args, name)} is not in {lo}..{hi}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; prints the table and JSON figures (written to --json if given)."""
    args = parse_args(argv)
    backends = ["sqlite", "postgres"] if args.backend == "both" else [args.backend]
    fewest_replicas = 1 if "sqlite" in backends else args.replicas
    limit = ceiling(args.pollers, fewest_replicas, args.client_procs)
    if not limit["fits"]:
        print(
            f"--pollers {args.pollers} does not fit: ceiling {limit['ceiling']} ({limit['bound_by']})",
            file=sys.stderr,
        )
        args.pollers = limit["ceiling"]
    results = {b: run_backend(b, 1 if b == "sqlite" else args.replicas, args) for b in backends}
    figures = {"limits": limit, "cpus": os.cpu_count(), "results": results, "table": table(results)}
    text = json.dumps(figures, indent=1)
    print(text)
    print(figures["table"])
    if args.json:
        Path(args.json).write_text(text + "\n")
    bad = sum(sum(r["errors"].values()) for r in results.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
