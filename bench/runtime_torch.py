"""The baseline of bench/runtime.py: torch.distributed.pipelining's Schedule1F1B on the reference GPT.

Two rank processes (P=2, gloo, loopback), the same stage modules, synthetic data, loss scaling and
optimizer as the executor, so per-iteration times and final parameters compare one to one.
`python -m bench.runtime_torch --rank R ...` is one rank (started by `run_torch`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from runtime_adapter.model import GPTConfig


def torch_rank(args: argparse.Namespace) -> None:
    """One rank of the Schedule1F1B run (started by `run_torch` as a subprocess)."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.nn import functional

    from runtime_adapter.model import SyntheticData, build_stage, make_optimizer

    torch.set_num_threads(1)
    cfg, rank, M = GPTConfig(**json.loads(args.model)), args.rank, args.microbatches
    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{args.port}")
    module = build_stage(cfg, 2, rank)

    class Logits(nn.Module):  # the last stage without its loss: Schedule1F1B applies loss_fn
        def __init__(self) -> None:
            super().__init__()
            self.inner = module

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in module.blocks:
                x = block(x)
            return module.head(module.ln_f(x))

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    stage = PipelineStage(module if rank == 0 else Logits(), rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, M, loss_fn=loss_fn)  # scale_grads: 1/M, as our 1/(D*M) with D=1
    optimizer = make_optimizer(list(module.parameters()))
    data, times = SyntheticData(cfg), []
    for it in range(args.iterations):
        batches = [data.microbatch(it, 0, m) for m in range(M)]
        tokens, targets = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        t = time.perf_counter()
        if rank == 0:
            schedule.step(tokens)
        else:
            schedule.step(target=targets)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(1e3 * (time.perf_counter() - t))
    torch.save(module.state_dict(), Path(args.out) / f"torch_{rank}.pt")
    (Path(args.out) / f"torch_{rank}.json").write_text(json.dumps(times))
    dist.destroy_process_group()


def run_torch(cfg: GPTConfig, M: int, iterations: int, warmup: int) -> dict:
    """Run Schedule1F1B (2 rank processes) for `iterations`; per-rank median iteration ms after `warmup`."""
    out = Path(tempfile.mkdtemp(prefix="bench-torch-"))
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "bench.runtime_torch", "--rank", str(r), "--port", str(port),
             "--model", json.dumps(asdict(cfg)), "--microbatches", str(M), "--iterations", str(iterations),
             "--out", str(out)],
            env=env, stdout=(out / f"rank{r}.log").open("w"), stderr=subprocess.STDOUT,
        )
        for r in range(2)
    ]  # fmt: skip
    if any(p.wait(timeout=600) != 0 for p in procs):
        raise RuntimeError(f"Schedule1F1B run failed (logs in {out})")
    per_rank = {
        f"0,{r}": statistics.median(json.loads((out / f"torch_{r}.json").read_text())[warmup:])
        for r in range(2)
    }
    return {"out": str(out), "per_worker_ms": per_rank, "iteration_ms": max(per_rank.values())}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    """One rank of the Schedule1F1B run."""
    ap = argparse.ArgumentParser(prog="python -m bench.runtime_torch")
    for a in ("--rank", "--port", "--microbatches", "--iterations"):
        ap.add_argument(a, type=int, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    torch_rank(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
