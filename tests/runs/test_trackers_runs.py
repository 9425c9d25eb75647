"""--tracker against the real thing: an MLflow tracking server the test starts on loopback
with its own SQLite store, and W&B in offline mode read back with W&B's own reader. A run
stopped and continued, then continued on another world size from an older checkpoint, is one
tracker run with every step once and the values of metrics.jsonl; a server stopped in
mid-run stops nothing, is named once, and has every step once it is back; a tracker whose
package is missing, or MLflow's file store, stops the run before it starts; a sqlite:/// store
gets the run, and a server that refuses it is named as an error that does not pass by itself;
the same server spelled another way is the same tracker run; a run rolled back with another
--lr is a new one. (A Slurm job requeued: tests/cluster/one_node/test_tracker_on_slurm.py.)

    python -m pytest tests/runs/test_trackers_runs.py
"""

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers.images import read_metrics
from helpers.processes import ROOT, SCRIPT, assert_ok, clean_env, run_single, run_torchrun
from helpers.trackers import MLflowServer, wandb_history

pytestmark = pytest.mark.slow

EPOCH_FIELDS = {"train/loss": "train_loss", "test/loss": "test_loss", "test/accuracy": "test_accuracy", "train/lr": "lr"}


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """One server for the file's tests in a worker (each run has a name of its own); a test that
    stops it starts it again."""
    server = MLflowServer(tmp_path_factory.mktemp("mlflow"))
    yield server
    server.stop()


def assert_each_epoch_once(server: MLflowServer, run_id: str, run_dir) -> None:
    """Every epoch record of metrics.jsonl is in the MLflow run once, with its values."""
    records = read_metrics(run_dir)
    for tag, field in EPOCH_FIELDS.items():
        assert server.history(run_id, tag) == [(r["step"], pytest.approx(r[field])) for r in records], tag


def test_one_mlflow_run_across_a_stop_a_continuation_and_another_world_size_from_an_older_checkpoint(mlflow_server,
                                                                                                    workdir):
    """2 ranks stopped by USR1 at step 21; 1 rank goes on to step 56 and stops (the tracker has
    the batch loss of step 50); 2 ranks go on from the checkpoint of step 32, so steps 33 to 56
    are trained again: the tracker gets none of them twice. One MLflow run, with the three
    starts, their world sizes and the hyperparameters of the first."""
    common = ["--epochs", "3", "--run-name", "tracked", "--tracker", "mlflow", "--image-every", "0"]
    env = {"MLFLOW_TRACKING_URI": mlflow_server.uri}
    run_dir = workdir / "runs" / "tracked"
    first = run_torchrun(2, [*common, "--interrupt-at", "20:USR1"], workdir, **env)
    assert (run_dir / "exit-code").read_text() == "75\n", first.stderr[-3000:]  # (torchrun itself exits 1)
    assert f"MLflow: {mlflow_server.uri}/#/experiments/0/runs/" in first.stdout
    second = run_single([*common, "--interrupt-at", "55:USR1"], workdir, **env)
    assert second.returncode == 75, second.stderr[-3000:]
    older = run_dir / "checkpoints" / "ckpt-00000032.pt"
    assert older.exists(), sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    third = run_torchrun(2, [*common, "--resume", str(older)], workdir, **env)
    assert_ok(third)
    assert "the tracker MLflow" not in first.stderr + second.stderr + third.stderr  # (never failed)

    run = mlflow_server.run_named("tracked")
    state = json.loads((run_dir / "tracker.json").read_text())
    assert state[f"mlflow {mlflow_server.uri}"]["run_id"] == run.info.run_id and run.info.status == "FINISHED"
    assert run.info.run_name == "tracked"
    assert_each_epoch_once(mlflow_server, run.info.run_id, run_dir)
    assert [step for step, _ in mlflow_server.history(run.info.run_id, "train/batch_loss")] == [50]
    assert [step for step, _ in mlflow_server.history(run.info.run_id, "final/test_accuracy")] == [96]
    tags, params = run.data.tags, run.data.params
    starts = [tags[f"start.{n}"] for n in (1, 2, 3)]
    assert [s.split(", world size ")[1].split(",")[0] for s in starts] == ["2", "1", "2"], starts
    assert [s.split(", from step ")[1].split(",")[0] for s in starts] == ["0", "21", "32"], starts
    assert "start.4" not in tags and tags["world_size"] == "2"
    assert params["world_size"] == "2" and params["lr"] == "0.003" and params["global_batch"] == "128"


def test_a_server_stopped_in_mid_run_stops_nothing_and_gets_every_step_once_back(mlflow_server, workdir):
    """The server goes down after the first epoch reached it, and comes back once the run has
    named it: training goes on, one line names the tracker, the tracker answers again, and the
    run in MLflow has every epoch once. (The run is held with SIGSTOP while the server stops
    and while it starts again, so that epochs are left to train when it is back however slow
    the machine is; its sender, in a session of its own, is not held.)"""
    epochs = 8  # (8 steps an epoch at the global batch of 512, each lasting at least 0.1 s)
    args = ["--epochs", str(epochs), "--global-batch", "512", "--run-name", "flaky", "--tracker", "mlflow",
            "--image-every", "0"]
    out, err = open(workdir / "out.txt", "w+"), open(workdir / "err.txt", "w+")
    run = subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=workdir, stdout=out, stderr=err,
                           env=clean_env(MLFLOW_TRACKING_URI=mlflow_server.uri, AID_STEP_SECONDS="0.1"))
    run_dir = workdir / "runs" / "flaky"

    def wait_for(condition, what: str) -> None:
        deadline = time.monotonic() + 240
        while not condition():
            assert time.monotonic() < deadline and run.poll() is None, f"waited for {what}"
            time.sleep(0.1)

    def in_mlflow() -> bool:
        found = mlflow_server.client().search_runs(["0"], filter_string="attributes.run_name = 'flaky'")
        return bool(found and mlflow_server.history(found[0].info.run_id, "train/loss"))

    wait_for(in_mlflow, "epoch 1 in MLflow")
    os.kill(run.pid, signal.SIGSTOP)
    try:
        assert len(read_metrics(run_dir)) < epochs - 2, "the run was near its end before the server stopped"
        mlflow_server.stop()
        os.kill(run.pid, signal.SIGCONT)
        wait_for(lambda: "warning: the tracker MLflow" in (workdir / "err.txt").read_text(), "the tracker named")
        os.kill(run.pid, signal.SIGSTOP)
        assert len(read_metrics(run_dir)) < epochs, "the run ended before the server was back"
    finally:
        mlflow_server.start()
        os.kill(run.pid, signal.SIGCONT)
    assert run.wait(300) == 0, (workdir / "err.txt").read_text()[-3000:]
    stdout, stderr = (workdir / "out.txt").read_text(), (workdir / "err.txt").read_text()
    assert stderr.count(f"warning: the tracker MLflow at {mlflow_server.uri} failed") == 1, stderr[-3000:]
    assert f"the tracker MLflow at {mlflow_server.uri} answers again" in stdout
    tracked = mlflow_server.run_named("flaky")
    assert [r["epoch"] for r in read_metrics(run_dir)] == list(range(1, epochs + 1))
    assert_each_epoch_once(mlflow_server, tracked.info.run_id, run_dir)


def test_wandb_offline_keeps_one_run_id_and_each_step_once_across_a_stop(workdir):
    """WANDB_MODE=offline: a run stopped at step 40 (the batch loss of steps 10 to 40 sent) and
    continued. Its offline folders, read with W&B's reader, all carry the run id kept in
    tracker.json, and no step is in them twice."""
    common = ["--epochs", "2", "--run-name", "wb", "--tracker", "wandb", "--image-every", "0", "--log-every", "10"]
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    assert run_single([*common, "--interrupt-at", "40:USR1"], workdir, **env).returncode == 75
    assert_ok(run_single(common, workdir, **env))
    run_dir = workdir / "runs" / "wb"
    run_id = json.loads((run_dir / "tracker.json").read_text())["wandb"]["run_id"]
    history = wandb_history(run_dir)
    assert list(history) == [run_id]
    steps = [row["_step"] for row in history[run_id]]
    assert steps == sorted(set(steps)), steps
    losses = [row["_step"] for row in history[run_id] if "train/batch_loss" in row]
    assert losses == [10, 20, 30, 40, 50, 60], losses
    epochs = {row["_step"]: row["test/accuracy"] for row in history[run_id] if "test/accuracy" in row}
    assert epochs == {r["step"]: pytest.approx(r["test_accuracy"]) for r in read_metrics(run_dir)}


def test_a_tracker_whose_package_is_missing_stops_the_run_before_it_starts(workdir):
    """The package hidden from the interpreter (the tests' aid AID_NO_MODULE): exit 2, one line
    with the pip install, and no run directory."""
    result = subprocess.run([sys.executable, str(SCRIPT), "--tracker", "wandb", "--run-name", "none"], cwd=workdir,
                            env=clean_env(AID_NO_MODULE="wandb"), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (f"mnist_ddp.py: error: --tracker wandb needs the wandb package, "
                                                      f"which {sys.executable} lacks: pip install wandb")
    assert not (workdir / "runs").exists() and ROOT.exists()


def test_a_run_whose_tracker_never_answered_gets_it_all_when_started_again(mlflow_server, workdir):
    """The server down for a whole run: the run finishes (exit 0) and names the tracker once.
    Started again once the server is back, the finished run trains nothing and the tracker
    gets every epoch, the final figures and the run's end."""
    args = ["--epochs", "2", "--run-name", "late", "--tracker", "mlflow", "--image-every", "0"]
    mlflow_server.stop()
    try:
        alone = run_single(args, workdir, MLFLOW_TRACKING_URI=mlflow_server.uri)
    finally:
        mlflow_server.start()
    assert_ok(alone)
    assert alone.stderr.count("warning: the tracker MLflow") == 1, alone.stderr[-3000:]
    again = run_single(args, workdir, MLFLOW_TRACKING_URI=mlflow_server.uri)
    assert_ok(again)
    assert "is already complete" in again.stdout and "warning" not in again.stderr, again.stderr[-3000:]
    run = mlflow_server.run_named("late")
    run_dir = workdir / "runs" / "late"
    assert_each_epoch_once(mlflow_server, run.info.run_id, run_dir)
    assert run.info.status == "FINISHED" and run.data.tags["start.1"].startswith("attempt 1/1, world size 1, from step 0")
    assert [step for step, _ in mlflow_server.history(run.info.run_id, "final/test_accuracy")] == [64]
    assert "start.2" not in run.data.tags  # (a finished run's start trains nothing, and is not one of its starts)


def test_mlflows_file_store_is_refused_before_the_run_where_mlflow_refuses_it(workdir):
    """The MLflow installed refuses its file store (3.13 on, without MLFLOW_ALLOW_FILE_STORE): a
    run that asks for one stops before it starts, exit 2, in one line that names what works."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient
    uri = (workdir / "mlruns").as_uri()
    with pytest.raises(MlflowException, match="MLFLOW_ALLOW_FILE_STORE=true"):
        MlflowClient(uri).search_experiments()
    result = subprocess.run([sys.executable, str(SCRIPT), "--tracker", "mlflow", "--run-name", "filed"], cwd=workdir,
                            env=clean_env(MLFLOW_TRACKING_URI=uri), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"mnist_ddp.py: error: --tracker mlflow: MLFLOW_TRACKING_URI={uri} is MLflow's file store, which MLflow "
        f"{importlib.metadata.version('mlflow')} refuses: use a server (http://host:5000) or a database every node "
        "reaches (sqlite:////project/mlflow.db), or export MLFLOW_ALLOW_FILE_STORE=true to keep the file store")
    assert not (workdir / "runs").exists()


def test_a_database_store_gets_the_run_and_a_refusal_is_named_as_one(mlflow_server, workdir):
    """sqlite:////path, which the refusal of a file store names, gets the run's epochs; a server
    that refuses the run (an experiment id it lacks) is named once as an error that does not
    pass by itself, and training goes on."""
    args = ["--epochs", "1", "--image-every", "0", "--tracker", "mlflow"]
    database = f"sqlite:///{workdir / 'mlflow.db'}"
    assert_ok(run_single([*args, "--run-name", "db"], workdir, MLFLOW_TRACKING_URI=database))
    from mlflow.tracking import MlflowClient
    (run,) = MlflowClient(database).search_runs(["0"], filter_string="attributes.run_name = 'db'")
    records = read_metrics(workdir / "runs" / "db")
    assert [(m.step, m.value) for m in MlflowClient(database).get_metric_history(run.info.run_id, "test/accuracy")] == \
        [(r["step"], pytest.approx(r["test_accuracy"])) for r in records] and run.info.status == "FINISHED"
    refused = run_single([*args, "--run-name", "refused"], workdir, MLFLOW_TRACKING_URI=mlflow_server.uri,
                         MLFLOW_EXPERIMENT_ID="424242")
    assert_ok(refused)
    (line,) = [line for line in refused.stderr.splitlines() if "the tracker MLflow" in line]
    assert line.startswith(f"warning: the tracker MLflow at {mlflow_server.uri} refused this run (RestException: "
                           "RESOURCE_DOES_NOT_EXIST: ") and line.endswith(
        "which does not pass by itself: training goes on without it; mend this and start the run again, and the tracker "
        "gets every epoch it missed (from metrics.jsonl)"), line


def test_the_same_server_spelled_another_way_is_the_same_tracker_run(mlflow_server, workdir):
    """Stopped at step 20 with MLFLOW_TRACKING_URI=http://127.0.0.1:PORT, continued with
    http://localhost:PORT/: one MLflow run, FINISHED, with every epoch once, and one entry in
    tracker.json."""
    args = ["--epochs", "1", "--run-name", "respelled", "--tracker", "mlflow", "--image-every", "0"]
    stopped = run_single([*args, "--interrupt-at", "20:USR1"], workdir, MLFLOW_TRACKING_URI=mlflow_server.uri)
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    respelled = mlflow_server.uri.replace("127.0.0.1", "localhost") + "/"
    assert_ok(run_single(args, workdir, MLFLOW_TRACKING_URI=respelled))
    run = mlflow_server.run_named("respelled")
    run_dir = workdir / "runs" / "respelled"
    assert run.info.status == "FINISHED" and "start.2" in run.data.tags
    assert list(json.loads((run_dir / "tracker.json").read_text())) == [f"mlflow {mlflow_server.uri}"]
    assert_each_epoch_once(mlflow_server, run.info.run_id, run_dir)


def test_a_run_rolled_back_with_changed_options_is_a_new_tracker_run(mlflow_server, workdir):
    """A finished run of 2 epochs resumed from its checkpoint of step 32 with --allow-changes
    --lr: a new MLflow run, named for the step it goes on from, has the new timeline's values
    at every step (those of metrics.jsonl), and the first run keeps its own."""
    args = ["--epochs", "2", "--run-name", "rolled", "--tracker", "mlflow", "--image-every", "0"]
    env = {"MLFLOW_TRACKING_URI": mlflow_server.uri}
    assert_ok(run_single(args, workdir, **env))
    run_dir = workdir / "runs" / "rolled"
    first = {r["step"]: r["lr"] for r in read_metrics(run_dir)}
    again = run_single([*args, "--resume", str(run_dir / "checkpoints" / "ckpt-00000032.pt"), "--allow-changes",
                        "--lr", "0.0003"], workdir, **env)
    assert_ok(again)
    assert "MLflow: a new run, 'rolled from step 32', for the steps from 32 on with changed options" in again.stdout
    earlier, later = mlflow_server.run_named("rolled"), mlflow_server.run_named("rolled from step 32")
    assert mlflow_server.history(earlier.info.run_id, "train/lr") == [(s, pytest.approx(lr)) for s, lr in first.items()]
    assert_each_epoch_once(mlflow_server, later.info.run_id, run_dir)
    assert first[64] != pytest.approx(read_metrics(run_dir)[-1]["lr"]) and later.data.params["lr"] == "0.0003"
    assert [step for step, _ in mlflow_server.history(later.info.run_id, "final/test_accuracy")] == [64]
    assert later.info.status == "FINISHED" and later.data.tags["earlier_run"].startswith(earlier.info.run_id)
