"""A stop signal (SIGTERM, or Ctrl-C's SIGINT) that lands while the supervision loop polls a worker:
raised after the poll, with the process still waitable. Before, `subprocess.Popen.poll` could be left
with its wait lock held (the exception came between its `acquire` and its `try`), and the launcher's
clean-up then hung in `wait()` for ever (CI: a SIGTERMed launcher killed [0, 0] and never exited).

The window is a few bytecodes wide, so the test widens it: Popen's poll is replaced by one that takes
the lock, gets the signal delivered, then releases the lock without a `try`, exactly as the real one
does when the handler raises in that window."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest

from runtime_adapter.stop_signals import WorkerPopen, shielded, stop_on_signals

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def handlers() -> Iterator[None]:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    stop_on_signals()
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


def _poll_hit_in_its_window(sig: signal.Signals) -> Any:
    """A Popen._internal_poll that gets `sig` delivered while it holds the wait lock, and releases the
    lock without a `try`, as the real one does when the handler raises in that window."""

    def poll(self: subprocess.Popen[bytes], *args: Any, **kwargs: Any) -> int | None:
        if not self._waitpid_lock.acquire(False):  # type: ignore[attr-defined]
            return None
        os.kill(os.getpid(), sig)
        time.sleep(0.01)  # (the handler runs here: an exception skips the release below)
        self._waitpid_lock.release()  # type: ignore[attr-defined]
        return None

    return poll


@pytest.mark.parametrize(
    ("sig", "raised"),
    [(signal.SIGTERM, SystemExit(128 + signal.SIGTERM)), (signal.SIGINT, KeyboardInterrupt())],
    ids=["SIGTERM", "SIGINT"],
)
@pytest.mark.parametrize("cls", [subprocess.Popen, WorkerPopen])
def test_a_stop_signal_inside_poll_leaves_the_process_waitable(
    handlers: None,
    monkeypatch: pytest.MonkeyPatch,
    cls: type[subprocess.Popen[bytes]],
    sig: signal.Signals,
    raised: BaseException,
) -> None:
    proc = cls(["sleep", "30"])
    try:
        with monkeypatch.context() as m:
            m.setattr(subprocess.Popen, "_internal_poll", _poll_hit_in_its_window(sig))
            with pytest.raises(type(raised)) as stopped:
                proc.poll()
        assert stopped.value.args == raised.args
        proc.kill()
        if cls is WorkerPopen:
            assert proc.wait(timeout=10) == -signal.SIGKILL
        else:  # the plain Popen: its lock is held for good, the clean-up's wait() would hang
            with pytest.raises(subprocess.TimeoutExpired):
                proc.wait(timeout=1)
    finally:
        proc.kill()
        if cls is subprocess.Popen:
            proc._waitpid_lock.release()  # type: ignore[attr-defined]  # (for the test's own clean-up)
        proc.wait(timeout=10)


def test_a_signal_in_a_shielded_section_is_raised_at_its_end(handlers: None) -> None:
    reached = False
    with pytest.raises(SystemExit) as stopped, shielded():
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.01)
        with shielded():  # nested: raised at the outer end only
            pass
        reached = True
    assert reached and stopped.value.code == 128 + signal.SIGHUP
    with pytest.raises(SystemExit):  # outside a shielded section: at once
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1)
