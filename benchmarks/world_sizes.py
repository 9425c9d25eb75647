#!/usr/bin/env python3
"""How close a run that goes on in mid-epoch on another number of ranks stays to the run
that kept its own: the figures of docs/recovery.md's "Another number of ranks".

    python benchmarks/world_sizes.py [--out DIR] [--epochs 8] [--stop-at 149]

On the bundled sample (the defaults but --dropout 0, a checkpoint every 4 steps, all
kept), under torchrun with one thread per rank: runs on 1, 2 and 4 ranks that never
stop, and runs stopped by SIGUSR1 after step --stop-at (they save at the next step) on 1,
4 and 2 ranks and continued on 2, 2 and 1. For each continued run it prints the largest
difference of any weight from the run that kept its world size, at the first checkpoint
after the switch and at the last, and both runs' test accuracy after every epoch; and, for
scale, how far the runs that started on 1 and on 2 ranks are apart at the switch.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "mnist_ddp.py"
CHANGES = ((1, 2), (4, 2), (2, 1))  # (ranks before the stop, ranks after it)


def train(ranks: int, args: list[str], cwd: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}", str(SCRIPT),
               *args]
    result = subprocess.run(command, cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    stopped = "--interrupt-at" in args and "stopping on SIGUSR1 at step" in result.stdout  # (as asked: torchrun says 1)
    if result.returncode != 0 and not stopped:
        raise SystemExit(f"world_sizes.py: {' '.join(command)} failed ({result.returncode}):\n{result.stderr[-3000:]}")


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / f"ckpt-{step:08d}.pt", map_location="cpu", weights_only=True)["model"]


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def accuracies(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [round(json.loads(line)["test_accuracy"] * 100, 2) for line in lines]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--out", default="", help="directory of the runs (default: a temporary one)")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--stop-at", type=int, default=149, help="the step after which the stopped runs are signalled")
    given = parser.parse_args()
    out = Path(given.out or tempfile.mkdtemp(prefix="world-sizes-"))
    out.mkdir(parents=True, exist_ok=True)
    common = ["--epochs", str(given.epochs), "--dropout", "0", "--ckpt-every", "4", "--keep-ckpts", "100000",
              "--image-every", "0"]
    for ranks in (1, 2, 4):
        train(ranks, [*common, "--run-dir", f"kept-{ranks}"], out)
    for before, after in CHANGES:
        run = f"{before}-then-{after}"
        train(before, [*common, "--run-dir", run, "--interrupt-at", f"{given.stop_at}:USR1"], out)
        train(after, [*common, "--run-dir", run], out)
    steps = sorted(int(p.stem.split("-")[1]) for p in (out / "kept-1" / "checkpoints").glob("ckpt-*.pt"))
    first, last = next(step for step in steps if step > given.stop_at + 1), steps[-1]  # (after the stop's own save)
    print(f"{given.epochs} epochs of the sample, stopped after step {given.stop_at}; largest weight difference from the "
          "run that kept its world size:")
    for before, after in CHANGES:
        run, kept = out / f"{before}-then-{after}", out / f"kept-{before}"
        print(f"  {before} then {after} ranks: {largest_difference(weights(run, first), weights(kept, first)):.1e} at "
              f"step {first}, {largest_difference(weights(run, last), weights(kept, last)):.1e} at step {last}; "
              f"test accuracy {accuracies(run)} against {accuracies(kept)}")
    switch = (given.stop_at // 4) * 4
    print(f"for scale, runs started on 1 and on 2 ranks at step {switch}: "
          f"{largest_difference(weights(out / 'kept-1', switch), weights(out / 'kept-2', switch)):.1e}")


if __name__ == "__main__":
    main()
