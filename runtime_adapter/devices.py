"""Which device a worker computes on, which backend its process groups use, and where tensors travel.

`--device` is "cpu", "cuda" (this process's GPU: `cuda:<LOCAL_RANK % device count>`), "cuda:N" or
"auto" (cuda if there is one, else cpu). The backend is the stage group's (the gradient all-reduce):
NCCL moves CUDA tensors and needs one rank per GPU; gloo moves CPU tensors. Point-to-point traffic is
always gloo on CPU tensors (comm.py). Bad input raises `InvalidInputError` with one line naming the
problem (the CLIs turn it into exit 2).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from planner.errors import InvalidInputError

BACKENDS = ("gloo", "nccl", "auto")
NO_CUDA = "no CUDA device here (torch.cuda.is_available() is false)"


def resolve_device(spec: str, local_index: int | None = None) -> torch.device:
    """The torch device for `--device spec`; "cuda" picks `cuda:<local_index or $LOCAL_RANK or 0>`
    modulo the number of devices."""
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "auto":
        return _cuda("auto", local_index) if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cuda":
        return _cuda(spec, local_index)
    if spec.startswith("cuda:") and spec[5:].isdigit():
        if not torch.cuda.is_available():
            raise InvalidInputError(f"--device {spec}: {NO_CUDA}")
        index, count = int(spec[5:]), torch.cuda.device_count()
        if index >= count:
            raise InvalidInputError(
                f"--device {spec}: index out of range ({count} CUDA device(s) here: cuda:0..cuda:{count - 1})"
            )
        return torch.device("cuda", index)
    raise InvalidInputError(f"--device {spec!r}: unknown device (expected cpu, cuda, cuda:N or auto)")


def _cuda(spec: str, local_index: int | None) -> torch.device:
    if not torch.cuda.is_available():
        raise InvalidInputError(f"--device {spec}: {NO_CUDA}")
    if local_index is None:
        # torch's launcher convention (torchrun and ours set it), not a RECYCLE_ setting.
        text = os.environ.get("LOCAL_RANK", "0")
        if not text.strip().isdigit():
            raise InvalidInputError(f"--device {spec}: LOCAL_RANK={text!r} is not a non-negative integer")
        local_index = int(text)
    if local_index < 0:
        raise InvalidInputError(f"--device {spec}: local index {local_index} is negative")
    return torch.device("cuda", local_index % torch.cuda.device_count())


def choose_backend(requested: str, device: torch.device, workers_per_device: int) -> tuple[str, str | None]:
    """The backend to use for `--backend requested` on `device` when `workers_per_device` workers share
    each device, and why it differs from the request (None when it is the request)."""
    if requested not in BACKENDS:
        raise InvalidInputError(f"--backend {requested!r}: unknown backend (expected gloo, nccl or auto)")
    if workers_per_device < 1:
        raise InvalidInputError(f"workers per device must be at least 1, not {workers_per_device}")
    if requested == "gloo":
        return "gloo", None
    cuda = device.type == "cuda"
    if requested == "nccl":
        if not cuda:
            raise InvalidInputError(f"--backend nccl needs a CUDA device (--device cuda), not {device}")
        if not dist.is_nccl_available():
            raise InvalidInputError("--backend nccl: this torch build has no NCCL (dist.is_nccl_available())")
    elif not cuda:
        return "gloo", "auto: no CUDA device, gloo on the CPU"
    elif not dist.is_nccl_available():
        return "gloo", "auto: this torch build has no NCCL"
    if workers_per_device > 1:
        return "gloo", (
            f"NCCL refuses two ranks on one GPU and {workers_per_device} workers share each device: "
            "gloo instead (the gradient all-reduce goes through the CPU)"
        )
    return "nccl", None if requested == "nccl" else "auto: one worker per CUDA device"


def workers_per_device(spec: str, device: torch.device, workers: int) -> int:
    """How many of a job's `workers` share one device under `--device spec` (resolved to `device`):
    "cuda"/"auto" spread them over every GPU (worker i on cuda:<i % count>), "cuda:N" and the CPU put
    them all on one."""
    if device.type == "cuda" and spec in ("cuda", "auto"):
        return -(-workers // torch.cuda.device_count())
    return workers


def job_devices(spec: str, requested: str, workers: int) -> tuple[str, str, str | None]:
    """For a job of `workers` on this machine: (each worker's --device, the backend, why the backend is
    not the request). "cuda"/"auto" spread the workers over every GPU (worker i on
    cuda:<i % count>: "cuda"), "cuda:N" and the CPU put them all on one device."""
    device = resolve_device(spec, 0)
    spread = device.type == "cuda" and spec in ("cuda", "auto")
    backend, why = choose_backend(requested, device, workers_per_device(spec, device, workers))
    return ("cuda" if spread else str(device)), backend, why


def activate(device: torch.device) -> None:
    """Make `device` this process's device. On a GPU: `torch.cuda.set_device` (CUDA events and
    streams default to the current device) and deterministic algorithms, so that a micro-batch gives
    the same numbers wherever it runs (cuBLAS needs CUBLAS_WORKSPACE_CONFIG before its first handle;
    ops without a deterministic implementation warn)."""
    if device.type != "cuda":
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.cuda.set_device(device)
    torch.use_deterministic_algorithms(True, warn_only=True)


def wire_device(backend: str, device: torch.device) -> torch.device:
    """Where tensors must be for `backend`'s point-to-point and collectives: NCCL takes them on the
    worker's CUDA device, gloo on the CPU (the executor copies CUDA activations to the CPU for it)."""
    if backend == "gloo":
        return torch.device("cpu")
    if backend == "nccl":
        if device.type != "cuda":
            raise InvalidInputError(f"--backend nccl needs a CUDA device (--device cuda), not {device}")
        if device.index is None:  # "cuda" without an index: this thread's current device
            return torch.device("cuda", torch.cuda.current_device())
        return device
    raise InvalidInputError(f"backend {backend!r}: expected gloo or nccl (resolve auto with choose_backend)")
