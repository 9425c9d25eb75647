"""Sweeps as real Slurm job arrays on the shared one-node cluster: a task whose data is
missing fails alone (exit 2) and one stopped with USR1 alone requeues and resumes, a submit
that sbatch refuses records nothing so the fixed one runs, a sweep whose PYTHON exists only
inside a container reads its lines with the host's python3, and the batch file finds the
project from any directory. The 2 x 2 array on two nodes:
tests/cluster/own_clusters/test_sweep_array_on_two_nodes.py.

    python -m pytest tests/cluster/one_node/test_sweep_on_slurm.py
"""

import re
import subprocess
import sys
import time
from pathlib import Path

from helpers.cluster import LOCAL_SLURM, finish
from helpers.images import read_metrics
from helpers.processes import ROOT
from helpers.sweeps import submit, summary


def test_a_bad_task_fails_alone_and_a_stopped_task_resumes_alone(one_node, tmp_path):
    """Task 2's data is missing: exit 2 in its own output file. Task 0 gets SIGUSR1: it saves,
    requeues itself, resumes; the others are not touched and the sweep completes."""
    (tmp_path / "mixed.txt").write_text("--lr 3e-3 --epochs 3 --batch-size 64 --ckpt-every 10\n--lr 1e-3 --epochs 1\n"
                                        "--lr 5e-3 --epochs 1 --dataset folder --data-dir nowhere\n--lr 2e-3 --epochs 1\n")
    client = submit(one_node, tmp_path, "mixed.txt")
    sweep_dir = tmp_path / "runs" / "mixed"
    deadline = time.monotonic() + 300
    while not (logs := list(tmp_path.glob("mixed-*_0.out"))) or not re.search(r"^0: epoch   1 \|", logs[0].read_text(), re.M):
        assert time.monotonic() < deadline and client.poll() is None, "task 0 never finished an epoch"
        time.sleep(0.1)
    array_id = logs[0].name.split("-")[1].split("_")[0]
    subprocess.run([str(LOCAL_SLURM), "exec", str(one_node.dir), "scancel", "--signal=USR1", f"{array_id}_0"],
                   env=one_node.env, check=True, timeout=60)
    _, err = client.communicate(timeout=600)
    # sbatch --wait gives the worst code of the task records it still finds; with the local
    # cluster's MinJobAge=4, task 2's is gone when task 0 ends long after it (requeued), and it
    # says 0. Task 2's own END line and the summary below say what this file proves.
    assert client.returncode in (0, 2), err
    outputs = {t: (tmp_path / f"mixed-{array_id}_{t}.out").read_text() for t in range(4)}
    assert re.search(r"^START .* restart=1 ", outputs[0], re.M) and "resumed from" in outputs[0]
    assert all("restart=1" not in outputs[t] for t in (1, 2, 3))
    errors = [line for line in outputs[2].splitlines() if "mnist_ddp.py" in line and "error" in line]
    assert len(errors) == 1 and errors[0].startswith("0: mnist_ddp.py: error: --data-dir nowhere "), outputs[2][-2000:]
    assert re.search(r"^END .* exit=2$", outputs[2], re.M)
    rows = {r["options"]["lr"]: r for r in summary(sweep_dir)}
    assert rows["5e-3"]["state"] == "failed (exit 2: usage)" and rows["5e-3"]["epochs"] == 0
    assert [rows[lr]["state"] for lr in ("3e-3", "1e-3", "2e-3")] == ["done"] * 3
    assert [m["epoch"] for m in read_metrics(sweep_dir / rows["3e-3"]["run"])] == [1, 2, 3]


def test_a_submit_that_sbatch_refuses_records_nothing_so_the_fixed_one_runs(one_node, tmp_path):
    """sbatch refuses the array (a partition the cluster lacks): submit says so in one line,
    exit 2, and records no submission; the file is then changed and submitted without the
    bad option, and its runs complete."""
    (tmp_path / "lr.txt").write_text("--lr 3e-3 --epochs 1 --max-steps 2\n--lr 1e-3 --epochs 1 --max-steps 2\n")
    out, err = submit(one_node, tmp_path, "lr.txt", "--partition=nope").communicate(timeout=300)
    sweep_dir = tmp_path / "runs" / "lr"
    assert not (sweep_dir / "submitted").exists(), "a refused submission was recorded"
    sbatch_said, ours = err.splitlines()[-2:]
    assert sbatch_said.startswith("sbatch: error: ") and "partition" in sbatch_said, err
    assert ours.startswith("sweep.py: error: sbatch submitted nothing (exit 1, its message above); "), err
    assert "Submitted batch job" not in out
    (tmp_path / "lr.txt").write_text("--lr 2e-3 --epochs 1 --max-steps 2\n--lr 1e-3 --epochs 1 --max-steps 2\n")
    client = submit(one_node, tmp_path, "lr.txt")
    out, err = client.communicate(timeout=600)
    assert client.returncode == 0, err[-3000:]
    assert re.search(r"^Submitted batch job \d+$", out, re.M) and (sweep_dir / "submitted").exists()
    assert {r["options"]["lr"]: r["state"] for r in summary(sweep_dir)} == {"2e-3": "done", "1e-3": "done"}


def test_a_sweep_whose_python_is_inside_a_container_reads_its_lines_on_the_host(one_node, tmp_path):
    """CONTAINER_CMD runs the ranks in a real container runtime (bubblewrap) whose PYTHON
    exists only inside it, and the host has no venv on its PATH: each array task reads its
    line with the host's python3, and the ranks train inside the container."""
    image = tmp_path / "image"  # empty on the host; inside, the venv is mounted there
    image.mkdir()
    venv = Path(sys.executable).parents[1]  # the tests' own
    inside = f"bwrap --dev-bind / / --tmpfs {image} --ro-bind {venv} {image}/venv"
    python = f"{image}/venv/bin/python"
    assert not Path(python).exists()
    seen = subprocess.run([*inside.split(), python, "-c", "import torch, sys; print(sys.executable)"],
                          capture_output=True, text=True, check=True)
    assert seen.stdout.strip() == python
    (tmp_path / "ctr.txt").write_text("--lr 3e-3 --epochs 1 --max-steps 2\n--lr 1e-3 --epochs 1 --max-steps 2\n")
    client = submit(one_node, tmp_path, "ctr.txt", CONTAINER_CMD=inside, PYTHON=python, PATH=one_node.env["PATH"])
    out, err = client.communicate(timeout=600)
    job_id = re.search(r"Submitted batch job (\d+)", out).group(1)
    outputs = [(tmp_path / f"ctr-{job_id}_{task}.out").read_text() for task in range(2)]
    assert client.returncode == 0, err[-2000:] + outputs[0][-3000:]
    for text in outputs:
        assert re.search(rf"^PREFLIGHT python={re.escape(python)} .* container=CONTAINER_CMD=", text, re.M), text[-3000:]
    assert {r["options"]["lr"]: r["state"] for r in summary(tmp_path / "runs" / "ctr")} == {"3e-3": "done", "1e-3": "done"}


def test_the_batch_file_finds_the_project_from_any_directory(one_node, tmp_path):
    """Submitted from a directory that holds neither the script nor a venv: the job finds
    both beside the batch file that was submitted (scontrol names the original)."""
    client = one_node.sbatch(tmp_path, ["--ntasks-per-node=1", "--cpus-per-task=1"], ["--epochs", "1", "--max-steps", "2"],
                             SCRIPT=None, PYTHON=None, VIRTUAL_ENV=None, CONDA_PREFIX=None)
    _, out = finish(client, tmp_path)
    assert f"env=the project's {ROOT}/.venv" in out and f"run={tmp_path}/runs/job-" in out
