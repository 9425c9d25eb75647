"""A profile on demand: --profile N records N steps on every rank with torch.profiler, after
WARMUP steps of this start, or the next N (10 with --profile 0) steps once RUN_DIR/profile-now
appears (`touch` it while the job runs: rank 0 looks for it every --log-every steps, and the
per-step agreement starts every rank's profile at the same step). A profile ends at the
run's last step at the latest, before the final evaluation and checkpoint, and is named by
the steps it records. Each rank writes a Chrome/Perfetto trace,
RUN_DIR/profile/steps-<first>-<last>/rank-<r>.json; rank 0 prints the top operators and the
share of the steps' time that communication was under way."""

import re
import time
from pathlib import Path

import torch

from ddpkit import hangs
from ddpkit.distributed import Runtime
from ddpkit.files import make_folder

WARMUP = 3           # steps of this start before --profile N begins: the first ones allocate and tune
ON_REQUEST = 10      # steps a profile-now request records when --profile is 0
REQUEST = "profile-now"
COMMUNICATION = re.compile(r"^(gloo|nccl)[:_]|^record_param_comms$")  # (not c10d::'s, which only launch them)
TOP = 12             # operators in the table


def communication_share(events, seconds: float) -> float:
    """The share of `seconds` that the collectives' own events (Gloo's and NCCL's, run on
    their own threads) were under way; they include the wait for the other ranks."""
    busy_us = sum(e.cpu_time_total for e in events if COMMUNICATION.match(e.key))
    return min(1.0, busy_us / 1e6 / max(seconds, 1e-9))


class StepProfiler:
    """Starts and stops torch.profiler at the steps the run agreed on (every rank alike)."""

    def __init__(self, *, run_dir: Path, rt: Runtime, steps: int, first_step: int, last_step: int):
        self.run_dir, self.rank, self.is_main, self.device = run_dir, rt.rank, rt.is_main, rt.device
        self.steps = steps                 # --profile N
        self.last_step = last_step         # the run's last step: no profile records past it
        self.start_at = first_step + WARMUP if steps else None  # (the step count after which it starts)
        if self.start_at is not None and self.start_at >= last_step:
            self.start_at = None
            if rt.is_main:
                print(f"--profile {steps} records nothing: this start trains {last_step - first_step} steps, and a "
                      f"profile begins after {WARMUP} of warm-up", flush=True)
        self.profiler, self.first, self.until, self.began, self.folder = None, 0, 0, 0.0, None

    def requested(self) -> bool:
        """(rank 0, every --log-every steps) Whether RUN_DIR/profile-now appeared; taken away."""
        path = self.run_dir / REQUEST
        if self.profiler is None and path.exists():
            path.unlink(missing_ok=True)
            return True
        return False

    def step_done(self, step: int, agreed_request: bool) -> bool:
        """After step `step`: start a profile that is due (--profile, or a request every rank
        agreed on), or end one that has recorded its steps. Returns whether a request is
        still to be served (one that came while a profile recorded waits for its end)."""
        if self.profiler is not None:
            if step >= self.until:
                self.finish(step)
            return agreed_request
        if step >= self.last_step:  # (a request at the last step: no step is left to record)
            return False
        if step == self.start_at or agreed_request:
            self.start(step, self.steps if step == self.start_at else (self.steps or ON_REQUEST))
        return False

    def start(self, step: int, steps: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        # Cut at the run's last step: the evaluation and checkpoint that end the run are no step.
        self.first, self.until, self.began = step + 1, min(step + steps, self.last_step), time.perf_counter()
        # (named by the steps, which every rank agrees on; a later profile of the same steps replaces it)
        self.folder = (self.run_dir / "profile" / f"steps-{self.first}-{self.until}").resolve()
        self.profiler = profile(activities=activities)
        self.profiler.start()
        if self.is_main:
            cut = f" (the run ends at step {self.last_step})" if self.until < step + steps else ""
            print(f"profiling steps {self.first} to {self.until} on every rank{cut}", flush=True)

    def finish(self, step: int) -> None:
        before = hangs.doing("writing a profile", hangs.OWN)  # (a large trace takes a while)
        try:
            self.write(step)
        finally:
            hangs.restore(before)

    def write(self, step: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - self.began
        self.profiler.stop()
        make_folder(self.folder)  # (every rank writes its trace there)
        trace = self.folder / f"rank-{self.rank}.json"
        self.profiler.export_chrome_trace(str(trace))
        if self.is_main:
            events = self.profiler.key_averages()
            sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            table = events.table(sort_by=sort, row_limit=TOP)
            share = communication_share(events, seconds)
            steps = step - self.first + 1
            summary = (f"profile of steps {self.first} to {step} ({steps} steps, "
                       f"{1000 * seconds / max(steps, 1):.1f} ms a step on rank 0): communication under way "
                       f"{100 * share:.0f} % of the time; traces of every rank in {self.folder} (open one in "
                       "https://ui.perfetto.dev or chrome://tracing)")
            (self.folder / "top-operators.txt").write_text(table + "\n" + summary + "\n")
            print(table, flush=True)
            print(summary, flush=True)
        self.profiler, self.start_at = None, None
