"""A real MLflow tracking server of a test's own, on loopback with its own SQLite store, and
what a tracker holds, read back with each tracker's own reader: MLflow's client, and W&B's
reader of its offline files."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from helpers.processes import clean_env, free_port


class MLflowServer:
    """`mlflow server` on 127.0.0.1, its store in `folder`; stop() and start() again keep both."""

    def __init__(self, folder: Path):
        self.folder, self.port = folder, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log = folder / "server.log"
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
                 "--backend-store-uri", f"sqlite:///{self.folder / 'mlflow.db'}",
                 "--default-artifact-root", str(self.folder / "artifacts")],
                cwd=self.folder, env=clean_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"mlflow server ended: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise AssertionError(f"mlflow server did not answer within 120 s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)

    def client(self):
        from mlflow.tracking import MlflowClient
        return MlflowClient(self.uri)

    def runs(self, experiment: str = "") -> list:
        """Every run of the experiment named `experiment`, or of MLflow's Default."""
        found = self.client().get_experiment_by_name(experiment) if experiment else None
        return self.client().search_runs([found.experiment_id if found else "0"])

    def run_named(self, name: str):
        """The one run of MLflow's Default experiment with this name (several: an error)."""
        (run,) = self.client().search_runs(["0"], filter_string=f"attributes.run_name = '{name}'")
        return run

    def history(self, run_id: str, key: str) -> list[tuple[int, float]]:
        """(step, value) of each point of the metric `key`, in step order."""
        return sorted((m.step, m.value) for m in self.client().get_metric_history(run_id, key))


def wandb_history(run_dir: Path) -> dict[str, list[dict]]:
    """The history rows (each a dict with its _step) of each offline W&B folder of the run, by
    that folder's run id, as W&B's own reader of its .wandb files prints them (`wandb leet
    inspect --json`)."""
    wandb = Path(sys.executable).parent / "wandb"
    found: dict[str, list[dict]] = {}
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        printed = subprocess.run([str(wandb), "leet", "inspect", "--json", str(folder)], capture_output=True, text=True,
                                 timeout=120, check=True).stdout
        records = [json.loads(line) for line in printed.splitlines() if line.startswith("{")]
        (run_id,) = {r["run"]["run_id"] for r in records if r["type"] == "run"}
        found.setdefault(run_id, []).extend(r["history"]["item"] for r in records if r["type"] == "history")
    return found
