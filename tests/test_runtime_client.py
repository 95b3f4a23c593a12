"""The worker's schedule client and the launcher's service publisher against stub HTTP servers
(in-process, no planner service): keep-alive, answers to each status, jittered backoff, the
registration's Idempotency-Key, the service's wait cap, and a worker's `done`."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from runtime_adapter.backoff import Backoff
from runtime_adapter.client import (
    BASE_BACKOFF_S,
    HttpScheduleSource,
    ScheduleClient,
    SourceRejected,
    SourceUnavailable,
)
from runtime_adapter.publishers import ServicePublisher
from tests.jobs import tiny_job
from tests.test_api_live import free_port

pytestmark = pytest.mark.timeout(60)

VIEW = {"version": 2, "worker": [0, 1], "routes": [], "actions": [], "stage_alive": [[0, 1]], "failed": []}

Answer = tuple[int, dict[str, Any] | bytes | None]


class Stub(ThreadingHTTPServer):
    """HTTP/1.1 server: `answer(handler)` gives (status, body); body None closes the connection
    without an answer. Counts accepted connections and keeps every request's headers."""

    daemon_threads = True

    def __init__(self, answer: Callable[[BaseHTTPRequestHandler], Answer]) -> None:
        self.answer, self.connections = answer, 0
        self.headers: dict[str, str] = {}  # sent with every answer
        self.requests: list[tuple[str, str, dict[str, str], bytes]] = []
        super().__init__(("127.0.0.1", 0), Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Stub

    def setup(self) -> None:
        super().setup()
        self.server.connections += 1  # once per accepted connection, however many requests it carries

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _serve(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.requests.append((self.command, self.path, dict(self.headers), body))
        status, answer = self.server.answer(self)
        if answer is None:
            self.close_connection = True  # the request was taken, the answer is lost
            return
        data = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
        self.send_response(status)
        for name, value in self.server.headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PATCH = _serve


@contextmanager
def stub(answer: Callable[[BaseHTTPRequestHandler], Answer]) -> Iterator[Stub]:
    server = Stub(answer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def source(url: str) -> HttpScheduleSource:
    return HttpScheduleSource(url, "job1", "tok", (0, 1), 2, 2, 4)


def test_polls_reuse_one_connection() -> None:
    with stub(lambda h: (304, b"") if "after_version=2" in h.path else (200, VIEW)) as server:
        src = source(server.url)
        a = src.fetch(0, timedelta(seconds=1))
        assert a is not None and a.version == 2 and a.worker == (0, 1)
        for _ in range(5):
            assert src.fetch(2, timedelta(seconds=1)) is None  # 304
        assert server.connections == 1, "every poll opened a new connection"
        method, path, headers, _ = server.requests[-1]
        assert method == "GET" and path.startswith("/v1/jobs/job1/schedule?worker=0,1&after_version=2")
        assert headers["Authorization"] == "Bearer tok" and headers["If-None-Match"] == '"2"'
        src.close()


@pytest.mark.parametrize(
    ("status", "body", "error"),
    [
        (401, {"detail": "bad token"}, SourceRejected),
        (403, {"detail": "other job"}, SourceRejected),
        (404, {"detail": "no such job"}, SourceRejected),
        (422, {}, SourceRejected),
        (408, {}, SourceUnavailable),
        (429, {}, SourceUnavailable),
        (500, {}, SourceUnavailable),
        (503, b"not json", SourceUnavailable),
        (200, b"not json", SourceUnavailable),
    ],
)
def test_answers(status: int, body: dict[str, Any] | bytes, error: type[Exception]) -> None:
    match = str(status) if status != 200 else "Expecting value"
    with stub(lambda h: (status, body)) as server, pytest.raises(error, match=match):
        source(server.url).fetch(0, timedelta(seconds=1))


def test_unreachable_and_lost_answers_are_retried() -> None:
    with pytest.raises(SourceUnavailable):
        source(f"http://127.0.0.1:{free_port()}").fetch(0, timedelta(seconds=1))  # connection refused
    with stub(lambda h: (200, None)) as server, pytest.raises(SourceUnavailable):
        source(server.url).fetch(0, timedelta(seconds=1))  # closed without an answer


def test_backoff_full_jitter_is_bounded_and_differs_between_clients() -> None:
    a, b = Backoff(0.05, 2.0, random.Random(1)), Backoff(0.05, 2.0, random.Random(2))
    ceilings = [min(2.0, 0.05 * 2**n) for n in range(12)]
    da = [a.next() for _ in range(12)]
    db = [b.next() for _ in range(12)]
    assert all(0 <= d <= c for d, c in zip(da + db, ceilings + ceilings, strict=True))
    assert da != db and len(set(da)) == 12  # no lockstep, no constant delay
    assert [Backoff(0.05, 2.0, random.Random(1)).next() for _ in range(1)] == da[:1]  # seeded: replayable
    samples = [Backoff(0.05, 2.0, random.Random(s)) for s in range(400)]
    capped = [bo.next() for bo in samples for _ in range(7)][6::7]  # the 7th delay: ceiling = the cap
    assert 0.8 < sum(capped) / len(capped) < 1.2  # uniform on [0, 2]: mean 1
    assert max(capped) > 1.8 and min(capped) < 0.2
    a.reset()
    assert a.ceiling() == 0.05


class Unreachable:
    def fetch(self, after_version: int, wait: timedelta) -> None:
        raise SourceUnavailable("down")


def client_delays(seed: int, n: int = 8) -> list[float]:
    """The waits of a ScheduleClient whose source is down, without waiting them."""
    client = ScheduleClient(Unreachable(), max_backoff=timedelta(seconds=0.4), rng=random.Random(seed))
    delays: list[float] = []

    class Recorder(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            delays.append(float(timeout or 0))
            if len(delays) >= n:
                self.set()
            return self.is_set()

    client._stop = Recorder()
    client._loop()
    return delays


def test_schedule_client_backoff_is_jittered() -> None:
    d1, d2 = client_delays(1), client_delays(2)
    ceilings = [min(0.4, BASE_BACKOFF_S * 2**n) for n in range(8)]
    assert all(0 <= d <= c for d, c in zip(d1 + d2, ceilings + ceilings, strict=True)), (d1, d2)
    assert d1 != d2 and d1 == client_delays(1)


def test_registration_retry_reuses_its_idempotency_key() -> None:
    """The first POST /v1/jobs is taken but its answer is lost: the retry carries the same key."""
    posts: list[str] = []

    def answer(h: BaseHTTPRequestHandler) -> Answer:
        if h.command != "POST":  # the version follower's long-poll, started once registered
            return 304, b""
        posts.append(h.headers.get("Idempotency-Key", ""))
        if len(posts) == 1:
            return 201, None
        return 201, {"id": "job-1", "worker_token": "wt", "version": 1}

    with stub(answer) as server:
        pub = ServicePublisher(server.url, "ctl", tiny_job(2, 2), timeout_s=10, rng=random.Random(0))
        assert pub.job_id is None
        pub.start()
        assert pub.job_id == "job-1" and pub.worker_token == "wt"
        assert len(posts) == 2 and posts[0] == posts[1] and len(posts[0]) >= 16
        other = ServicePublisher(server.url, "ctl", tiny_job(2, 2), timeout_s=10)
        other.start()
        assert posts[2] != posts[0]  # a new registration, a new key


def test_outbox_waits_a_jittered_delay_between_attempts() -> None:
    events: list[str] = []
    down = [True]

    def answer(h: BaseHTTPRequestHandler) -> Answer:
        events.append(h.path)
        if down[0]:
            return 503, {"detail": "restarting"}
        return 200, {"version": 2}

    with stub(answer) as server:
        pub = ServicePublisher(server.url, "ctl", tiny_job(2, 2), job_id="j", worker_token="w")
        assert pub.report("fail", [(1, 1)]).version is None and len(events) == 1
        assert 0 <= pub.retry_at - time.monotonic() <= 0.1  # the first ceiling
        down[0] = False
        while time.monotonic() < pub.retry_at:
            assert pub.flush() == [] and len(events) == 1  # not before its time
            time.sleep(0.005)
        assert pub.flush() == [] and not pub.outbox and len(events) == 2 and pub.version == 2


def test_client_asks_for_no_longer_a_wait_than_the_service_grants() -> None:
    """The service caps a heartbeat poll's wait (a third of the heartbeat timeout) and says so in
    Recycle-Poll-Wait-Max: from the next poll on, the client asks for no more than that."""
    with stub(lambda h: (304, b"")) as server:
        src = source(server.url)
        assert src.fetch(0, timedelta(seconds=30)) is None
        server.headers = {"Recycle-Poll-Wait-Max": "0.5"}
        assert src.fetch(0, timedelta(seconds=30)) is None  # still asked for 30: it had not heard yet
        assert src.fetch(0, timedelta(seconds=30)) is None
        assert src.fetch(0, timedelta(seconds=0.2)) is None  # a shorter wait stays as asked
        server.headers = {"Recycle-Poll-Wait-Max": "nonsense"}  # ignored: the cap it knows stays
        assert src.fetch(0, timedelta(seconds=30)) is None
        assert src.fetch(0, timedelta(seconds=30)) is None
        waits = [p.split("&wait=")[1] for _, p, _, _ in server.requests]
        assert waits == ["30", "30", "0.5", "0.2", "0.5", "0.5"], waits
        src.close()


def test_done_posts_one_event_retried_with_the_same_id() -> None:
    """A worker that completed tells the service with a `done` event (its worker token), retried with
    the same event_id while the service answers 503, then stops."""
    answers: list[Answer] = [(503, {"detail": "restarting"}), (200, {"version": 3, "state": "finished"})]

    def answer(h: BaseHTTPRequestHandler) -> Answer:
        return answers.pop(0)

    with stub(answer) as server:
        assert source(server.url).done(deadline_s=10) is True
    posts = [(m, p, h, json.loads(b)) for m, p, h, b in server.requests]
    assert [(m, p) for m, p, _, _ in posts] == [("POST", "/v1/jobs/job1/events")] * 2
    assert all(h["Authorization"] == "Bearer tok" for _, _, h, _ in posts)
    first, second = posts[0][3], posts[1][3]
    assert first == second and first["kind"] == "done" and first["workers"] == [[0, 1]]
    assert first["event_id"].startswith("done-0-1-")


def test_done_gives_up_on_a_refusal_and_after_its_deadline() -> None:
    with stub(lambda h: (409, {"detail": "failed", "error": "worker_failed"})) as server:
        t0 = time.monotonic()
        assert source(server.url).done(deadline_s=10) is False
        assert time.monotonic() - t0 < 2 and len(server.requests) == 1  # a 4xx is not retried
    t0 = time.monotonic()
    assert source(f"http://127.0.0.1:{free_port()}").done(deadline_s=0.5) is False
    assert time.monotonic() - t0 < 3


def test_schedule_client_done_stops_polling_and_tells_the_source() -> None:
    calls: list[str] = []

    class Source:
        def fetch(self, after_version: int, wait: timedelta) -> None:
            calls.append("fetch")
            time.sleep(0.01)

        def done(self) -> bool:
            calls.append("done")
            return True

    client = ScheduleClient(Source()).start()
    while "fetch" not in calls:
        time.sleep(0.005)
    assert client.done() is True
    client._thread.join(timeout=5)
    assert not client._thread.is_alive() and calls.count("done") == 1
    assert calls.index("done") >= len(calls) - 2  # at most the poll already under way came after it
    assert ScheduleClient(Unreachable()).done() is True  # a source without done(): nothing to tell


def test_service_publisher_finish_keeps_the_heartbeat_and_drops_events_of_a_finished_job() -> None:
    """finish() only delivers the outbox (no PATCH turning the heartbeat off); an event the service
    refuses because the job is finished (409 job_finished) is dropped, not an error."""
    seen: list[tuple[str, str]] = []

    def answer(h: BaseHTTPRequestHandler) -> Answer:
        seen.append((h.command, h.path))
        return 409, {"detail": "finished", "error": "job_finished"}

    with stub(answer) as server:
        pub = ServicePublisher(server.url, "ctl", tiny_job(2, 2), job_id="j", worker_token="w")
        pub.version = 5
        outcome = pub.report("fail", [(1, 1)], "process exited")
        assert outcome.version == 5 and outcome.lost_stages == [] and not pub.outbox
        pub.finish()
    assert seen == [("POST", "/v1/jobs/j/events")]


def view_doc(**extra: Any) -> dict[str, Any]:
    """A service worker view of [0, 1] (D=2, P=2, M=1) with the restore protocol's fields in `extra`."""
    return {
        "version": 4, "state": "running", "worker": [0, 1], "alive": True, "failed": [],
        "stage_alive": [[0, 1], [1, 1]], "routes": [{"mb": [0, 0], "prev_host": [0, 0], "next_host": None}],
        "actions": [{"op": "F", "mb": [0, 0]}, {"op": "BW", "mb": [0, 0]}, {"op": "OPT"}], **extra,
    }  # fmt: skip


def test_restore_fields_of_a_worker_view_and_of_a_schedule_file(tmp_path: Any) -> None:
    from planner.contract import FailureScenario
    from planner.plan import plan
    from runtime_adapter.assignment import RestorePoint, assignment_from_view
    from runtime_adapter.client import FileScheduleSource

    a = assignment_from_view(view_doc(), 2, 2, 1)  # an older service: none of them
    assert (a.restore, a.restore_policy, a.joined_at) == (None, "manual", None)
    doc = view_doc(restore={"epoch": 2, "iteration": None}, restore_policy="auto", joined_at=4)
    a = assignment_from_view(doc, 2, 2, 1)
    assert (a.restore, a.restore_policy, a.joined_at) == (RestorePoint(2, None), "auto", 4)
    job = tiny_job(2, 2, 1)
    schedule = plan(job, FailureScenario(failed=[(1, 1)]), use_cpsat=False).schedule
    path = tmp_path / "schedule.json"
    path.write_text(json.dumps({
        "version": 3, "state": "running", "restore": {"epoch": 1, "iteration": 6},
        "joined_at": {"0,0": 3, "0,1": 3, "1,0": 3},
        "schedule": json.loads(schedule.model_dump_json(exclude_none=True)),
    }))  # fmt: skip
    a = FileScheduleSource(path, (0, 1), 2, 1).fetch(0, timedelta(0))
    assert a is not None and (a.restore, a.restore_policy, a.joined_at) == (RestorePoint(1, 6), "manual", 3)
    dead = FileScheduleSource(path, (1, 1), 2, 1).fetch(0, timedelta(0))
    assert dead is not None and not dead.alive and dead.joined_at is None


def test_checkpoint_reports_are_posted_in_order_and_delivered_before_done() -> None:
    """on_checkpoint -> ScheduleClient.report_checkpoint: a `checkpoint` event per report (worker token,
    retried with the same event_id on 503), from a thread of its own, all delivered before `done`."""
    answers: list[Answer] = [(503, {"detail": "restarting"})]

    def answer(h: BaseHTTPRequestHandler) -> Answer:
        return answers.pop(0) if answers else (200, {"version": 1, "state": "running"})

    with stub(answer) as server:
        src = source(server.url)
        client = ScheduleClient(src)
        t0 = time.monotonic()
        client.report_checkpoint(2)
        client.report_checkpoint(4)
        assert time.monotonic() - t0 < 0.5  # the caller never waits for the network
        assert client.done() is True
        src.close()
    posts = [json.loads(b) for m, p, _, b in server.requests if m == "POST"]
    kinds = [(p["kind"], p.get("iteration")) for p in posts]
    assert kinds == [("checkpoint", 2), ("checkpoint", 2), ("checkpoint", 4), ("done", None)], kinds
    assert posts[0] == posts[1] and posts[0]["workers"] == [[0, 1]]  # the retry: the same event_id
    assert (
        posts[0]["event_id"].startswith("checkpoint-0.1-2-") and posts[2]["event_id"] != posts[0]["event_id"]
    )
