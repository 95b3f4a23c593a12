"""Timing an op where it runs: wall clock on the CPU, CUDA events on a GPU (kernels are asynchronous:
a wall clock around their launch measures the launch, not the work)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


class Timer:
    """`time(fn)` -> (milliseconds, fn's result) on `device`."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device

    def time(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        if not self.cuda:
            t = time.perf_counter()
            out = fn()
            return 1e3 * (time.perf_counter() - t), out
        stream = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        out = fn()
        end.record(stream)
        end.synchronize()
        return float(start.elapsed_time(end)), out
