"""`whatif.precompute_ray.connect`'s second try of a Ray Client connection: the head's server for a
`ray://` client can miss the head's 30 s start deadline under load ("Initialization failure from
server"; Ray Client has disconnected by then), so `connect` tries once more with a warning. Other
addresses and other errors are not retried. `ray.init` is replaced here: the failure needs a head
too loaded to start a process in 30 s, which a test cannot arrange in bounded time; the real
connections are in test_whatif_ray.py."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from planner.errors import InvalidInputError
from whatif import precompute_ray

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")

ABORTED = ConnectionAbortedError("Initialization failure from server:\nTraceback ...\nRuntimeError: x")


def _connect(mp: pytest.MonkeyPatch, address: str, outcomes: list[BaseException | None]) -> list[str]:
    calls: list[str] = []

    def init(address: str, **_: Any) -> None:
        calls.append(address)
        outcome = outcomes.pop(0)
        if outcome is not None:
            raise outcome

    mp.setattr(ray, "is_initialized", lambda: False)
    mp.setattr(ray, "init", init)
    mp.setattr(precompute_ray, "probe", lambda address, flag: None)
    precompute_ray.connect(address, trial=False)
    return calls


def test_a_client_server_that_failed_to_start_is_tried_once_more(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=precompute_ray.__name__):
        calls = _connect(monkeypatch, "ray://10.0.0.1:10001", [ABORTED, None])
    assert calls == ["ray://10.0.0.1:10001"] * 2
    said = "Initialization failure from server:; connecting again"
    assert [r.getMessage() for r in caplog.records] == [f"--ray/RECYCLE_RAY_ADDRESS {calls[0]}: {said}"]


@pytest.mark.parametrize(
    ("address", "failures"),
    [
        ("ray://10.0.0.1:10001", [ABORTED, ABORTED]),  # twice: one line, exit 2
        ("10.0.0.1:6379", [ABORTED]),  # not Ray Client: no server per connection to wait for
        ("ray://10.0.0.1:10001", [RuntimeError("version mismatch\nmore")]),  # not a start failure
    ],
)
def test_what_is_not_retried_is_one_line(
    monkeypatch: pytest.MonkeyPatch, address: str, failures: list[BaseException]
) -> None:
    outcomes: list[BaseException | None] = [*failures, None]  # a further try would succeed
    with pytest.raises(InvalidInputError) as raised:
        _connect(monkeypatch, address, outcomes)
    assert outcomes == [None]  # no try after the failures
    first = str(failures[-1]).splitlines()[0]
    assert str(raised.value) == f"--ray/RECYCLE_RAY_ADDRESS {address}: cannot connect: {first}"
