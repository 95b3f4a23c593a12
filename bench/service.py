"""Service benchmark: many long-polling workers against one real `recycle serve` process on loopback.

    python -m bench.service [--pollers 1000] [--rounds 3] [--job examples/gpt3-1.3b-p4d4.json]

Starts the service on 127.0.0.1 (a free port, a temporary data directory), registers the job and
waits for its precomputation, then measures:
  * immediate polls: GET schedule?worker=d,s that answer at once (latency p50/p99);
  * fan-out: `--pollers` async clients (httpx, or bare sockets with --client raw) long-poll; a
    failure event is posted; the time from posting to each poller holding the new version
    (p50/p99/max over all pollers and rounds);
  * event latency: POST of an event whose scenario was precomputed, until the new version is
    committed and answered (p50/p99);
  * the service process's CPU per immediate poll and per event (POST + fan-out to every poller),
    which, unlike the latencies, hardly moves with the machine's other load.
Every loop is bounded in count and time; the server is stopped at the end. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "bench-controller-token"
CTL = {"Authorization": f"Bearer {TOKEN}"}


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank, in milliseconds."""
    s = sorted(values)
    return 1000 * s[min(len(s) - 1, max(0, round(q / 100 * len(s)) - 1))]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50_ms": pct(values, 50),
        "p99_ms": pct(values, 99),
        "max_ms": 1000 * max(values),
        "mean_ms": 1000 * statistics.fmean(values),
    }


def server_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux /proc; 0.0 elsewhere).

    Load-independent companion of the latency figures: on a shared machine the wall-clock figures
    move with other work, the service's own CPU per request much less.
    """
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_server(data_dir: str, port: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ, RECYCLE_CONTROLLER_TOKEN=TOKEN, PYTHONPATH=str(ROOT))
    env.setdefault("RECYCLE_PRECOMPUTE_TIME_LIMIT_S", "2")
    cmd = [
        sys.executable,
        "-m",
        "api.cli",
        "--port",
        str(port),
        "--data-dir",
        data_dir,
        "--log-level",
        "warning",
        "--no-access-log",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("server exited during start-up")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server not ready within 60 s")


async def raw_get(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, target: str, auth: str
) -> tuple[bytes, bytes, float]:
    """One GET over an open keep-alive stream: (status line and headers, body, when the head arrived)."""
    writer.write(f"GET {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {auth}\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    t = time.perf_counter()
    length = next(
        int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")
    )
    return head, await reader.readexactly(length), t


async def immediate_polls(
    client: httpx.AsyncClient,
    url: str,
    worker: dict[str, str],
    n: int,
    concurrency: int,
    dims: tuple[int, int],
    raw: bool = False,
) -> list[float]:
    """n polls that answer at once (no after_version), `concurrency` in flight; latencies in seconds.

    With `raw`, each of the `concurrency` loops uses its own keep-alive socket (no client library)."""
    lat: list[float] = []
    sem = asyncio.Semaphore(concurrency)
    if raw:
        u = httpx.URL(url)

        async def loop(k: int) -> None:
            reader, writer = await asyncio.open_connection(u.host, u.port)
            for i in range(k, n, concurrency):
                t0 = time.perf_counter()
                target = f"{u.path}?worker={i % dims[0]},{(i // dims[0]) % dims[1]}"
                head, _, _ = await raw_get(reader, writer, target, worker["Authorization"])
                lat.append(time.perf_counter() - t0)
                assert head.startswith(b"HTTP/1.1 200"), head[:40]
            writer.close()

        await asyncio.gather(*(loop(k) for k in range(concurrency)))
        return lat

    async def one(i: int) -> None:
        async with sem:
            t0 = time.perf_counter()
            r = await client.get(f"{url}?worker={i % dims[0]},{(i // dims[0]) % dims[1]}", headers=worker)
            lat.append(time.perf_counter() - t0)
            assert r.status_code == 200

    await asyncio.gather(*(one(i) for i in range(n)))
    return lat


async def _poll_many(
    url: str, token: str, after: int, indices: list[int], dims: tuple[int, int], raw: bool
) -> list[float]:
    """Long-poll once per index (worker i mod grid) over small httpx clients; monotonic receive times.

    httpx scans its whole connection pool per request, so pollers are spread over clients of 20.
    """
    shards = [httpx.AsyncClient(timeout=60) for _ in range(max(1, len(indices) // 20))]
    headers = {"Authorization": f"Bearer {token}"}
    d_max, p_max = dims

    async def poll(i: int) -> float:
        params = {"worker": f"{i % d_max},{(i // d_max) % p_max}", "after_version": str(after), "wait": "30"}
        for attempt in range(3):  # a pooled connection the server closed: reconnect, as a worker would
            try:
                r = await shards[i % len(shards)].get(url, params=params, headers=headers)
                break
            except httpx.TransportError:
                if attempt == 2:
                    raise
        t = time.perf_counter()
        assert r.status_code == 200 and r.json()["version"] > after, r.status_code
        return t

    async def raw_poll(i: int) -> float:
        """The same poll over a bare asyncio stream: no client library cost in the figure."""
        u = httpx.URL(url)
        target = f"{u.path}?worker={i % d_max},{(i // d_max) % p_max}&after_version={after}&wait=30"
        reader, writer = await asyncio.open_connection(u.host, u.port)
        head, body, t = await raw_get(reader, writer, target, f"Bearer {token}")
        writer.close()
        assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["version"] > after, head[:40]
        return t

    try:
        return list(await asyncio.gather(*((raw_poll if raw else poll)(i) for i in indices)))
    finally:
        for shard in shards:
            await shard.aclose()


def poller_process(
    url: str, token: str, after: int, indices: list[int], dims: tuple[int, int], raw: bool
) -> list[float]:
    """Entry point of one client process (time.perf_counter is system-wide monotonic on Linux)."""
    return asyncio.run(_poll_many(url, token, after, indices, dims, raw))


async def fan_out_round(
    client: httpx.AsyncClient,
    pool: ProcessPoolExecutor,
    base: str,
    job_id: str,
    token: str,
    args: argparse.Namespace,
    dims: tuple[int, int],
    event: dict[str, Any],
) -> tuple[list[float], float, list[float]]:
    """Pollers (in client processes) wait for the next version while `args.immediate` immediate polls
    are timed; then post `event`; per-poller delivery latency, POST latency, immediate latencies."""
    current = (await client.get(f"{base}/v1/jobs/{job_id}", headers=CTL)).json()["version"]
    url = f"{base}/v1/jobs/{job_id}/schedule"
    loop = asyncio.get_running_loop()
    chunks = [list(range(k, args.pollers, args.client_procs)) for k in range(args.client_procs)]
    futures = [
        loop.run_in_executor(pool, poller_process, url, token, current, c, dims, args.client == "raw")
        for c in chunks
    ]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # wait until the server reports every poller connected
        text = (await client.get(f"{base}/metrics")).text
        line = next((ln for ln in text.splitlines() if ln.startswith("recycle_connected_pollers")), "x 0")
        if float(line.split()[-1]) >= args.pollers:
            break
        await asyncio.sleep(0.1)
    worker = {"Authorization": f"Bearer {token}"}
    cpu0 = server_cpu_s(args.server_pid)
    raw = args.client == "raw"
    immediate = await immediate_polls(client, url, worker, args.immediate, args.concurrency, dims, raw)
    cpu1 = server_cpu_s(args.server_pid)
    t0 = time.perf_counter()
    r = await client.post(f"{base}/v1/jobs/{job_id}/events", json=event, headers=CTL)
    post_s = time.perf_counter() - t0
    assert r.status_code == 200, r.text
    done = await asyncio.wait_for(asyncio.gather(*futures), 90)
    args.cpu["immediate_s"] += cpu1 - cpu0
    args.cpu["fan_out_s"] += server_cpu_s(args.server_pid) - cpu1
    return [t - t0 for times in done for t in times], post_s, immediate


async def run(args: argparse.Namespace, base: str) -> dict[str, Any]:
    job = json.loads(Path(args.job).read_text())
    dims = (int(job["num_pipelines"]), int(job["num_stages"]))
    pool = ProcessPoolExecutor(args.client_procs, mp_context=multiprocessing.get_context("spawn"))
    async with httpx.AsyncClient(timeout=60) as client:
        r = await client.post(
            f"{base}/v1/jobs", json={"job": job, "max_failures": 1, "heartbeat_enabled": False}, headers=CTL
        )
        r.raise_for_status()
        job_id, token = r.json()["id"], r.json()["worker_token"]
        worker = {"Authorization": f"Bearer {token}"}
        deadline = time.monotonic() + args.precompute_timeout
        while time.monotonic() < deadline:
            pre = (await client.get(f"{base}/v1/jobs/{job_id}", headers=CTL)).json()["precompute"]
            if pre["total"] and pre["done"] >= pre["total"]:
                break
            await asyncio.sleep(0.2)
        url = f"{base}/v1/jobs/{job_id}/schedule"
        await immediate_polls(client, url, worker, 200, args.concurrency, dims)  # warm-up
        fan: list[float] = []
        posts: list[float] = []
        immediate: list[float] = []
        for k in range(args.rounds):
            w = [k % dims[0], (k + 1) % dims[1]]
            for kind in ("fail", "rejoin"):
                event = {"event_id": f"bench-{k}-{kind}", "kind": kind, "workers": [w]}
                lat, post_s, imm = await fan_out_round(client, pool, base, job_id, token, args, dims, event)
                fan, immediate = fan + lat, immediate + imm
                posts.append(post_s)
        quiet: list[float] = []  # more POST samples than one per round: events with no poller waiting
        for k in range(args.extra_events):
            event = {"event_id": f"extra-{k}", "kind": "rejoin" if k % 2 else "fail", "workers": [[0, 1]]}
            t0 = time.perf_counter()
            r = await client.post(f"{base}/v1/jobs/{job_id}/events", json=event, headers=CTL)
            quiet.append(time.perf_counter() - t0)
            assert r.status_code == 200 and r.json()["source"] == "precomputed", r.text
        metrics = (await client.get(f"{base}/metrics")).text.splitlines()
        cache = [ln for ln in metrics if ln.startswith("recycle_plan_cache_total")]
    pool.shutdown()
    return {
        "job": job["name"],
        "pollers": args.pollers,
        "client": args.client,
        "client_procs": args.client_procs,
        "precompute": pre,
        "immediate_poll": summary(immediate),
        "fan_out_event_to_all_pollers": summary(fan),
        "precomputed_event_post": summary(posts),
        "precomputed_event_post_no_pollers": summary(quiet) if quiet else None,
        "server_cpu_ms": {  # of the service process (its solver pools are separate processes)
            "per_immediate_poll": 1000 * args.cpu["immediate_s"] / max(1, len(immediate)),
            "per_event_post_and_fan_out": 1000 * args.cpu["fan_out_s"] / max(1, len(posts)),
        },
        "load_average": os.getloadavg(),
        "cache": cache,
        "cpus": os.cpu_count(),
    }


def _run_loop(coro: Any, use_uvloop: bool) -> dict[str, Any]:
    if use_uvloop:
        try:
            import uvloop

            result: dict[str, Any] = uvloop.run(coro)
            return result
        except ImportError:
            pass
    return asyncio.run(coro)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; prints JSON figures (and writes them to --out if given)."""
    p = argparse.ArgumentParser(prog="bench.service", description=__doc__.splitlines()[0])
    p.add_argument("--pollers", type=int, default=1000, help="concurrent long-polling clients (<= 2000)")
    p.add_argument("--rounds", type=int, default=3, help="fail+rejoin rounds (<= 20)")
    p.add_argument("--immediate", type=int, default=500, help="immediate polls timed per event (<= 5000)")
    p.add_argument("--concurrency", type=int, default=4, help="immediate polls in flight (default 4)")
    p.add_argument("--extra-events", type=int, default=40, help="events timed with no pollers (<= 200)")
    p.add_argument("--client-procs", type=int, default=2, help="processes the pollers are spread over")
    p.add_argument("--job", default=str(ROOT / "examples" / "gpt3-1.3b-p4d4.json"))
    p.add_argument("--precompute-timeout", type=float, default=120.0, help="seconds to wait for precompute")
    p.add_argument("--out", help="write the figures as JSON here")
    p.add_argument(
        "--client",
        choices=["httpx", "raw"],
        default="httpx",
        help="clients (pollers and immediate polls): httpx, or bare asyncio sockets",
    )
    p.add_argument("--uvloop", action="store_true", help="run the clients on uvloop (if installed)")
    args = p.parse_args(argv)
    args.pollers, args.rounds, args.immediate = (
        min(args.pollers, 2000),
        min(args.rounds, 20),
        min(args.immediate, 5000),
    )
    args.extra_events = min(args.extra_events, 200)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    with tempfile.TemporaryDirectory() as data_dir:
        proc = start_server(data_dir, port)
        args.server_pid, args.cpu = proc.pid, {"immediate_s": 0.0, "fan_out_s": 0.0}
        try:
            coro = asyncio.wait_for(run(args, f"http://127.0.0.1:{port}"), 600)
            figures = _run_loop(coro, args.uvloop)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
    text = json.dumps(figures, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
