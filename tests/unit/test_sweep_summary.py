"""sweep.py's summary table, called in this process (so that `make mutants` sees it): line
by line as printed, and for runs without a sweep file. Sweep files through `python
sweep.py`: tests/runs/test_sweep_files.py.

    python -m pytest tests/unit/test_sweep_summary.py
"""

import json
from pathlib import Path

# ----------------------------------------------------------------------------- the summary, in this process

def write_run(sweep_dir: Path, name: str, records: list[dict], code: int | None = None, requeues: int | None = None) -> None:
    """A run directory as mnist_ddp.py leaves it: its metrics, its exit code once it ended, run.json once it started."""
    run_dir = sweep_dir / name
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    if code is not None:
        (run_dir / "exit-code").write_text(f"{code}\n")
    if requeues is not None:
        (run_dir / "run.json").write_text(json.dumps({"config": {}, "environment": {"slurm_requeues": requeues}}))


def test_the_summary_table_as_printed(tmp_path, capsys):
    """sweep.py's main, called here so that each line of the summary is checked: best test
    accuracy first, then the runs without one in the file's order; the options that vary,
    "-" for one a line leaves out or a number not yet measured, the wall time summed over
    epochs, every state."""
    import sweep

    sweep_dir = tmp_path / "runs" / "lr"
    sweep_dir.mkdir(parents=True)
    (sweep_dir / "sweep.txt").write_text("--lr 1e-3 --batch-size 64\n--lr 3e-3 --batch-size 64\n--lr 1e-2 --amp\n"
                                         "--lr 3e-2\n--lr 1e-1\n")
    write_run(sweep_dir, "lr=1e-3,batch-size=64", [
        {"epoch": 1, "test_accuracy": 0.9, "test_loss": 0.31, "train_loss": 0.42, "epoch_s": 1.25},
        {"epoch": 2, "test_accuracy": 0.95, "test_loss": 0.2, "train_loss": 0.3, "epoch_s": 1.5}], code=0)
    write_run(sweep_dir, "lr=3e-3,batch-size=64", [
        {"epoch": 1, "test_accuracy": 0.97, "test_loss": 0.1, "train_loss": 0.12, "epoch_s": 2}], requeues=2)
    write_run(sweep_dir, "lr=1e-2,amp", [], code=137)
    write_run(sweep_dir, "lr=3e-2", [{"epoch": 1, "test_accuracy": None, "test_loss": None, "train_loss": 0.5}])
    with (sweep_dir / "lr=3e-2" / "metrics.jsonl").open("ab") as metrics:  # a line cut short, a byte that is not UTF-8
        metrics.write(b'{"epoch": 2, "test_accuracy": 0.99, "note": "\xe9"\n{"epoch": 2, "test')
    assert sweep.main(["summary", str(sweep_dir)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "#  lr    batch-size  amp  test acc  test loss  train loss  epochs  wall s  state                                 run",
        "1  3e-3  64          -    97.00%    0.1000     0.1200      1       2.0     requeued (2x), running                "
        "lr=3e-3,batch-size=64",
        "2  1e-3  64          -    95.00%    0.2000     0.3000      2       2.8     done                                  "
        "lr=1e-3,batch-size=64",
        "3  1e-2  -                -         -          -           0       0.0     failed (exit 137: killed by SIGKILL)  "
        "lr=1e-2,amp",
        "4  3e-2  -           -    -         -          0.5000      1       0.0     running                               "
        "lr=3e-2",
        "5  1e-1  -           -    -         -          -           0       0.0     pending                               "
        "lr=1e-1"]
    assert sweep.main(["summary", str(sweep_dir), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[1] == {"run": "lr=1e-3,batch-size=64", "options": {"lr": "1e-3", "batch-size": "64", "amp": None},
                       "test_accuracy": 0.95, "test_loss": 0.2, "train_loss": 0.3, "epochs": 2, "wall_s": 2.8,
                       "state": "done"}
    assert rows[2]["options"] == {"lr": "1e-2", "batch-size": None, "amp": ""}


def test_the_summary_of_runs_without_a_sweep_file(tmp_path, capsys):
    """Without sweep.txt the runs are the directories that hold metrics or an exit code,
    by name; an empty exit-code file counts as a failure; exit codes past the signals'
    are plain failures."""
    import sweep

    sweep_dir = tmp_path / "runs" / "loose"
    for name, code in (("a", None), ("b", 200), ("c", 160), ("d", 192), ("e", 128), ("h", 129), ("i", 193)):
        write_run(sweep_dir, name, [], code=code)
    write_run(sweep_dir, "j", [{"epoch": 1, "test_accuracy": 0.0, "test_loss": float("inf"), "train_loss": float("nan")}],
              code=0)
    write_run(sweep_dir, "k", [{"epoch": 1, "test_accuracy": 0.5, "test_loss": 1.0, "train_loss": 1.1}], code=0)
    write_run(sweep_dir, "l", [], requeues=None)
    (sweep_dir / "l" / "run.json").write_text(json.dumps({"config": {}, "environment": {}}))  # (not under Slurm)
    (sweep_dir / "f").mkdir()
    (sweep_dir / "f" / "exit-code").write_text("\n")
    (sweep_dir / "g").mkdir()
    (sweep_dir / "g" / "exit-codes").mkdir()
    (sweep_dir / "not-a-run").mkdir()
    assert sweep.main(["summary", str(sweep_dir), "--json"]) == 0
    states = {row["run"]: (row["state"], row["options"], row["epochs"]) for row in json.loads(capsys.readouterr().out)}
    assert states == {"a": ("running", {}, 0), "b": ("failed (exit 200)", {}, 0), "c": ("failed (exit 160)", {}, 0),
                      "d": ("failed (exit 192: killed by SIGRTMAX)", {}, 0), "e": ("failed (exit 128)", {}, 0),
                      "f": ("failed (exit 1: a bug)", {}, 0), "g": ("running", {}, 0),
                      "h": ("failed (exit 129: killed by SIGHUP)", {}, 0), "i": ("failed (exit 193)", {}, 0),
                      "j": ("done", {}, 1), "k": ("done", {}, 1), "l": ("running", {}, 0)}
    assert sweep.main(["summary", str(sweep_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["#", "test", "acc", "test", "loss", "train", "loss", "epochs", "wall", "s", "state", "run"]
    assert lines[1].split() == ["1", "50.00%", "1.0000", "1.1000", "1", "0.0", "done", "k"]
    assert lines[2].split() == ["2", "0.00%", "inf", "nan", "1", "0.0", "done", "j"]
    # One run; none at all; a sweep file an older sweep.py copied with --run-name in it.
    write_run(tmp_path / "runs" / "one", "x", [], code=0)
    assert sweep.main(["summary", str(tmp_path / "runs" / "one")]) == 0
    assert capsys.readouterr().out.splitlines()[1].split() == ["1", "-", "-", "-", "0", "0.0", "done", "x"]
    (tmp_path / "runs" / "none").mkdir()
    assert sweep.main(["summary", str(tmp_path / "runs" / "none")]) == 0
    assert capsys.readouterr().out == "#  test acc  test loss  train loss  epochs  wall s  state  run\n"
    (tmp_path / "runs" / "old").mkdir()
    (tmp_path / "runs" / "old" / "sweep.txt").write_text("--lr 1e-3 --run-name a\n--lr 3e-3\n")
    assert sweep.main(["summary", str(tmp_path / "runs" / "old"), "--json"]) == 0
    assert [row["state"] for row in json.loads(capsys.readouterr().out)] == ["pending", "pending"]
    assert sweep.main(["summary", str(tmp_path / "runs" / "nothing")]) == 2
    assert capsys.readouterr().err == (f"sweep.py: error: {tmp_path / 'runs' / 'nothing'}: no such sweep directory; "
                                       "pass LOG_DIR/NAME, e.g. runs/lr-bs\n")
