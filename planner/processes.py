"""Helpers for the worker processes that plan in parallel (the service's pools, `recycle precompute`).

`exit_with_parent` is a pool initializer: the process ends when its parent dies, even by SIGKILL
(a pool process re-parented to PID 1 would otherwise sleep forever). Linux-only behaviour is not
assumed: it polls the parent id instead of using prctl.
"""

from __future__ import annotations

import os
import threading
import time

POLL_S = 0.5


def exit_with_parent(parent_pid: int) -> None:
    """Pool initializer: end this process once its parent `parent_pid` is gone."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
