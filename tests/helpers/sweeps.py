"""sweep.py as users run it (locally, or `submit` inside a local cluster's namespace), its
summary, and the HParams sessions a real TensorBoard serves from a sweep's runs."""

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from helpers.cluster import LOCAL_SLURM
from helpers.processes import ROOT, clean_env, free_port

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
    from ddpkit.run.runlog import HParams
    return list(HParams.of_run(mnist_ddp.Recipe(), batch_size=128, world_size=1, amp=False).values)


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
