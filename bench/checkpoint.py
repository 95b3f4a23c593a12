"""Checkpoint figures (issue 9): how long one save stalls the training loop, for one stage's state of
~100M and ~400M float32 parameters with AdamW state (exp_avg, exp_avg_sq, step: 3x the parameters).

    python -m bench.checkpoint [--sizes 100,400] [--dir /tmp] [--out docs/bench/checkpoint.json]

Three ways, each writing a fresh checkpoint to `--dir` (deleted afterwards), one after the other:

- `torch.save (old, sync)`: what the runtime did before: torch.save of {model, optim} into memory, then
  one file written atomically (temporary file, fsync, rename, fsync of the directory). The loop waits
  for all of it;
- `DCP sync`: `checkpoint.save_stage`: the copy of the state, the torch.distributed.checkpoint write
  (fsync'ed), the marker; the loop waits for all of it;
- `DCP async`: `checkpoint.Checkpointer.save`: the loop waits only for the copy (`stall`); the write and
  the marker run in a background thread (`write`, from save() returning to on_done). Twice: the first
  save allocates the copy, the next ones copy into it (what a training run sees from its 2nd save on).

`stall` is what the training loop loses per checkpoint; `total` is until the checkpoint is durable.
A size is skipped (and said so) when the machine has too little free memory for 3x its state (the
old way holds the state, torch.save's buffer and its copy at once).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from runtime_adapter import checkpoint

CHUNK = 10_000_000  # parameters per tensor (a 400M model: 40 tensors of 40 MB, plus their moments)


def make_state(params: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A model state dict of `params` float32 parameters and an AdamW state dict for it."""
    sizes = [CHUNK] * (params // CHUNK) + ([params % CHUNK] if params % CHUNK else [])
    model = {f"layer{i}.weight": torch.full((n,), 0.01 * i) for i, n in enumerate(sizes)}
    state = {
        i: {
            "step": torch.tensor(10.0),
            "exp_avg": torch.full((n,), 1e-3),
            "exp_avg_sq": torch.full((n,), 1e-6),
        }
        for i, n in enumerate(sizes)
    }
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    group["params"] = list(range(len(sizes)))
    return model, {"state": state, "param_groups": [group]}


def old_save(directory: Path, stage: int, stepped: int, model: dict[str, Any], optim: dict[str, Any]) -> None:
    """The runtime's checkpoint before issue 9 (torch.save + an atomic file write)."""
    buf = io.BytesIO()
    torch.save({"stage": stage, "stepped": stepped, "model": model, "optim": optim}, buf)
    path = directory / f"stage{stage}" / f"it{stepped:08d}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as f:
        f.write(buf.getvalue())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(params: int, base: Path) -> list[dict[str, Any]]:
    """The three ways for one size; one row each."""
    model, optim = make_state(params)
    nbytes = sum(t.numel() * t.element_size() for t in model.values())
    nbytes += sum(t.numel() * t.element_size() for s in optim["state"].values() for t in s.values())
    rows = []

    def row(way: str, stall: float, total: float) -> None:
        figures = {"stall_s": stall, "write_s": total - stall, "total_s": total}
        rows.append(
            {"params": params, "state_gb": round(nbytes / 1e9, 2), "way": way}
            | {k: round(v, 2) for k, v in figures.items()}
            | {"mb_per_s": round(nbytes / 1e6 / total, 1)}
        )
        print(
            f"  {params / 1e6:>5.0f}M  {nbytes / 1e9:5.2f} GB  {way:<23} stall {stall:6.2f} s  "
            f"write {total - stall:6.2f} s  total {total:6.2f} s",
            flush=True,
        )

    for way in ("torch.save (old, sync)", "DCP sync", "DCP async"):
        root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=base))
        try:
            t0 = time.perf_counter()
            if way.startswith("torch.save"):
                old_save(root, 0, 1, model, optim)
                row(way, time.perf_counter() - t0, time.perf_counter() - t0)
            elif way == "DCP sync":
                checkpoint.save_stage(root, 0, 1, model, optim)
                row(way, time.perf_counter() - t0, time.perf_counter() - t0)
            else:  # two saves: the first allocates the copy, the next ones copy into it
                writer, durable = checkpoint.Checkpointer(root), list[int]()
                for k, label in ((1, "DCP async, 1st save"), (2, "DCP async, next save")):
                    t0 = time.perf_counter()
                    writer.save(0, k, model, optim, durable.append)
                    stall = time.perf_counter() - t0
                    writer.close()
                    if durable[-1:] != [k]:
                        raise RuntimeError("the asynchronous save failed (see the log)")
                    row(label, stall, time.perf_counter() - t0)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.checkpoint")
    ap.add_argument("--sizes", default="100,400", help="millions of float32 parameters, comma-separated")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints are written")
    ap.add_argument("--out", default="docs/bench/checkpoint.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []
    skipped = []
    print(f"checkpoint save of one stage (AdamW state), into {args.dir}:")
    for size in [int(s) for s in args.sizes.split(",")]:
        need = 3 * 4 * 3 * size * 1_000_000  # state (params + 2 moments), a second copy, and a third
        if _available_bytes() < need:
            have = _available_bytes() / 1e9
            print(f"  {size}M: skipped ({have:.1f} GB of memory available, {need / 1e9:.1f} GB needed)")
            skipped.append(size)
            continue
        rows.extend(measure(size * 1_000_000, Path(args.dir)))
    doc = {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "load_1min_after": round(os.getloadavg()[0], 2),
        },
        "dir": args.dir,
        "rows": rows,
        "skipped_sizes_m": skipped,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
