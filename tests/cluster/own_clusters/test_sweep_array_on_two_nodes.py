"""A 2 x 2 sweep submitted as a job array throttled to 2 on the two-node cluster: 4 run
directories, 4 ports, the summary ranked, 4 HParams sessions through TensorBoard's HTTP API,
both also checked while it runs. The other sweeps on Slurm:
tests/cluster/one_node/test_sweep_on_slurm.py.

    python -m pytest tests/cluster/own_clusters/test_sweep_array_on_two_nodes.py
"""

import re
import time

from helpers.sweeps import hparams_sessions, run_sweep, submit, summary


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
