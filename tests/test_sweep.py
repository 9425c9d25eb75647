"""Sweeps: sweep.py writes grids of option lines, runs them one after another without
Slurm, submits them as one real Slurm job array of run_training.sbatch (on the local
two-node cluster), and summarises them from their run directories; the HParams tab is
read back through a real TensorBoard server's HTTP API, also while the sweep runs. A bad
value fails its own task only; SIGUSR1 to one task requeues and resumes that task alone.

    python -m pytest tests/test_sweep.py -s
"""

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import sweep
from conftest import LOCAL_SLURM, ROOT, clean_env, finish, free_port, read_metrics

SWEEP = ROOT / "sweep.py"


def run_sweep(args: list[str], cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SWEEP), *args], cwd=cwd, env=clean_env(**env), capture_output=True,
                          text=True, timeout=timeout)


def hparams_sessions(logdir: Path, first: list[str] | None = None) -> list[dict]:
    """The HParams tab's sessions, from a real TensorBoard on logdir (started and stopped here);
    checks that the tab lists the hparams `first` (those the sweep varies) before the rest."""
    port = free_port()
    server = subprocess.Popen([str(ROOT / "tensorboard.sh"), "--logdir", str(logdir), "--port", str(port)],
                              env=clean_env(PATH=f"{Path(sys.executable).parent}:/usr/bin:/bin"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    body = json.dumps({"experimentName": "", "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE",
                                                                  "STATUS_RUNNING"],
                       "colParams": [], "startIndex": 0, "sliceSize": 100}).encode()
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                request = urllib.request.Request(f"http://127.0.0.1:{port}/data/plugin/hparams/session_groups", body,
                                                 {"Content-Type": "application/json"})
                groups = json.load(urllib.request.urlopen(request, timeout=10))["sessionGroups"]
                experiment = json.load(urllib.request.urlopen(urllib.request.Request(
                    f"http://127.0.0.1:{port}/data/plugin/hparams/experiment", b'{"experimentName": ""}',
                    {"Content-Type": "application/json"}), timeout=10))
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "TensorBoard did not answer"
                time.sleep(0.5)
    finally:
        server.terminate()
        server.communicate(timeout=30)
    names = [h["name"] for h in experiment["hparamInfos"]]
    assert sorted(names) == sorted(sweep_hparams())
    if first is not None:
        assert names[:len(first)] == first, names
    assert [m["name"]["tag"] for m in experiment["metricInfos"]] == ["test/accuracy", "test/loss", "train/loss",
                                                                      "time/seconds_to_best"]
    return [{"name": g["name"], "hparams": g["hparams"],
             "metrics": {m["name"]["tag"]: m["value"] for m in g["metricValues"]}} for g in groups]


def sweep_hparams() -> list[str]:
    import mnist_ddp
    from ddpkit.options import RunOptions
    return list(mnist_ddp.hparams(mnist_ddp.Recipe(), RunOptions(), 1).values)


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


# ----------------------------------------------------------------------------- a job array on Slurm

def submit(cluster, submit_dir: Path, sweep_file: str, *options: str, **env: str) -> subprocess.Popen:
    """python sweep.py submit, inside the cluster's namespace, with sbatch --wait; env: the
    settings the tasks get (the tests' interpreter unless they name another)."""
    env = {**cluster.env, "PYTHON": sys.executable, "PATH": f"{Path(sys.executable).parent}:{cluster.env['PATH']}", **env}
    cmd = [str(LOCAL_SLURM), "exec", str(cluster.dir), sys.executable, str(SWEEP), "submit", sweep_file, *options,
           "--wait", "--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=1", "--mem=1G"]
    return subprocess.Popen(cmd, cwd=submit_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def summary(sweep_dir: Path) -> list[dict]:
    return json.loads(run_sweep(["summary", str(sweep_dir), "--json"], sweep_dir).stdout)


def test_a_two_by_two_sweep_as_a_throttled_job_array(two_nodes, tmp_path):
    grid = run_sweep(["grid", "--lr", "3e-3", "3e-4", "--batch-size", "64", "128", "--epochs", "1"], tmp_path)
    (tmp_path / "lr-bs.txt").write_text(grid.stdout)
    started = time.monotonic()
    client = submit(two_nodes, tmp_path, "lr-bs.txt", "--parallel", "2")
    sweep_dir = tmp_path / "runs" / "lr-bs"
    # While it runs: the summary and the HParams tab show what has been written so far.
    deadline = time.monotonic() + 300
    while not any((d / "run.json").exists() and not (d / "exit-code").exists() for d in sweep_dir.glob("*/")):
        assert time.monotonic() < deadline and client.poll() is None, "no task started"
        time.sleep(0.1)
    running = summary(sweep_dir)
    assert len(running) == 4 and "running" in {r["state"] for r in running} and "pending" in {r["state"] for r in running}
    assert hparams_sessions(sweep_dir), "a running sweep shows no session"
    out, err = client.communicate(timeout=600)
    wall = time.monotonic() - started
    assert client.returncode == 0, err
    job_id = re.search(r"Submitted batch job (\d+)", out).group(1)
    print(f"\n4-task array, 2 at a time on 2 nodes: {wall:.1f} s from submission to the last task's end")
    names = {"lr=3e-3,batch-size=64", "lr=3e-3,batch-size=128", "lr=3e-4,batch-size=64", "lr=3e-4,batch-size=128"}
    assert {p.name for p in sweep_dir.iterdir() if p.is_dir()} == names
    outputs = [(tmp_path / f"lr-bs-{job_id}_{task}.out").read_text() for task in range(4)]
    ports = {re.search(r"^START .* master=\S+:(\d+) ", text, re.M).group(1) for text in outputs}
    assert len(ports) == 4
    rows = summary(sweep_dir)
    assert [r["state"] for r in rows] == ["done"] * 4 and {r["run"] for r in rows} == names
    accuracies = [r["test_accuracy"] for r in rows]
    assert accuracies == sorted(accuracies, reverse=True) and all(r["epochs"] == 1 for r in rows)
    table = run_sweep(["summary", str(sweep_dir)], tmp_path).stdout.splitlines()
    assert table[0].split()[:3] == ["#", "lr", "batch-size"] and len(table) == 5
    sessions = hparams_sessions(sweep_dir, first=["batch_size", "global_batch", "lr"])
    assert {s["name"] for s in sessions} == names
    for s in sessions:
        lr, bs = re.match(r"lr=(\S+),batch-size=(\d+)", s["name"]).groups()
        assert s["hparams"]["lr"] == float(lr) and s["hparams"]["batch_size"] == int(bs) and s["hparams"]["amp"] is False
        assert set(s["metrics"]) == {"test/accuracy", "test/loss", "train/loss", "time/seconds_to_best"}


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
