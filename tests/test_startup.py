"""Start-up: a default run on staged data imports only what it needs (no torchvision, no
torch._dynamo and what it drags in), says at its first step how long it took to get
there, and FusedAdamW is torch.optim.AdamW(fused=True) bit for bit.

Run: .venv/bin/python -m pytest tests/test_startup.py"""

import copy
import re
import subprocess
import sys

import pytest
import torch

from conftest import SCRIPT, assert_ok, clean_env
from ddpkit.optimizer import FusedAdamW

# What a default run must not load: seconds of imports it never uses (torchvision's models
# import torch._dynamo, which imports sympy and FSDP).
NOT_NEEDED = ("torchvision", "torch._dynamo", "sympy", "torch.distributed.fsdp", "torch._inductor")


def fresh_python(code: str, cwd, *args: str) -> subprocess.CompletedProcess:
    """A new interpreter (not the tests' forkserver, which has torchvision loaded already)."""
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=clean_env(), capture_output=True,
                          text=True, timeout=300)


def test_default_run_on_staged_data_loads_neither_torchvision_nor_dynamo(tmp_path):
    common = ["--epochs", "1", "--max-steps", "3", "--data-dir", str(tmp_path / "data"), "--log-dir", str(tmp_path)]
    assert_ok(subprocess.run([sys.executable, str(SCRIPT), *common, "--download-only"], cwd=tmp_path, env=clean_env(),
                             capture_output=True, text=True, timeout=300))
    code = (f"import sys; sys.path.insert(0, '{SCRIPT.parent}'); import mnist_ddp; code = mnist_ddp.main(sys.argv[1:]); "
            f"print('LOADED', sorted(m for m in {NOT_NEEDED!r} if m in sys.modules)); sys.exit(code)")
    run = fresh_python(code, tmp_path, *common)
    assert_ok(run)
    assert "LOADED []" in run.stdout, run.stdout[-2000:]


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


@pytest.mark.parametrize("weight_decay", [0.0, 5e-4])
def test_fused_adamw_is_torch_adamw_bit_for_bit_and_their_states_load_into_each_other(weight_decay):
    torch.manual_seed(0)
    mine = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(64, 3))
    theirs = copy.deepcopy(mine)
    ours = FusedAdamW(mine.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=weight_decay)
    torchs = torch.optim.AdamW(theirs.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=weight_decay, fused=True)
    x = torch.randn(8, 1, 6, 6)

    def steps(k: int) -> None:
        for i in range(k):
            for optimizer, model in ((ours, mine), (torchs, theirs)):
                optimizer.param_groups[0]["lr"] = 1e-3 * (1 + i % 3)
                optimizer.zero_grad(set_to_none=True)
                model(x).square().mean().backward()
                optimizer.step()
            for a, b in zip(mine.parameters(), theirs.parameters(), strict=True):
                assert torch.equal(a, b)

    steps(4)
    saved_ours, saved_theirs = ours.state_dict(), torchs.state_dict()
    assert saved_ours["param_groups"] == saved_theirs["param_groups"]
    for index, state in saved_theirs["state"].items():
        assert state.keys() == saved_ours["state"][index].keys()
        assert all(torch.equal(state[k], saved_ours["state"][index][k]) for k in state)
    ours.load_state_dict(copy.deepcopy(saved_theirs))
    torchs.load_state_dict(copy.deepcopy(saved_ours))
    steps(3)
    with pytest.raises(ValueError):
        ours.load_state_dict({"state": {}, "param_groups": saved_theirs["param_groups"] * 2})
