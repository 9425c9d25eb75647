#!/usr/bin/env python3
"""Benchmark: mnist_ddp.py against the training loop people copy, on one machine, in one run.

    python benchmarks/bench.py                      # Fashion-MNIST if installed, else the sample
    python benchmarks/bench.py --fashion-dir DIR    # Fashion-MNIST .gz or IDX files from DIR
    python benchmarks/bench.py --quick              # a few steps of everything (smoke test)
    python benchmarks/bench.py --gpu                # one CUDA GPU: defaults, --amp --channels-last, --compile
    python benchmarks/bench.py --ranks              # test accuracy by rank count: the defaults, and 2 epochs three ways
    python benchmarks/bench.py --step-times         # what the straggler figures cost a step, on 2 ranks
    python benchmarks/bench.py --compile-cache      # --compile: a later start with the run's compile cache

It runs, one after another on the same machine:
  1. reference: the seeds' loop (torchvision dataset + DataLoader with ToTensor, the
     PyTorch MNIST example's 2-conv CNN with dropout, Adam 1e-3, batch 64, one process),
     written out below;
  2. mnist_ddp.py with its defaults, one process, all cores;
  3. the defaults again for 5 epochs, in a process that also measures the compute limit
     (forward + backward + AdamW step of the default model on batches already normalised
     in memory, nothing else) for 150 steps just before each evaluation: each epoch's
     wall time is set against the limit measured on both sides of it, seconds apart,
     because this machine's speed drifts by tens of percent within a minute;
  4. mnist_ddp.py with 2 Gloo ranks of 1 thread each against 1 rank of 2 threads, at the
     default global batch (2 x 64 and 1 x 128, the same training steps), and with 128
     images per rank (weak scaling: 2 x 128);
and writes OUT/bench.json and OUT/bench.md: time to the target test accuracy (90 % on
Fashion-MNIST, 98 % on the sample) from process start, start-up included, for both
sides, and the epoch each crossed it (the reference runs until it first does, at most
--reference-epochs), training images per second, overhead against the compute limit
(the median epoch's wall time, from one evaluation to the next, so training,
evaluation, logging and checkpoint, over the limit's time for as many steps), scaling
(2x1 over 1x2 throughput) and peak memory per rank. Every figure is a ratio or a time
taken on this machine; the table says which machine.

With --ranks it trains the defaults to the end under torchrun on 1, 2 and 4 ranks (one thread
per rank, all the cores for one), and 2 epochs on 1, 2, 4 and 8 ranks three ways: the default
global batch of 128 split among the ranks, 128 images per rank (weak scaling), and that with
--lr raised by the square root of the global batch's growth; it writes the test accuracy
after the first and the last epoch of the first, and after 2 epochs of the others, to
OUT/ranks.{json,md}.

With --step-times it trains 1 epoch under torchrun on 2 ranks of one thread, the default global
batch, with each rank's own time a step measured and agreed on (the straggler figures) and
without (each rank's timer given no model to watch, in a worker of this file that runs
mnist_ddp.py's main for both ways), PAIRS times each, alternately, in one run; it writes the
median training images/s of each and the cost a step to OUT/step-times.{json,md}.

With --compile-cache it starts a --compile run of 2 steps (one process) on an empty local
cache (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR), then the same run again for 2 more steps
on another empty one, as a later start on another node or in a new job does: it loads the
compile cache the first start saved in the run's directory. Each start's time from process
start to the end of its first step (its first progress line), in 5 runs, and the
median of each run's ratio go to OUT/compile-cache.{json,md}.

With --gpu it runs mnist_ddp.py on one CUDA GPU instead: the defaults, --amp
--channels-last, and --compile, each to the end, and reports time to the target,
final accuracy, images/s and the host synchronisations per training step (counted with
torch.cuda.set_sync_debug_mode), in the same two files. --gpu has not yet run on a GPU:
the tests check only that it refuses, in one line, a machine without one.
"""

import argparse
import gzip
import itertools
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "mnist_ddp.py"
DEBIAN_FASHION = Path("/usr/share/datasets/fashion-mnist")
IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def memory_mb() -> dict:
    """Peak resident memory of this process, and the part of it that is not file-backed now."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    kb = lambda key: int(status.get(key, "0 kB").split()[0])
    return {"peak_rss_mb": kb("VmHWM") / 1024, "rss_anon_mb": kb("RssAnon") / 1024}


# ----------------------------------------------------------------------------- the reference loop

def reference(args) -> None:
    """The seeds' loop, as they describe it; runs in a process of its own (one rank)."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torchvision import datasets, transforms

    class Net(nn.Module):  # the PyTorch MNIST example's CNN
        def __init__(self):
            super().__init__()
            self.conv1 = nn.Conv2d(1, 32, 3, 1)
            self.conv2 = nn.Conv2d(32, 64, 3, 1)
            self.dropout1 = nn.Dropout(0.25)
            self.dropout2 = nn.Dropout(0.5)
            self.fc1 = nn.Linear(9216, 128)
            self.fc2 = nn.Linear(128, 10)

        def forward(self, x):
            x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
            x = self.dropout1(x).flatten(1)
            x = self.dropout2(F.relu(self.fc1(x)))
            return F.log_softmax(self.fc2(x), dim=1)

    torch.manual_seed(0)
    from ddpkit.data import staging
    cls = {"fashion-mnist": datasets.FashionMNIST, "mnist-sample": staging.fetcher(staging.MNIST_SAMPLE)}[args.dataset]
    train = cls(args.data_dir, train=True, transform=transforms.ToTensor())
    test = cls(args.data_dir, train=False, transform=transforms.ToTensor())
    if args.test_images:  # (--quick: its evaluation, image by image through ToTensor, is most of its time)
        test = torch.utils.data.Subset(test, range(min(args.test_images, len(test))))
    train_loader = torch.utils.data.DataLoader(train, batch_size=64, shuffle=True)
    test_loader = torch.utils.data.DataLoader(test, batch_size=1000)
    model = Net()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    epochs, elapsed = [], 0.0
    for epoch in range(1, args.epochs + 1):
        started = time.perf_counter()
        model.train()
        for step, (x, y) in enumerate(train_loader):
            optimizer.zero_grad()
            F.nll_loss(model(x), y).backward()
            optimizer.step()
            if args.max_steps and step + 1 >= args.max_steps:
                break
        train_seconds = time.perf_counter() - started
        model.eval()
        correct = 0
        with torch.no_grad():
            for x, y in test_loader:
                correct += (model(x).argmax(1) == y).sum().item()
        epoch_s = time.perf_counter() - started
        elapsed += epoch_s
        images = min(len(train), args.max_steps * 64) if args.max_steps else len(train)
        epochs.append({"epoch": epoch, "test_accuracy": correct / len(test), "images_per_s": images / train_seconds,
                       "epoch_s": epoch_s, "elapsed_s": elapsed})
        print(f"reference epoch {epoch}: {100 * correct / len(test):.2f} % after {elapsed:.1f} s", flush=True)
        if epochs[-1]["test_accuracy"] >= args.target:
            break
    Path(args.json).write_text(json.dumps({"epochs": epochs, **memory_mb()}))


# ----------------------------------------------------------------------------- mnist_ddp.py runs

EPOCH_LINE = re.compile(r"^(?:reference epoch (\d+):|epoch\s+(\d+) \|)")  # not the progress lines


def run_timed(cmd: list[str], log_path: Path, env: dict) -> dict[int, float]:
    """Run cmd; return, for each epoch line it prints, the seconds since the process
    started: what a user waits, start-up (imports, data) included."""
    started, seen = time.perf_counter(), {}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            log.write(line)
            if match := EPOCH_LINE.match(line):
                seen.setdefault(int(match.group(1) or match.group(2)), time.perf_counter() - started)
        if proc.wait():
            raise SystemExit(f"bench.py: {cmd[1]} failed with exit code {proc.returncode}; see {log_path}")
    return seen


def script_env(threads: int) -> dict:
    """This environment without any launcher's variables (a run is one process unless
    torchrun starts more), with the given threads per process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE"))}
    return {**env, "OMP_NUM_THREADS": str(threads)}


def run_script(out: Path, name: str, args: list[str], nproc: int, threads: int, worker: str = "") -> list[dict]:
    """Run mnist_ddp.py (under torchrun when nproc > 1), or this file's `worker`, which runs its
    main in each rank's process (the options in --json); return its metrics.jsonl records,
    each with since_start_s, the seconds from process start to that epoch's line."""
    run_dir = out / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    args = [*args, "--run-dir", str(run_dir)]
    script = [str(Path(__file__).resolve()), worker, "--json", json.dumps(args)] if worker else [str(SCRIPT), *args]
    cmd = [sys.executable, *script] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *script]
    seen = run_timed(cmd, out / f"{name}.log", script_env(threads))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        r["since_start_s"] = seen.get(r["epoch"])
    print(f"{name}: {records[-1]['test_accuracy'] * 100:.2f} % after {len(records)} epochs, "
          f"{statistics.median(r['images_per_s'] for r in records):.0f} images/s", flush=True)
    return records


def compute_limit(batch_size: int, threads: int, steps: int) -> float:
    """Seconds per step of forward + backward + AdamW on batches already in memory."""
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, str(ROOT))
    import mnist_ddp
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = mnist_ddp.build_model(mnist_ddp.Recipe(), (1, 28, 28), 10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=5e-4, fused=True)
    batches = [(torch.randn(batch_size, 1, 28, 28), torch.randint(0, 10, (batch_size,))) for _ in range(8)]
    for x, y in batches[:3]:  # warm-up
        mnist_ddp.train_step(model, optimizer, 1e-3, x, y)
    started = time.perf_counter()
    for i in range(steps):
        x, y = batches[i % len(batches)]
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return (time.perf_counter() - started) / steps


def paired_worker(args) -> None:
    """The defaults again, in this process, with a burst of the compute limit measured just
    before each evaluation. An epoch's wall time (from one evaluation to the next: training,
    evaluation, logging and checkpoint; the burst taken out) is then set against the
    limit measured on both sides of it, seconds apart, so that this machine's drift,
    which moves both alike, cancels. Writes the marks to --json."""
    import torch
    sys.path.insert(0, str(ROOT))
    import mnist_ddp
    argv, marks, evaluate = json.loads(args.json), [], mnist_ddp.evaluate

    def evaluate_after_a_burst(*a, **kw):
        entered = time.perf_counter()
        with torch.random.fork_rng():  # the run's own random numbers stay untouched
            per_step = compute_limit(128, torch.get_num_threads(), args.max_steps)
        marks.append({"at": entered, "limit_per_step_s": per_step, "burst_s": time.perf_counter() - entered})
        return evaluate(*a, **kw)

    mnist_ddp.evaluate = evaluate_after_a_burst
    code = mnist_ddp.main(argv)
    Path(argv[argv.index("--run-dir") + 1], "marks.json").write_text(json.dumps(marks))
    sys.exit(code)


def paired_overhead(marks: list[dict], steps: list[int]) -> list[dict]:
    """Each epoch after the first: its wall time and the compute limit of its steps (`steps`:
    the step count at each evaluation; an epoch cut short by --max-steps has fewer)."""
    return [{"epoch_s": b["at"] - a["at"] - a["burst_s"],
             "limit_s": (step_b - step_a) * (a["limit_per_step_s"] + b["limit_per_step_s"]) / 2}
            for (a, step_a), (b, step_b) in itertools.pairwise(zip(marks, steps, strict=True))]


def crossing(records: list[dict], target: float) -> tuple[float | None, int | None]:
    """(seconds from process start, epoch) of the first epoch at or above the target."""
    for r in records:
        if r["test_accuracy"] >= target:
            return r["since_start_s"], r["epoch"]
    return None, None


# ----------------------------------------------------------------------------- main

def stage_fashion(source: Path, data_dir: Path) -> None:
    raw = data_dir / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for name in IDX_FILES:
        if not (raw / name).exists():
            packed, plain = source / f"{name}.gz", source / name
            (raw / name).write_bytes(gzip.decompress(packed.read_bytes()) if packed.exists() else plain.read_bytes())


def machine() -> dict:
    import torch
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30),
            "python": platform.python_version(), "torch": torch.__version__, "gpu": "none",
            "date": time.strftime("%Y-%m-%d")}


def fmt(value, spec: str = ".1f", missing: str = "not reached") -> str:
    return missing if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--fashion-dir", default=str(DEBIAN_FASHION), help="Fashion-MNIST .gz or IDX files (default: %(default)s)")
    parser.add_argument("--out", default="bench-out", help="output directory (default: %(default)s)")
    parser.add_argument("--reference-epochs", type=int, default=4,
                        help="most epochs of the reference loop; it stops at the first that reaches the target (default: %(default)s)")
    parser.add_argument("--gpu", action="store_true", help="mnist_ddp.py on one CUDA GPU: defaults, --amp --channels-last, --compile")
    parser.add_argument("--ranks", action="store_true", help="test accuracy by rank count: the defaults on 1, 2 and 4 ranks, "
                        "2 epochs three ways on 1, 2, 4 and 8")
    parser.add_argument("--step-times", action="store_true", help="what the straggler figures cost a step, on 2 ranks")
    parser.add_argument("--compile-cache", action="store_true",
                        help="--compile: time to the first step of a later start with the run's compile cache, against the first")
    parser.add_argument("--quick", action="store_true", help="a few steps of everything: checks that the benchmark runs")
    parser.add_argument("worker", nargs="?", help=argparse.SUPPRESS)
    parser.add_argument("--dataset", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", help=argparse.SUPPRESS)
    parser.add_argument("--epochs", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--max-steps", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--test-images", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--target", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "reference":
        sys.path.insert(0, str(ROOT))
        return reference(args)
    if args.worker == "gpu":
        return gpu_worker(args)
    if args.worker == "paired":
        return paired_worker(args)
    if args.worker in ("step-times-with", "step-times-without"):
        return step_times_worker(args)

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data_dir = out / "data"
    fashion = Path(args.fashion_dir)
    if all((fashion / f"{n}.gz").exists() or (fashion / n).exists() for n in IDX_FILES):
        dataset, target = "fashion-mnist", 0.90
        stage_fashion(fashion, data_dir)
    else:
        dataset, target = "mnist-sample", 0.98
    print(f"data: {dataset} ({'from ' + str(fashion) if dataset == 'fashion-mnist' else 'the bundled sample'}), "
          f"target {100 * target:.0f} %", flush=True)
    common = ["--dataset", dataset, "--data-dir", str(data_dir), "--image-every", "0"]
    quick = ["--max-steps", "20", "--epochs", "2"] if args.quick else []
    threads = os.cpu_count() or 1
    if args.gpu:
        return gpu_benchmark(out, [*common, *quick], target, dataset, args.quick)
    if args.ranks:
        return ranks_benchmark(out, common, quick, dataset, args.quick)
    if args.step_times:
        return step_times_benchmark(out, [*common, "--epochs", "1", *quick[:2]], dataset, args.quick)
    if args.compile_cache:
        return compile_cache_benchmark(out, common, dataset, args.quick)

    # Stage the data through mnist_ddp.py, so that both loops read the same files.
    subprocess.run([sys.executable, str(SCRIPT), "--dataset", dataset, "--data-dir", str(data_dir), "--download-only"],
                   check=True, stdout=subprocess.DEVNULL)

    # 1. the reference loop, in its own process
    ref_json = out / "reference.json"
    seen = run_timed([sys.executable, __file__, "reference", "--dataset", dataset, "--data-dir", str(data_dir),
                      "--epochs", str(1 if args.quick else args.reference_epochs), "--target", str(target),
                      "--max-steps", "20" if args.quick else "0", "--test-images", "1000" if args.quick else "0",
                      "--json", str(ref_json)],
                     out / "reference.log", {**os.environ, "OMP_NUM_THREADS": str(threads)})
    ref = json.loads(ref_json.read_text())
    for e in ref["epochs"]:
        e["since_start_s"] = seen.get(e["epoch"])

    # 2. the defaults, one process
    default = run_script(out, "default", [*common, *quick], 1, threads)

    # 3. overhead: the defaults again, each epoch paired with bursts of the compute limit
    # measured in the same process on both sides of it (a few seconds apart)
    # (quick: epoch 2 cut short a few steps in, and bursts of a few steps)
    paired_args = ["--dataset", "mnist-sample", "--data-dir", str(data_dir), "--image-every", "0", "--epochs", "2",
                   "--max-steps", "40"] if args.quick else [*common, "--epochs", "5"]
    run_dir = out / "runs" / "paired"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_timed([sys.executable, __file__, "paired", "--max-steps", "5" if args.quick else "150", "--json",
               json.dumps([*paired_args, "--run-dir", str(run_dir)])], out / "paired.log", script_env(threads))
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    pairs = paired_overhead(json.loads((run_dir / "marks.json").read_text()), steps)
    ratios = [p["epoch_s"] / p["limit_s"] for p in pairs]
    middle = sorted(range(len(pairs)), key=ratios.__getitem__)[len(pairs) // 2]
    print(f"overhead: {' '.join(f'{r:.2f}' for r in ratios)} (epochs 2-{len(pairs) + 1})", flush=True)

    # 4. two ranks of one thread against one rank of two: the defaults (one global batch of
    # 128: 2 x 64, the same training steps as 1 x 128), and weak scaling (128 images per rank)
    scaling_args = [*common, "--epochs", "2", *(quick[:2] if args.quick else [])]
    two_by_one = run_script(out, "2x1", scaling_args, 2, 1)
    two_by_one_weak = run_script(out, "2x1-b128", [*scaling_args, "--batch-size", "128"], 2, 1)
    one_by_two = run_script(out, "1x2", scaling_args, 1, 2)

    (ref_time, ref_epoch), (our_time, our_epoch) = crossing(ref["epochs"], target), crossing(default, target)
    ref_speed = statistics.median(e["images_per_s"] for e in ref["epochs"])
    our_speed = statistics.median(r["images_per_s"] for r in default)
    results = {
        "machine": machine(), "dataset": dataset, "target_accuracy": target, "quick": args.quick,
        "reference": {"time_to_target_s": ref_time, "crossed_at_epoch": ref_epoch, "images_per_s": ref_speed,
                      "epochs": ref["epochs"],
                      "final_accuracy": ref["epochs"][-1]["test_accuracy"], "peak_rss_mb": ref["peak_rss_mb"],
                      "rss_anon_mb": ref["rss_anon_mb"]},
        "default": {"time_to_target_s": our_time, "crossed_at_epoch": our_epoch, "images_per_s": our_speed,
                    "epochs": default,
                    "final_accuracy": default[-1]["test_accuracy"], "peak_rss_mb": default[-1].get("peak_rss_mb"),
                    "epoch_s_median": pairs[middle]["epoch_s"], "compute_limit_epoch_s": pairs[middle]["limit_s"],
                    "overhead": ratios[middle], "overhead_per_epoch": ratios, "overhead_pairs": pairs},
        "scaling": {"2x1_images_per_s": two_by_one[-1]["images_per_s"], "1x2_images_per_s": one_by_two[-1]["images_per_s"],
                    "ratio": two_by_one[-1]["images_per_s"] / one_by_two[-1]["images_per_s"],
                    "2x1_accuracy": two_by_one[-1]["test_accuracy"], "1x2_accuracy": one_by_two[-1]["test_accuracy"],
                    "2x1_b128_images_per_s": two_by_one_weak[-1]["images_per_s"],
                    "ratio_weak": two_by_one_weak[-1]["images_per_s"] / one_by_two[-1]["images_per_s"],
                    "2x1_b128_accuracy": two_by_one_weak[-1]["test_accuracy"],
                    "2x1_peak_rss_mb": two_by_one[-1]["peak_rss_mb"], "1x2_peak_rss_mb": one_by_two[-1]["peak_rss_mb"]},
    }
    results["time_ratio"] = ref_time / our_time if ref_time and our_time else None
    # The reference's accuracy after its second epoch lands on either side of 90 % from one
    # machine and torch to the next: the ratio had it crossed there, whichever it did.
    ref_second = next((e["since_start_s"] for e in ref["epochs"] if e["epoch"] == 2), None)
    results["time_ratio_reference_epoch_2"] = ref_second / our_time if ref_second and our_time else None
    results["speed_ratio"] = our_speed / ref_speed
    ready = re.search(r"ready in [^\n]*\)", (out / "default.log").read_text())
    results["default"]["ready_line"] = ready.group(0) if ready else None  # where its start-up went
    (out / "bench.json").write_text(json.dumps(results, indent=2))
    (out / "bench.md").write_text(markdown(results))
    print(markdown(results))


# ----------------------------------------------------------------------------- by rank count

RANK_COUNTS = (1, 2, 4, 8)
DEFAULTS_RANK_COUNTS = (1, 2, 4)
LR = 3e-3  # mnist_ddp.py's default --lr


def ranks_benchmark(out: Path, data: list[str], quick_args: list[str], dataset: str, quick: bool) -> None:
    """Test accuracy by rank count: the defaults to the end (after the first and the last
    epoch), then after 2 epochs: the default global batch, 128 per rank, and 128 per rank with
    --lr x sqrt(ranks) (the rule docs/defaults.md gives)."""
    cores = os.cpu_count() or 1
    threads = lambda ranks: max(1, cores // ranks) if ranks == 1 else 1
    to_the_end = {}
    for ranks in DEFAULTS_RANK_COUNTS[:2] if quick else DEFAULTS_RANK_COUNTS:
        records = run_script(out, f"defaults-ranks{ranks}", [*data, *quick_args], ranks, threads(ranks))
        to_the_end[ranks] = {"epoch_1": records[0]["test_accuracy"], "last": records[-1]["test_accuracy"],
                             "epochs": len(records)}
    common = [*data, "--epochs", "2", *quick_args[:2]]
    ways = {"default (global batch 128)": lambda ranks: [],
            "--batch-size 128 (global batch 128 x ranks)": lambda ranks: ["--batch-size", "128"],
            "--batch-size 128 and --lr x sqrt(ranks)": lambda ranks: ["--batch-size", "128", "--lr",
                                                                      f"{LR * ranks ** 0.5:.2g}"]}
    counts = RANK_COUNTS[:2] if quick else RANK_COUNTS
    results = {"machine": machine(), "dataset": dataset, "quick": quick, "accuracy": {}}
    for way, extra in ways.items():
        results["accuracy"][way] = {}
        for ranks in counts:
            if ranks == 1 and way != next(iter(ways)):  # (one rank: the same run as the default)
                results["accuracy"][way][ranks] = results["accuracy"][next(iter(ways))][1]
                continue
            name = f"ranks{ranks}-{len(results['accuracy']) - 1}"
            records = run_script(out, name, [*common, *extra(ranks)], ranks, threads(ranks))
            results["accuracy"][way][ranks] = records[-1]["test_accuracy"]
    results["defaults"] = to_the_end
    (out / "ranks.json").write_text(json.dumps(results, indent=2))
    m = results["machine"]
    lines = [f"Data: {dataset}{' (quick run: not representative)' if quick else ''}. Machine: {m['cpu']}, "
             f"{m['cores']} cores, no GPU; torch {m['torch']}.", "", *ranks_tables(json.loads((out / "ranks.json").read_text()))]
    (out / "ranks.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def ranks_tables(r: dict) -> list[str]:
    """The lines of ranks.json's two tables (as read back: rank counts are strings), the
    defaults to the end and each way after 2 epochs; figures.py writes them into the docs."""
    defaults, by_way = r["defaults"], r["accuracy"]
    counts, last = list(next(iter(by_way.values()))), next(iter(defaults.values()))["epochs"]

    def header(title: str, ranks) -> list[str]:
        return [f"| {title} | " + " | ".join(f"{n} rank{'s' * (int(n) > 1)}" for n in ranks) + " |", "|---|" + "---|" * len(ranks)]
    return [*header("the defaults, test accuracy", defaults),
            "| after epoch 1 | " + " | ".join(f"{100 * run['epoch_1']:.2f} %" for run in defaults.values()) + " |",
            f"| after epoch {last}, the last | " + " | ".join(f"{100 * run['last']:.2f} %" for run in defaults.values()) + " |",
            "", *header("test accuracy after 2 epochs", counts),
            *(f"| {way} | " + " | ".join(f"{100 * by[n]:.2f} %" for n in counts) + " |" for way, by in by_way.items())]


# ----------------------------------------------------------------------------- the straggler figures' cost

PAIRS = 4


def step_times_worker(args) -> None:
    """One rank of a --step-times run: mnist_ddp.py's main in this process. The product has no
    switch for the straggler figures: the "without" way's ranks time no part of a step (their
    StepTimer watches no model), so none are gathered; both ways run here, so that they differ
    in that alone."""
    sys.path.insert(0, str(ROOT))
    import mnist_ddp
    from ddpkit.run import stragglers, training_run
    if args.worker == "step-times-without":
        training_run.StepTimer = lambda model: stragglers.StepTimer(None)
    sys.exit(mnist_ddp.main(json.loads(args.json)))


def step_times_benchmark(out: Path, common: list[str], dataset: str, quick: bool) -> None:
    """2 ranks x 1 thread, with and without the straggler figures, alternately; each run's
    images/s (its epoch's training images over its training time)."""
    speeds = {"with": [], "without": []}
    for pair in range(1 if quick else PAIRS):
        for way in speeds:
            records = run_script(out, f"step-times-{way}-{pair}", common, 2, 1, worker=f"step-times-{way}")
            speeds[way].append(records[-1]["images_per_s"])
    batch = 128  # (the default global batch: images a step over both ranks)
    median = {way: statistics.median(v) for way, v in speeds.items()}
    ms = {way: 1000 * batch / median[way] for way in median}
    results = {"machine": machine(), "dataset": dataset, "quick": quick, "images_per_s": speeds,
               "median_images_per_s": median, "ms_per_step": ms, "cost_ms_per_step": ms["with"] - ms["without"],
               "cost_ratio": ms["with"] / ms["without"]}
    (out / "step-times.json").write_text(json.dumps(results, indent=2))
    m = results["machine"]
    text = (f"Data: {dataset}{' (quick run: not representative)' if quick else ''}, 1 epoch, 2 ranks x 1 thread, global "
            f"batch 128, {len(speeds['with'])} runs each way, alternately. Machine: {m['cpu']}, {m['cores']} cores, no GPU; "
            f"torch {m['torch']}.\n\n| straggler figures | images/s (median) | ms a step |\n|---|---|---|\n"
            + "".join(f"| {way} | {median[way]:.0f} | {ms[way]:.2f} |\n" for way in median)
            + f"\nCost: {results['cost_ms_per_step']:+.3f} ms a step ({100 * (results['cost_ratio'] - 1):+.1f} %); "
              f"each run's images/s: with {', '.join(f'{v:.0f}' for v in speeds['with'])}; without "
              f"{', '.join(f'{v:.0f}' for v in speeds['without'])}.\n")
    (out / "step-times.md").write_text(text)
    print(text)


# ----------------------------------------------------------------------------- the compile cache

COMPILE_PAIRS = 5  # (each pair: two compiled starts, about 40 s each on 2 cores)
FIRST_STEP_LINE = re.compile(r"^epoch \d+ step \d+/\d+ \(step \d+ in all\)")  # (a progress line, each step)
LOADED_LINE = re.compile(r"^compile: loaded the compile cache \S+ \((\d+) artifacts\)", re.M)


def time_to_first_step(cmd: list[str], log_path: Path, env: dict) -> float:
    """Run cmd to its end; the seconds from its start to its first progress line, the end of
    its first step (--progress-every 0.001 prints one after every step)."""
    started, first = time.perf_counter(), None
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            log.write(line)
            if first is None and FIRST_STEP_LINE.match(line):
                first = time.perf_counter() - started
        if proc.wait() or first is None:
            raise SystemExit(f"bench.py: {cmd[1]} failed with exit code {proc.returncode} or printed no step; see {log_path}")
    return first


def compile_cache_benchmark(out: Path, common: list[str], dataset: str, quick: bool) -> None:
    """COMPILE_PAIRS runs (one in --quick) of two --compile starts each, every start on an empty local
    cache: the first compiles and saves the run's compile cache, the later one (the same run,
    2 more steps) loads it. Their times to the first step, and the median of each run's ratio."""
    pairs = []
    for pair in range(1 if quick else COMPILE_PAIRS):
        run_dir = out / "runs" / f"compile-cache-{pair}"
        shutil.rmtree(run_dir, ignore_errors=True)
        times, loaded = {}, None
        for start, steps in (("first", 2), ("later", 4)):
            caches = out / "compile-caches" / f"{pair}-{start}"
            shutil.rmtree(caches, ignore_errors=True)
            env = {**script_env(os.cpu_count() or 1), "TORCHINDUCTOR_CACHE_DIR": str(caches),
                   "TRITON_CACHE_DIR": str(caches / "triton")}
            args = [*common, "--compile", "--epochs", "1", "--max-steps", str(steps), "--progress-every", "0.001",
                    "--allow-changes", "--run-dir", str(run_dir)]
            log = out / f"compile-cache-{pair}-{start}.log"
            times[start] = time_to_first_step([sys.executable, str(SCRIPT), *args], log, env)
            loaded = LOADED_LINE.search(log.read_text())
            print(f"compile cache, run {pair + 1}: the {start} start's first step after {times[start]:.1f} s", flush=True)
        if not loaded:
            raise SystemExit(f"bench.py: the later start did not load the compile cache; see {log}")
        pairs.append({**{f"{start}_s": seconds for start, seconds in times.items()}, "artifacts": int(loaded.group(1))})
    first, later = (statistics.median(p[f"{start}_s"] for p in pairs) for start in ("first", "later"))
    # Each run's own ratio, of two starts a minute apart: this machine's speed drifts, and
    # other work on it comes and goes, by more than that within the benchmark.
    ratios = [p["later_s"] / p["first_s"] for p in pairs]
    results = {"machine": machine(), "dataset": dataset, "quick": quick, "pairs": pairs, "first_s": first,
               "later_s": later, "ratios": ratios, "ratio": statistics.median(ratios)}
    (out / "compile-cache.json").write_text(json.dumps(results, indent=2))
    m = results["machine"]
    rows = {"first": ("first_s", first), "later (loads the run's compile cache)": ("later_s", later)}
    text = (f"Data: {dataset}{' (quick run: not representative)' if quick else ''}, --compile, one process of "
            f"{m['cores']} threads, every start on an empty local cache, {len(pairs)} runs alternately. Machine: "
            f"{m['cpu']}, {m['cores']} cores, no GPU; torch {m['torch']}.\n\n"
            "| start | time to the first step (median) | each run |\n|---|---|---|\n"
            + "".join(f"| {name} | {median:.1f} s | {', '.join(f'{p[start]:.1f}' for p in pairs)} s |\n"
                      for name, (start, median) in rows.items())
            + f"\nRatio, later over first, the median of the runs' own: {results['ratio']:.2f} (each run: "
              f"{', '.join(f'{r:.2f}' for r in ratios)}).\n")
    (out / "compile-cache.md").write_text(text)
    print(text)


# ----------------------------------------------------------------------------- on a GPU

GPU_VARIANTS = {"defaults": [], "--amp --channels-last": ["--amp", "--channels-last"], "--compile": ["--compile"]}


def gpu_worker(args) -> None:
    """One mnist_ddp.py run in this process, with every host synchronisation of CUDA
    counted (set_sync_debug_mode warns at each); writes the count and the steps."""
    import torch
    sys.path.insert(0, str(ROOT))
    import mnist_ddp
    argv = json.loads(args.json)
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = mnist_ddp.main(argv)
    torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    run_dir = Path(argv[argv.index("--run-dir") + 1])
    steps = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    (run_dir / "syncs.json").write_text(json.dumps({"syncs": syncs, "steps": steps}))
    sys.exit(code)


def gpu_step_limits(batch_size: int, steps: int) -> dict:
    """Seconds per step of the bare training step on the GPU (forward + backward + fused
    AdamW, the default model, a batch already there), run eagerly and replayed as one CUDA
    graph (PyTorch's whole-network capture: warm-up on a side stream, capturable AdamW,
    static input tensors): what the training loop's steps are set against."""
    import torch
    import torch.nn.functional as F
    sys.path.insert(0, str(ROOT))
    import mnist_ddp
    device = torch.device("cuda")
    torch.manual_seed(0)
    x, y = torch.randn(batch_size, 1, 28, 28, device=device), torch.randint(0, 10, (batch_size,), device=device)

    def timed(step) -> float:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        return (time.perf_counter() - started) / steps

    model = mnist_ddp.build_model(mnist_ddp.Recipe(), (1, 28, 28), 10).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=5e-4, fused=True)
    eager = timed(lambda: mnist_ddp.train_step(model, optimizer, 1e-3, x, y))

    model = mnist_ddp.build_model(mnist_ddp.Recipe(), (1, 28, 28), 10).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=torch.tensor(1e-3, device=device), betas=(0.9, 0.99),
                                  weight_decay=5e-4, fused=True, capturable=True)

    def step() -> None:
        optimizer.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(11):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graphed = timed(graph.replay)
    return {"eager_step_s": eager, "graphed_step_s": graphed, "batch_size": batch_size}


def gpu_benchmark(out: Path, common: list[str], target: float, dataset: str, quick: bool) -> None:
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("bench.py: --gpu needs a CUDA GPU, and torch sees none; run it on a GPU node")
    results = {"machine": {**machine(), "gpu": torch.cuda.get_device_name(0)}, "dataset": dataset,
               "target_accuracy": target, "quick": quick, "gpu": {},
               "step_limits": gpu_step_limits(128, 20 if quick else 500)}
    limits = results["step_limits"]
    print(f"bare step at batch 128: {1e3 * limits['eager_step_s']:.3f} ms eager, {1e3 * limits['graphed_step_s']:.3f} ms "
          "as a CUDA graph", flush=True)
    for name, extra in GPU_VARIANTS.items():
        run_dir = out / "runs" / f"gpu-{name.replace(' ', '').replace('-', '')}"
        shutil.rmtree(run_dir, ignore_errors=True)
        argv = [*common, *extra, "--device", "cuda", "--run-dir", str(run_dir)]
        seen = run_timed([sys.executable, __file__, "gpu", "--json", json.dumps(argv)], out / f"{run_dir.name}.log",
                         dict(os.environ))
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        for r in records:
            r["since_start_s"] = seen.get(r["epoch"])
        syncs = json.loads((run_dir / "syncs.json").read_text())
        time_to_target, epoch = crossing(records, target)
        results["gpu"][name] = {"time_to_target_s": time_to_target, "crossed_at_epoch": epoch,
                                "final_accuracy": records[-1]["test_accuracy"],
                                "images_per_s": statistics.median(r["images_per_s"] for r in records),
                                "syncs_per_step": syncs["syncs"] / max(syncs["steps"], 1), "epochs": records}
        print(f"{name}: {results['gpu'][name]['syncs_per_step']:.3f} host syncs per step", flush=True)
    (out / "bench.json").write_text(json.dumps(results, indent=2))
    lines = [f"Data: {dataset}{' (quick run: not representative)' if quick else ''}. Machine: "
             f"{results['machine']['gpu']}, {results['machine']['cores']} CPU cores; torch {results['machine']['torch']}.", "",
             f"| mnist_ddp.py on one GPU | time to {100 * target:.0f} % from process start | final test accuracy "
             "| images/s (median epoch) | of the eager / graphed bare step's | host syncs per step |",
             "|---|---|---|---|---|---|"]
    eager_speed, graphed_speed = (128 / limits[key] for key in ("eager_step_s", "graphed_step_s"))
    for name, g in results["gpu"].items():
        crossed = f" (epoch {g['crossed_at_epoch']})" if g["crossed_at_epoch"] else ""
        lines.append(f"| {name} | {fmt(g['time_to_target_s'])} s{crossed} | {100 * g['final_accuracy']:.2f} % "
                     f"| {g['images_per_s']:.0f} | {100 * g['images_per_s'] / eager_speed:.0f} % / "
                     f"{100 * g['images_per_s'] / graphed_speed:.0f} % | {g['syncs_per_step']:.3f} |")
    lines += ["", f"The bare step (forward + backward + fused AdamW, batch 128 already on the GPU): "
              f"{1e3 * limits['eager_step_s']:.3f} ms eager ({eager_speed:.0f} images/s), "
              f"{1e3 * limits['graphed_step_s']:.3f} ms as one CUDA graph ({graphed_speed:.0f} images/s)."]
    (out / "bench.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def markdown(r: dict) -> str:
    m, ref, d, s = r["machine"], r["reference"], r["default"], r["scaling"]
    target = f"{100 * r['target_accuracy']:.0f} %"
    at = lambda side: f" (epoch {side['crossed_at_epoch']})" if side["crossed_at_epoch"] else f" (not in {len(side['epochs'])} epochs)"
    second = ref["epochs"][1] if len(ref["epochs"]) > 1 else None
    rows = [
        ("time to " + target + " test accuracy, from process start", f"{fmt(ref['time_to_target_s'])} s{at(ref)}",
         f"{fmt(d['time_to_target_s'])} s{at(d)}", f"{fmt(r['time_ratio'], '.1f', 'n/a')}x shorter"),
        ("the same, against the reference's second epoch whatever its accuracy",
         f"{second['since_start_s']:.1f} s ({100 * second['test_accuracy']:.2f} %)" if second else "no second epoch", "",
         f"{fmt(r.get('time_ratio_reference_epoch_2'), '.1f', 'n/a')}x shorter"),
        ("training images/s (median epoch)", f"{ref['images_per_s']:.0f}", f"{d['images_per_s']:.0f}", f"{r['speed_ratio']:.1f}x"),
        ("final test accuracy", f"{100 * ref['final_accuracy']:.2f} % ({len(ref['epochs'])} epochs)",
         f"{100 * d['final_accuracy']:.2f} % ({len(d['epochs'])} epochs)", ""),
        ("peak RSS per rank", f"{ref['peak_rss_mb']:.0f} MB", f"{fmt(d['peak_rss_mb'], '.0f', '?')} MB", ""),
        ("epoch wall time / compute limit (median epoch, paired)", "", f"{d['epoch_s_median']:.2f} s / {d['compute_limit_epoch_s']:.2f} s",
         f"{d['overhead']:.2f}"),
        ("scaling: 2 ranks x 1 thread / 1 rank x 2 threads, the default global batch of 128 (2 x 64 / 1 x 128)", "",
         f"{s['2x1_images_per_s']:.0f} / {s['1x2_images_per_s']:.0f} images/s; "
         f"{100 * s['2x1_accuracy']:.2f} % / {100 * s['1x2_accuracy']:.2f} % after 2 epochs", f"{s['ratio']:.2f}"),
        ("weak scaling: the same with 128 images per rank (--batch-size 128: 2 x 128 / 1 x 128)", "",
         f"{s['2x1_b128_images_per_s']:.0f} / {s['1x2_images_per_s']:.0f} images/s; "
         f"{100 * s['2x1_b128_accuracy']:.2f} % after 2 epochs", f"{s['ratio_weak']:.2f}"),
        ("peak RSS per rank, 2 ranks x 1 thread", "", f"{s['2x1_peak_rss_mb']:.0f} MB", ""),
    ]
    lines = [f"Data: {r['dataset']}{' (quick run: not representative)' if r['quick'] else ''}. Machine: {m['cpu']}, "
             f"{m['cores']} cores, {m['memory_gb']} GiB, no GPU; Python {m['python']}, torch {m['torch']}.", "",
             "| figure | reference loop | mnist_ddp.py defaults | ratio |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {e} |" for a, b, c, e in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
