"""What a run costs besides training itself, at start-up: a default run on staged data
imports only what it needs (no torchvision), and says at its first step how long it took to
get there. What each step dispatches: tests/unit/test_step_operations.py.

Run: .venv/bin/python -m pytest tests/runs/test_overhead.py"""

import re
import subprocess
import sys

import pytest

from helpers.processes import SCRIPT, assert_ok, clean_env

# What a default run must not load: seconds of imports it never uses. (torch.optim's AdamW
# imports torch._dynamo, and with it sympy and FSDP: about a second, in the `ready in`
# line's "the rest".)
NOT_NEEDED = ("torchvision",)


def fresh_python(code: str, cwd, *args: str) -> subprocess.CompletedProcess:
    """A new interpreter (not the tests' forkserver, which has torchvision loaded already)."""
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=clean_env(), capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow
def test_default_run_on_staged_data_does_not_load_torchvision(tmp_path):
    common = ["--epochs", "1", "--max-steps", "3", "--data-dir", str(tmp_path / "data"), "--log-dir", str(tmp_path)]
    assert_ok(subprocess.run([sys.executable, str(SCRIPT), *common, "--download-only"], cwd=tmp_path, env=clean_env(),
                             capture_output=True, text=True, timeout=300))
    code = (f"import sys; sys.path.insert(0, '{SCRIPT.parent}'); import mnist_ddp; code = mnist_ddp.main(sys.argv[1:]); "
            f"print('LOADED', sorted(m for m in {NOT_NEEDED!r} if m in sys.modules)); sys.exit(code)")
    run = fresh_python(code, tmp_path, *common)
    assert_ok(run)
    assert "LOADED []" in run.stdout, run.stdout[-2000:]


@pytest.mark.slow
def test_the_first_step_says_how_long_start_up_took(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--max-steps", "2", "--data-dir", str(tmp_path / "data"),
                          "--log-dir", str(tmp_path)], cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                         timeout=300)
    assert_ok(run)
    ready = [line for line in run.stdout.splitlines() if line.startswith("ready in ")]
    assert len(ready) == 1, run.stdout
    match = re.fullmatch(r"ready in ([\d.]+) s \(imports ([\d.]+) s, process group ([\d.]+) s, data ([\d.]+) s, "
                         r"the rest ([\d.]+) s\)", ready[0])
    assert match, ready[0]
    total, *parts = map(float, match.groups())
    assert parts[0] > 0 and abs(sum(parts) - total) < 0.01 * len(parts)  # (each figure rounded to 0.01 s)
    lines = run.stdout.splitlines()
    assert lines.index(ready[0]) < next(i for i, line in enumerate(lines) if line.startswith("epoch "))
