"""ddpkit/jobs.py's printed commands: continue_command (the one builder of "to continue",
"to train it longer", the advice after divergence and the batch file's line after END) and
launcher_words, for single, torchrun (1 and 2 nodes) and Slurm launches, with and without
run_training.sbatch's MNIST_DDP_RESUBMIT; what they leave out, the changes added at the
end, and how an unnamed run is named (under LOG_DIR, or elsewhere).

    python -m pytest tests/unit/test_jobs.py
"""

import shlex
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from ddpkit.job.contract import EXIT_BUG, EXIT_LOST_PEER, EXIT_NODE_FAULT
from ddpkit.jobs import continue_command, failure, launcher_words
from ddpkit.launch import Launch
from ddpkit.options import RunOptions, parse_options
from ddpkit.run.training_run import world_sizes
from mnist_ddp import Recipe

SINGLE = Launch("single", 0, 0, 1, "127.0.0.1", 0, "", 0)
TORCHRUN_1_NODE = Launch("torchrun", 0, 0, 2, "127.0.0.1", 29400, "", 0, local_world_size=2, nodes=1)
TORCHRUN_2_NODES = Launch("torchrun", 0, 0, 4, "node01", 29400, "77", 0, local_world_size=2, nodes=2)
SLURM = Launch("slurm", 0, 0, 4, "node01", 10077, "77", 0, local_world_size=2, nodes=2)
RESUBMIT = "cd /home/ann/mnist && RUN_NAME=lr-sweep sbatch --nodes=2 run_training.sbatch"

PYTHON = shlex.quote(sys.executable)  # the interpreter that runs, not whichever `python` the PATH finds
RECIPE = Recipe(epochs=3, lr=0.01)
# Options a continuation must not repeat (resume, interrupt_at, download_only) next to ones it keeps.
OPTIONS = RunOptions(amp=True, run_name="exp-1", log_dir="logs", resume="ckpt-00000004.pt", interrupt_at="20:USR1",
                     download_only=True, data_dir="/shared/data")


@pytest.fixture(autouse=True)
def started_as_the_script(monkeypatch):
    """As users start it (under pytest, sys.argv[0] is pytest's), outside run_training.sbatch."""
    monkeypatch.setattr(sys, "argv", ["mnist_ddp.py", "--whatever", "was", "typed"])
    monkeypatch.delenv("MNIST_DDP_RESUBMIT", raising=False)


@pytest.mark.parametrize("launch, words", [
    (SINGLE, PYTHON),
    (TORCHRUN_1_NODE, f"{PYTHON} -m torch.distributed.run --standalone --nproc-per-node=2"),
    (TORCHRUN_2_NODES, f"{PYTHON} -m torch.distributed.run [the torchrun options you gave, on each of the 2 nodes]"),
    (SLURM, f"srun --nodes=2 --ntasks=4 {PYTHON}"),
])
def test_launcher_words(launch, words):
    assert launcher_words(launch) == words


@pytest.mark.parametrize("launch", [SINGLE, TORCHRUN_1_NODE, TORCHRUN_2_NODES, SLURM])
def test_continue_command_starts_the_same_ranks_from_the_run_options(launch):
    command = continue_command(RECIPE, OPTIONS, launch, Path("logs/exp-1"))
    assert command == (f"{launcher_words(launch)} mnist_ddp.py --data-dir /shared/data --epochs 3 --lr 0.01 --amp "
                       "--log-dir logs --run-name exp-1")


def test_continue_command_adds_the_changes_at_the_end():
    command = continue_command(RECIPE, OPTIONS, SINGLE, Path("logs/exp-1"), lr="0.00333", allow_changes="")
    assert command == (f"{PYTHON} mnist_ddp.py --data-dir /shared/data --epochs 3 --amp --log-dir logs --run-name exp-1 "
                       "--lr 0.00333 --allow-changes")


def test_continue_command_under_the_batch_file(monkeypatch):
    monkeypatch.setenv("MNIST_DDP_RESUBMIT", RESUBMIT)
    command = continue_command(RECIPE, OPTIONS, SLURM, Path("logs/exp-1"), epochs="7", allow_changes="")
    # The batch file passes LOG_DIR and RUN_NAME itself (and refuses them after its name).
    assert command == f"{RESUBMIT} --data-dir /shared/data --lr 0.01 --amp --epochs 7 --allow-changes"
    unnamed = RunOptions(log_dir="logs")
    assert continue_command(Recipe(), unnamed, SLURM, Path("logs/job-77")) == RESUBMIT
    assert continue_command(Recipe(), RunOptions(run_dir="/scratch/x"), SLURM, Path("/scratch/x")) == RESUBMIT


def test_an_unnamed_run_is_named_by_its_directory(tmp_path):
    logs = tmp_path / "runs"
    options = RunOptions(log_dir=str(logs))
    assert continue_command(Recipe(), options, SINGLE, logs / "20250101-120000") == \
        f"{PYTHON} mnist_ddp.py --log-dir " + shlex.quote(str(logs)) + " --run-name 20250101-120000"
    assert continue_command(Recipe(), RunOptions(), SINGLE, Path("runs/job-77")) == f"{PYTHON} mnist_ddp.py --run-name job-77"
    # Not under LOG_DIR: its path, quoted for the shell.
    assert continue_command(Recipe(), RunOptions(), SINGLE, Path("/data/my runs/x")) == \
        f"{PYTHON} mnist_ddp.py --run-dir '/data/my runs/x'"


def test_a_run_dir_given_is_passed_on_as_it_was():
    options = RunOptions(run_dir="/scratch/ann/exp")
    assert continue_command(Recipe(), options, SINGLE, Path("/scratch/ann/exp")) == \
        f"{PYTHON} mnist_ddp.py --run-dir /scratch/ann/exp"


def test_the_script_as_it_was_started(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/home/ann/mnist ddp/mnist_ddp.py"])
    assert continue_command(Recipe(), RunOptions(run_name="a"), SINGLE, Path("runs/a")) == \
        f"{PYTHON} '/home/ann/mnist ddp/mnist_ddp.py' --run-name a"
    monkeypatch.setattr(sys, "argv", ["-c"])  # not a file: the script's own name
    assert continue_command(Recipe(), RunOptions(run_name="a"), SINGLE, Path("runs/a")) == \
        f"{PYTHON} mnist_ddp.py --run-name a"


def test_the_printed_command_parses_back_to_the_same_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    command = continue_command(RECIPE, OPTIONS, TORCHRUN_1_NODE, Path("logs/exp-1"), epochs="5", allow_changes="")
    words = shlex.split(command)
    recipe, options = parse_options(Recipe, words[words.index("mnist_ddp.py") + 1:])
    assert recipe == Recipe(epochs=5, lr=0.01)
    assert options == RunOptions(amp=True, run_name="exp-1", log_dir="logs", data_dir="/shared/data", allow_changes=True)


def test_the_world_sizes_rank_0_lists_are_those_the_recipe_splits_its_batch_among():
    """The recipe's own rule decides: its global batch of 96 splits among 1, 2, 3, 4, 6 and 8
    of 8 ranks; under --batch-size N per rank any other number of ranks changes the global
    batch, so none but the run's own goes on with the same batches."""
    assert world_sizes(96, 0, 8) == [1, 2, 3, 4, 6, 8]
    assert world_sizes(128, 5, 5) == [5]


def test_a_fault_of_the_ranks_node_is_exit_5_a_lost_peer_4_and_a_bug_1():
    """A CUDA error of the GPU: exit 5, which the batch file restarts (and pins on the node); a
    lost peer 4; the run's own CUDA error (a device-side assert) stays a bug."""
    line, code = failure(RuntimeError("CUDA error: uncorrectable ECC error encountered"), None, None)
    assert code == EXIT_NODE_FAULT and line.startswith("CUDA error: uncorrectable ECC error encountered: a fault of this "
                                                        "rank's node, not of the run (")
    assert failure(RuntimeError("Connection closed by peer"), None, None)[1] == EXIT_LOST_PEER
    assert failure(RuntimeError("CUDA error: device-side assert triggered"), None, None)[1] == EXIT_BUG


@pytest.mark.parametrize("error", [
    RuntimeError("CUDA error: the launch timed out and was terminated\nCUDA kernel errors might be asynchronously "
                 "reported at some other API call, so the stacktrace below might be incorrect."),
    dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with NCCL_DEBUG=INFO "
                          "for details), NCCL version 2.21.5\nncclUnhandledCudaError: Call to CUDA function failed.\n"
                          "Last error:\nCuda failure 'the launch timed out and was terminated'"),
])
def test_a_cuda_error_that_says_timed_out_is_the_runs_own_not_a_lost_peer(error):
    """A kernel that ran past the launch timeout (the display's watchdog) is the run's own, as
    any CUDA error not of the node's GPU (docs/recovery.md): exit 1, not a lost peer's 4, which
    the batch file would restart even with one process."""
    assert failure(error, None, None)[1] == EXIT_BUG


def test_a_recipe_without_an_option_the_kit_reads_stops_in_one_line(capsys):
    """A copier's recipe that renamed --global-batch: exit 2 and one line naming what the kit
    reads by name, before any process group, not an AttributeError in mid-start."""
    from dataclasses import dataclass

    from ddpkit import jobs
    from ddpkit.options import option

    @dataclass(frozen=True)
    class Renamed:
        batch: int = option(128, "images a step", "training")
        batch_size: int = option(0, "per rank", "training")
        epochs: int = option(1, "epochs", "training")
        max_steps: int = option(0, "cap", "training")
        lr: float = option(1e-3, "lr", "training")

        def check(self) -> None:
            pass

    def body(job):
        raise AssertionError("the body ran")

    assert jobs.run_job(body, Renamed, []) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "mnist_ddp.py: error: the recipe's options (Renamed) lack global_batch, which the kit reads by name "
        "(ddpkit/api.py): keep global_batch, batch_size, epochs, max_steps, lr among them")
