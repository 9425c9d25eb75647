"""Sweeps without Slurm: sweep.py writes grids of option lines, runs them one after another,
and summarises them from their run directories; the HParams tab is read back through a real
TensorBoard server's HTTP API. As real Slurm job arrays: tests/cluster/one_node/test_sweep_on_slurm.py
and tests/cluster/own_clusters/test_sweep_array_on_two_nodes.py.

    python -m pytest tests/runs/test_sweep.py
"""

import json

import pytest

import sweep
from helpers.sweeps import hparams_sessions, run_sweep

# ----------------------------------------------------------------------------- option lines

def test_grid_writes_every_combination_and_names_runs_by_what_varies(tmp_path):
    result = run_sweep(["grid", "--lr", "1e-3", "3e-3", "--batch-size", "64", "128", "--epochs", "1", "--amp"], tmp_path)
    lines = result.stdout.splitlines()
    assert lines == ["--lr 1e-3 --batch-size 64 --epochs 1 --amp", "--lr 1e-3 --batch-size 128 --epochs 1 --amp",
                     "--lr 3e-3 --batch-size 64 --epochs 1 --amp", "--lr 3e-3 --batch-size 128 --epochs 1 --amp"]
    runs = [line.split() for line in lines]
    assert sweep.names_of(runs) == ["lr=1e-3,batch-size=64", "lr=1e-3,batch-size=128",
                                    "lr=3e-3,batch-size=64", "lr=3e-3,batch-size=128"]
    assert sweep.names_of([["--seed", "1"], ["--seed", "1"]]) == ["task-0", "task-1"]  # nothing varies
    assert sweep.names_of([["--lr", "1"], ["--lr", "1"], ["--lr", "2"]]) == ["0-lr=1", "1-lr=1", "lr=2"]  # told apart
    bad = run_sweep(["grid", "1e-3"], tmp_path)
    assert bad.returncode == 2 and bad.stderr == "sweep.py: error: grid: values must follow an --option, got '1e-3' first\n"


@pytest.mark.slow
def test_a_sweep_runs_locally_and_its_summary_ranks_the_runs(tmp_path):
    """Without Slurm: two runs one after another, then the table (best first) and --json."""
    (tmp_path / "lr.txt").write_text("# two learning rates\n--lr 3e-3 --max-steps 20 --epochs 1\n\n"
                                     "--lr 1e-5 --max-steps 20 --epochs 1\n")
    result = run_sweep(["run", "lr.txt"], tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    sweep_dir = tmp_path / "runs" / "lr"
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["lr=1e-5", "lr=3e-3"]
    table = run_sweep(["summary", str(sweep_dir)], tmp_path).stdout.splitlines()
    assert table[0].split() == ["#", "lr", "test", "acc", "test", "loss", "train", "loss", "epochs", "wall", "s", "state", "run"]
    assert [line.split()[1] for line in table[1:]] == ["3e-3", "1e-5"]  # best first
    assert all(" done " in line for line in table[1:])
    rows = json.loads(run_sweep(["summary", str(sweep_dir), "--json"], tmp_path).stdout)
    assert [r["run"] for r in rows] == ["lr=3e-3", "lr=1e-5"] and rows[0]["options"] == {"lr": "3e-3"}
    assert rows[0]["test_accuracy"] > rows[1]["test_accuracy"] and rows[0]["epochs"] == 1 and rows[0]["state"] == "done"
    sessions = hparams_sessions(sweep_dir, first=["lr"])
    assert sorted(s["name"] for s in sessions) == ["lr=1e-5", "lr=3e-3"]
