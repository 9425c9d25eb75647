"""--deterministic in a real run's process: it turns on cuDNN's deterministic mode (and off
its benchmark), torch's deterministic algorithms and CUBLAS_WORKSPACE_CONFIG (and they stay
off without it); a run that meets an operation without a deterministic implementation stops
in one line naming it; a CUDA error that says "timed out" (a kernel past the launch timeout)
is the run's own (exit 1), not a lost peer (4); a run on two ranks leaves none of torch's
threads to its interpreter's exit. The device decisions at unit level: tests/unit/test_distributed.py.

    python -m pytest tests/runs/test_distributed_runs.py
"""

import json
import re

import pytest

from helpers.processes import assert_ok, run_python, run_torchrun


def test_deterministic_sets_cudnn_cublas_and_torchs_deterministic_algorithms(tmp_path):
    """In a real run's process: --deterministic turns all three on (and they stay off without it)."""
    code = ("import json, os, sys, torch, mnist_ddp; code = mnist_ddp.main(sys.argv[1:]); "
            "print('SETTINGS', json.dumps([torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, "
            "torch.are_deterministic_algorithms_enabled(), os.environ.get('CUBLAS_WORKSPACE_CONFIG')])); sys.exit(code)")
    seen = {}
    for flag in ([], ["--deterministic"]):
        result = run_python(["--max-steps", "2", "--run-dir", f"run{len(flag)}", *flag], tmp_path, code=code)
        assert result.returncode == 0, result.stderr
        seen[bool(flag)] = json.loads(result.stdout.split("SETTINGS ")[1])
    assert seen[True] == [True, False, True, ":4096:8"]
    assert seen[False][2] is False and seen[False][3] is None


def test_deterministic_run_that_meets_such_an_operation_stops_in_one_line(tmp_path):
    """A user's step that uses an operation without a deterministic implementation: exit 2,
    one line that names it, no traceback."""
    code = ("import sys, torch, mnist_ddp\n"
            "step = mnist_ddp.train_step\n"
            "def my_step(*args, **kwargs):\n"
            "    torch.zeros(3).put_(torch.tensor([0]), torch.ones(1))\n"
            "    return step(*args, **kwargs)\n"
            "mnist_ddp.train_step = my_step\n"
            "sys.exit(mnist_ddp.main(sys.argv[1:]))\n")
    result = run_python(["--max-steps", "2", "--deterministic", "--run-dir", "run"], tmp_path, code=code)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "mnist_ddp.py: error: --deterministic: put_ has no deterministic implementation on cpu, so this run cannot be "
        "bit-identical; leave out --deterministic, or change the model or step that uses it")
    assert "Traceback" not in result.stderr


def test_a_cuda_launch_timeout_in_a_step_is_the_runs_own_error_not_a_lost_peer(tmp_path):
    """The step raises what torch raises for a kernel past the launch timeout: exit 1 with its
    traceback, as any CUDA error that is not the node's GPU's (docs/recovery.md), never the
    lost peer's 4 that the batch file would restart, here with no peer at all."""
    code = ("import sys, mnist_ddp\n"
            "def my_step(*args, **kwargs):\n"
            "    raise RuntimeError('CUDA error: the launch timed out and was terminated\\nCUDA kernel errors might be '\n"
            "                       'asynchronously reported at some other API call')\n"
            "mnist_ddp.train_step = my_step\n"
            "sys.exit(mnist_ddp.main(sys.argv[1:]))\n")
    result = run_python(["--max-steps", "2", "--run-dir", "run"], tmp_path, code=code)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "lost contact" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "mnist_ddp.py: error: unexpected RuntimeError (the traceback above): not restarted, as it would happen again")


@pytest.mark.slow
def test_a_training_run_on_two_ranks_leaves_none_of_torchs_threads_to_its_interpreters_exit(tmp_path):
    """A run that ended well on two Gloo ranks: as each rank's interpreter begins to exit, none of
    torch's native threads is left (Gloo's loop and workers), which could take the interpreter's
    lock during its finalization and abort a finished run (SIGABRT, "terminate called without an
    active exception", exit 1). The first optimizer's import of torch's compiler kept them alive
    past destroy_process_group when the group existed before it (the aid AID_THREADS_AT_EXIT
    names them)."""
    result = run_torchrun(2, ["--max-steps", "2", "--run-dir", "run"], tmp_path, AID_THREADS_AT_EXIT="1")
    assert_ok(result)
    left = re.findall(r"^aid: rank (\d) threads at exit: (.*)$", result.stderr, re.M)
    assert sorted(rank for rank, _ in left) == ["0", "1"], result.stderr[-3000:]
    for rank, threads in left:
        assert not [name for name in threads.split() if name.startswith(("gloo", "pt_"))], (rank, threads)
