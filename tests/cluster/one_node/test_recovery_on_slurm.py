"""Failures that heal by themselves on the shared one-node Slurm (local-slurm.sh), with real
processes and real signals: a rank SIGKILLed twice in one job, rank 0 the second time (final
parameters equal to an uninterrupted run's; the run's lease it left taken over at once), a
rank frozen with SIGSTOP (named from outside before the timeout), a crash loop that gives
up after MAX_RESTARTS, a rank that dies after it finished and saved,
and usage errors and a divergence that are not retried. Across nodes:
tests/cluster/mostly_waiting/test_recovery_across_nodes.py; at unit level:
tests/unit/test_recovery.py.

The times these tests print (kill to resumed, hang detected) are the README's "Failures and
recovery" figures; nothing asserts on them.

    python -m pytest tests/cluster/one_node/test_recovery_on_slurm.py
"""

import re
import signal
import sys
import threading
from pathlib import Path

import pytest
import torch

from helpers.cluster import FAST, finish, lost_steps, output_of, rank_pids, signal_rank, wait_for
from helpers.images import load_params, read_metrics


def tensorboard_steps(run_dir: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return [e.step for e in events.Scalars(tag)]


# ----------------------------------------------------------------------------- on a real Slurm

def test_a_rank_killed_twice_heals_within_the_job_bit_identically(one_node, tmp_path):
    """SIGKILL rank 1 in epoch 2, and rank 0 in epoch 5 of the restarted step: the job
    restarts the step twice in its allocation and ends with the very parameters of an
    uninterrupted run, every epoch and every logged step once in metrics and TensorBoard.
    The step after rank 0's death takes over at once the run's lease it left, also where
    fcntl's locks exclude nothing (the aid, as on NFS mounted nolock)."""
    options = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"]
    reference = one_node.sbatch(tmp_path / "reference", options, FAST, RUN_NAME="straight")
    client = one_node.sbatch(tmp_path, options, FAST, RUN_NAME="healed", AID_LOCKS_EXCLUDE_NOTHING="1")
    kills = []
    for epoch, rank in ((1, 1), (4, 0)):  # epoch 4 ends only in the restarted step
        wait_for(tmp_path, rf"^0: epoch   {epoch} \|")
        kills.append(signal_rank("healed", rank, signal.SIGKILL))
    resumed = [wait_for(tmp_path, r"^0: resumed from ", n) for n in (1, 2)]
    job_id, out = finish(client, tmp_path)
    finish(reference, tmp_path / "reference")
    print(f"\nSIGKILL to training resumed: {[round(r - k, 1) for k, r in zip(kills, resumed, strict=True)]} s; "
          f"steps lost per crash: {lost_steps(out)}")
    assert re.findall(r"^ATTEMPT (\d/4) after exit ", out, re.M) == ["2/4", "3/4"], out[-3000:]
    assert re.search(r"^ATTEMPT 2/4 after exit \d+ \(rank 1 ended without an exit code", out, re.M), out[-3000:]
    assert re.findall(r"^0: took over \S+/runs/healed/\.claim\.lease from pid \d+ on \S+ since [\d: -]+, Slurm job "
                      rf"{job_id}: (.*)$", out, re.M) == ["its process has ended"], out[-3000:]
    assert re.search(rf"^END .* job={job_id} exit=0$", out, re.M)
    assert re.findall(r"^0: resumed from .* \(attempt (\d/4), requeued 0x\)$", out, re.M) == ["2/4", "3/4"]
    run_dir = tmp_path / "runs" / "healed"
    healed, straight = load_params(run_dir), load_params(tmp_path / "reference" / "runs" / "straight")
    assert healed.keys() == straight.keys()
    assert all(torch.equal(healed[k], straight[k]) for k in healed)
    assert [m["epoch"] for m in read_metrics(run_dir)] == list(range(1, 9))
    steps = tensorboard_steps(run_dir, "train/batch_loss")
    assert steps == sorted(set(steps)) == list(range(50, 257, 50))
    assert tensorboard_steps(run_dir, "test/accuracy") == list(range(32, 257, 32))


def test_a_hung_rank_is_named_from_outside_before_the_timeout_and_the_job_heals(one_node, tmp_path):
    """SIGSTOP freezes rank 1 mid-training: after --hang-after (its default: 10 s at
    --dist-timeout 20) rank 0 names it, stopped, from /proc, with its host, and keeps both
    ranks' stacks (rank 1's from faulthandler, or none: it is stopped); rank 0 gives up on it
    after --dist-timeout with the lost-peer code, and the restarted step completes. The ranks
    were given NCCL's Flight Recorder settings, which a Gloo run ignores."""
    client = one_node.sbatch(tmp_path, ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"],
                             [*FAST, "--dist-timeout", "20"], RUN_NAME="frozen")
    wait_for(tmp_path, r"^0: epoch   1 \|")
    environ = (Path("/proc") / str(rank_pids("frozen", 1)[0]) / "environ").read_bytes().split(b"\0")
    stopped = signal_rank("frozen", 1, signal.SIGSTOP)
    named = wait_for(tmp_path, r"^0: hang after step \d+: rank 1 on ")
    noticed = wait_for(tmp_path, r"error: lost contact with another rank during .*(Timed out|timeout)")
    print(f"\nhang (SIGSTOP) named after {named - stopped:.1f} s, given up on after {noticed - stopped:.1f} s at "
          "--dist-timeout 20")
    _, out = finish(client, tmp_path)
    verdict = re.search(r"^0: (hang after step \d+: rank 1 on (\S+) is stopped \(state T, stopped: SIGSTOP or a debugger"
                        r".*\); rank\(s\) 0 wait for it in .* for \d+ s; every rank's stacks: (\S+)); --dist-timeout "
                        r"ends the wait$", out, re.M)
    assert verdict and re.search(rf"^1: \[rank 1/2\] {re.escape(verdict.group(2))} cpu gloo", out, re.M), out[-3000:]
    print(verdict.group(1))
    assert (Path(verdict.group(3)) / "verdict.txt").read_text() == verdict.group(1) + "\n"
    assert "(most recent call first)" in next(Path(verdict.group(3)).glob("rank-0-*.txt")).read_text()
    assert out.index(verdict.group(0)) < out.index("error: lost contact with another rank")
    run_dir = tmp_path / "runs" / "frozen"
    assert f"TORCH_NCCL_DEBUG_INFO_TEMP_FILE={run_dir}/hangs/nccl-trace-rank-".encode() in environ
    assert b"TORCH_NCCL_DUMP_ON_TIMEOUT=1" in environ
    assert re.search(r"^ATTEMPT 2/4 after exit \d+ ", out, re.M)
    assert re.search(r"^0: resumed from .*\(attempt 2/4", out, re.M)
    assert [m["epoch"] for m in read_metrics(tmp_path / "runs" / "frozen")] == list(range(1, 9))


def test_a_crash_loop_gives_up_after_max_restarts(one_node, tmp_path):
    """Rank 1 is killed in every attempt: after MAX_RESTARTS=2 restarts the job gives up,
    says so on its END line and exits non-zero."""
    client = one_node.sbatch(tmp_path, ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"],
                             [*FAST, "--epochs", "30"], RUN_NAME="doomed", MAX_RESTARTS="2")

    def killer():
        for attempt in range(1, 4):
            wait_for(tmp_path, r"^0: global batch", attempt)
            signal_rank("doomed", 1, signal.SIGKILL)
    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    client.communicate(timeout=400)
    text = output_of(tmp_path)
    thread.join(timeout=10)
    assert client.returncode not in (0, 1, 2, 3, 75), text[-3000:]
    assert re.findall(r"^ATTEMPT (\d/3) after exit", text, re.M) == ["2/3", "3/3"]
    assert re.search(r"^END .* exit=\d+ gave up after 3 attempts \(rank 1 ended without an exit code.*MAX_RESTARTS=2\)$",
                     text, re.M), text[-2000:]
    assert "to continue from the newest checkpoint" in text


def test_a_rank_that_dies_after_it_finished_and_saved_does_not_fail_the_job(one_node, tmp_path):
    """Rank 1 ends its training with 0, then dies of SIGABRT as Gloo's teardown at exit
    sometimes makes it ("terminate called without an active exception"), after rank 0 too
    recorded 0. srun reports the abort; the job still counts as done, with no restart."""
    wrapper = tmp_path / "python-then-abort"
    wrapper.write_text(f"""#!/bin/bash
"{sys.executable}" "$@"; status=$?
if [[ $status == 0 && $SLURM_PROCID == 1 && " $* " == *mnist_ddp.py* ]]; then
    for _ in $(seq 600); do [[ $(cat "$MNIST_DDP_EXIT_DIR/rank-0" 2>/dev/null) == 0 ]] && break; sleep 0.1; done
    kill -ABRT $$
fi
exit $status
""")
    wrapper.chmod(0o755)
    client = one_node.sbatch(tmp_path, ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"],
                             ["--epochs", "1", "--max-steps", "10"], RUN_NAME="aborted-late", PYTHON=str(wrapper))
    job_id, out = finish(client, tmp_path)
    assert re.search(r"^srun: error: \S+: task 1: Aborted", out, re.M), out[-3000:]
    # 134: rank 1's abort; 143: srun ended rank 0 for it while rank 0 was still shutting down
    assert re.search(r"^every rank had finished and saved \(each recorded exit 0\) before srun's exit 1(34|43) ", out, re.M)
    assert "ATTEMPT" not in out and "to continue from" not in out
    assert re.search(rf"^END .* job={job_id} exit=0$", out, re.M)
    run_dir = tmp_path / "runs" / "aborted-late"
    assert (run_dir / "exit-code").read_text() == "0\n"
    assert (run_dir / "model.pt").exists() and read_metrics(run_dir)[-1]["epoch"] == 1


@pytest.mark.parametrize("args, code", [(["--epochs", "0"], 2), (["--lr", "1e5", "--epochs", "1"], 3)],
                         ids=["usage-error", "diverged"])
def test_usage_errors_and_divergence_are_not_retried(one_node, tmp_path, args, code):
    client = one_node.sbatch(tmp_path, ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"], [*FAST, *args])
    _, out = finish(client, tmp_path, code=code)
    assert "ATTEMPT" not in out and out.count("PREFLIGHT") == 1
    assert re.search(rf"^END .* exit={code}$", out, re.M)
