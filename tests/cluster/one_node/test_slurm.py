"""run_training.sbatch on a real Slurm 22.05 that the tests start with local-slurm.sh: the
one node on the host's network that this group shares (two jobs at once sharing a data
directory, SIGUSR1, requeues, environments, containers). Also: the guard outside Slurm, the helper that prints torchrun commands (run for
real), and bash -n plus shellcheck on every script. Two nodes in network namespaces, and the
clusters a test starts for itself: tests/cluster/own_clusters/test_slurm_on_own_clusters.py; the
time limit: tests/cluster/mostly_waiting/test_time_limit_on_slurm.py.

Needs root, Slurm, munge and shellcheck (`./local-slurm.sh install`, which `make test`
runs). A missing Slurm fails these tests; it does not skip them.

    python -m pytest tests/cluster/one_node/test_slurm.py
"""

import gzip
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.cluster import LOCAL_SLURM, SBATCH_FILE, finish, usr1_saves_requeues_and_resumes, wait_for_epoch_1
from helpers.images import SAMPLE, make_image_folder, read_metrics
from helpers.processes import ROOT, clean_env

SHELL_SCRIPTS = [LOCAL_SLURM, SBATCH_FILE, ROOT / "torchrun_commands.sh", ROOT / "tensorboard.sh", ROOT / ".ci" / "run"]


def test_two_tasks_on_one_node(one_node, tmp_path):
    client = one_node.sbatch(tmp_path, ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"], ["--batch-size", "64"],
                             TMPDIR=str(tmp_path))
    job_id, out = finish(client, tmp_path)
    assert f'"inductor_cache_dir": "{tmp_path}/mnist-ddp-{job_id}/inductor"' in out  # (--compile's, on the node's $TMPDIR)
    start = re.search(r"^START .* tasks=2 launcher=srun master=127\.0\.0\.1:(\d+) threads=1 run=(\S+)$", out, re.M)
    assert start and int(start.group(1)) == 10000 + int(job_id) % 20000
    assert start.group(2) == f"{tmp_path}/runs/job-{job_id}"
    assert re.search(r"^0: \[rank 0/2\] ", out, re.M) and re.search(r"^1: \[rank 1/2\] ", out, re.M)  # srun --label
    assert f"PREFLIGHT python={sys.executable} torch=" in out and "cpus_per_task=1 env=PYTHON=" in out
    assert f"job={job_id} exit=0" in out
    run_dir = tmp_path / "runs" / f"job-{job_id}"
    assert out.count("TensorBoard logs:") == 1 and len(list(run_dir.glob("events.out.tfevents.*"))) == 1
    metrics = read_metrics(run_dir)
    assert len(metrics) == 8 and metrics[-1]["test_accuracy"] >= 0.95 and metrics[-1]["test_images"] == 1000


def test_two_jobs_at_once_share_a_node_and_a_data_dir(one_node, tmp_path):
    options = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"]
    args = ["--epochs", "2", "--max-steps", "40"]
    clients = [one_node.sbatch(tmp_path, options, args) for _ in range(2)]
    (job_a, out_a), (job_b, out_b) = (finish(c, tmp_path) for c in clients)
    port = {job: re.search(r"master=\S+:(\d+)", out).group(1) for job, out in ((job_a, out_a), (job_b, out_b))}
    assert port[job_a] != port[job_b]
    # They really ran at the same time: each started before the other ended.
    times = {job: (re.search(r"^START (\S+)", out, re.M).group(1), re.search(r"^END (\S+)", out, re.M).group(1))
             for job, out in ((job_a, out_a), (job_b, out_b))}
    assert times[job_a][0] <= times[job_b][1] and times[job_b][0] <= times[job_a][1]
    assert (out_a + out_b).count("staged MNISTSample") == 1
    raw = tmp_path / "data" / "MNISTSample" / "raw"
    for name in ("train-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        assert (raw / name).read_bytes() == gzip.decompress((SAMPLE / f"{name}.gz").read_bytes())
    for job in (job_a, job_b):
        assert read_metrics(tmp_path / "runs" / f"job-{job}")[-1]["epoch"] == 2


@pytest.mark.parametrize("cluster, launcher", [("one_node", "srun")])  # ("two_nodes", "torchrun"): own_clusters/
def test_usr1_saves_requeues_and_resumes(cluster, launcher, request, tmp_path):
    usr1_saves_requeues_and_resumes(request.getfixturevalue(cluster), launcher, tmp_path)


def test_a_requeued_job_runs_the_code_it_was_submitted_with(one_node, tmp_path):
    """A job copies the code it runs at its first start. Its project's mnist_ddp.py is then
    edited so that it fails, and USR1 stops the job: the requeued job resumes from its copy
    and finishes with exit 0. A new job of the run takes a new copy (the edited code, which
    fails) and says in one line that its code differs from the previous job's."""
    project, submit = tmp_path / "project", tmp_path / "submit"
    project.mkdir()
    shutil.copy(ROOT / "mnist_ddp.py", project)
    shutil.copytree(ROOT / "ddpkit", project / "ddpkit", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(SBATCH_FILE, project)
    (project / "data").symlink_to(ROOT / "data")  # (the bundled sample)
    options = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"]
    client = one_node.sbatch(submit, options, ["--batch-size", "64", "--epochs", "3", "--ckpt-every", "10"],
                             batch_file=project / "run_training.sbatch", SCRIPT=None, RUN_NAME="pinned")
    job_id = wait_for_epoch_1(client, submit)
    (project / "mnist_ddp.py").write_text('raise SystemExit("edited while the job ran")\n')
    subprocess.run([str(LOCAL_SLURM), "exec", str(one_node.dir), "scancel", "--signal=USR1", job_id],
                   env=one_node.env, check=True, timeout=60)
    _, out = finish(client, submit)
    copy = submit / "runs" / "pinned" / "code" / f"job-{job_id}"
    assert len(re.findall(rf"^PREFLIGHT python=.* code={re.escape(str(copy))} container=none$", out, re.M)) == 2, out[:3000]
    assert re.search(rf"^requeueing Slurm job {job_id} after SIGUSR1; ", out, re.M)
    assert re.search(r"^START .* restart=1 ", out, re.M)
    assert re.search(r"^0: resumed from \S+/runs/pinned/checkpoints/ckpt-\d+\.pt: epoch ", out, re.M)
    assert re.search(rf"^END .* job={job_id} exit=0$", out, re.M) and "edited while the job ran" not in out
    assert [m["epoch"] for m in read_metrics(submit / "runs" / "pinned")] == [1, 2, 3]
    assert (copy / "mnist_ddp.py").read_bytes() == (ROOT / "mnist_ddp.py").read_bytes()
    client = one_node.sbatch(submit, options, ["--batch-size", "64", "--epochs", "4"],
                             batch_file=project / "run_training.sbatch", SCRIPT=None, RUN_NAME="pinned")
    again, out = finish(client, submit, code=1)
    assert f"code: this job runs code that differs from job-{job_id}'s ({copy}): mnist_ddp.py\n" in out
    assert "edited while the job ran" in out


def test_ranks_in_a_container_without_scontrol_are_requeued_from_the_host(one_node, tmp_path):
    """CONTAINER_CMD runs every rank inside a real container runtime (bubblewrap), where
    scontrol is hidden: on USR1 the ranks save and end the step with 75, the batch shell
    requeues the job on the host, and the job resumes inside the container and completes."""
    scontrol = shutil.which("scontrol")
    inside = f"bwrap --dev-bind / / --ro-bind /dev/null {scontrol}"
    seen = subprocess.run([*inside.split(), sys.executable, "-c", "import shutil; print(shutil.which('scontrol'))"],
                          capture_output=True, text=True, check=True)
    assert seen.stdout.strip() == "None"  # the container really has no scontrol
    client = one_node.sbatch(tmp_path, ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"],
                             ["--batch-size", "64", "--epochs", "3", "--ckpt-every", "10"], CONTAINER_CMD=inside)
    job_id = wait_for_epoch_1(client, tmp_path)
    subprocess.run([str(LOCAL_SLURM), "exec", str(one_node.dir), "scancel", "--signal=USR1", job_id],
                   env=one_node.env, check=True, timeout=60)
    _, out = finish(client, tmp_path)
    assert re.search(rf"^PREFLIGHT python=.* container=CONTAINER_CMD={re.escape(inside)}$", out, re.M), out[:2000]
    assert re.search(r"^0: stopping on SIGUSR1 at step \d+: saved ", out, re.M)
    assert "0: run_training.sbatch requeues the job when this step has ended; where it cannot, the line below continues the run" in out
    assert re.search(rf"^requeueing Slurm job {job_id} after SIGUSR1; ", out, re.M)
    assert re.search(r"^START .* restart=1 ", out, re.M)
    assert re.search(rf"^0: resumed from \S+/runs/job-{job_id}/checkpoints/ckpt-\d+\.pt: epoch ", out, re.M)
    assert [m["epoch"] for m in read_metrics(tmp_path / "runs" / f"job-{job_id}")] == [1, 2, 3]


def test_guard_outside_slurm(tmp_path):
    result = subprocess.run(["bash", str(SBATCH_FILE)], cwd=tmp_path, env=clean_env(), capture_output=True, text=True)
    assert result.returncode == 2
    assert "run_training.sbatch: error: not inside a Slurm job. Submit it: sbatch run_training.sbatch" in result.stderr


def test_printed_torchrun_commands_run(tmp_path):
    """Two 'machines' on this one, each running the line printed for it."""
    env = clean_env(SCRIPT=str(ROOT / "mnist_ddp.py"), PORT=str(29000 + os.getpid() % 1000), RUN_ID="t",
                    PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    printed = subprocess.run([str(ROOT / "torchrun_commands.sh"), "2", "1", "127.0.0.1", "--max-steps", "4",
                              "--epochs", "1", "--run-dir", "runs/helper"], env=env, capture_output=True, text=True, check=True)
    lines = [line for line in printed.stdout.splitlines() if not line.startswith("#")]
    assert len(lines) == 2 and all("--node-rank=" in line for line in lines)
    machines = [subprocess.Popen(["bash", "-c", line], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for line in lines]
    outputs = [m.communicate(timeout=300)[0] for m in machines]
    assert [m.returncode for m in machines] == [0, 0], outputs
    assert read_metrics(tmp_path / "runs" / "helper")[0]["step"] == 4


def test_first_start_options_stay_with_the_first_start_and_the_line_after_end_runs_as_printed(one_node, tmp_path):
    """A project and a submit directory whose paths have a space; Emacs' lock .#mnist_ddp.py (a
    dangling link) in the project; run names that start with a dash; NODE_DATA_DIR quoted as
    docs/clusters.md says. Job A, --resume never, is preempted at step 10 (--interrupt-at):
    the requeued job continues the run from its own checkpoint, neither refusing it nor
    stopping there again. Job B fine-tunes from A's checkpoint (--resume PATH), may not
    requeue, and stops with 75: the line after END sets each setting as given (not
    OMP_NUM_THREADS, which the job set itself), leaves the first start's options out, and,
    run as printed by bash, resumes B's run from B's own checkpoint."""
    project, submit, node_tmp = tmp_path / "my project", tmp_path / "sub dir", tmp_path / "node tmp"
    project.mkdir()
    node_tmp.mkdir()
    shutil.copy(ROOT / "mnist_ddp.py", project)
    shutil.copytree(ROOT / "ddpkit", project / "ddpkit", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(SBATCH_FILE, project)
    (project / "data").symlink_to(ROOT / "data")  # (the bundled sample)
    (project / ".#mnist_ddp.py").symlink_to("ann@login1.4242:1764000000")
    options = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"]
    job = {"batch_file": project / "run_training.sbatch", "SCRIPT": None, "NODE_DATA_DIR": "$TMPDIR/data",
           "TMPDIR": str(node_tmp)}
    client = one_node.sbatch(submit, options, ["--batch-size", "64", "--epochs", "1", "--resume", "never",
                                               "--interrupt-at", "10:USR1"], RUN_NAME="-lr3", **job)
    job_a, out = finish(client, submit)
    assert re.search(rf"^requeueing Slurm job {job_a} after SIGUSR1; ", out, re.M), out[-3000:]
    assert re.search(r"^START .* restart=1 ", out, re.M) and out.count("0: stopping on SIGUSR1") == 1
    assert re.search(rf"^0: resumed from {submit}/runs/-lr3/checkpoints/ckpt-000000\d\d\.pt: epoch 1", out, re.M)
    assert not (submit / "runs" / "-lr3" / "checkpoints" / "superseded").exists()
    assert [m["epoch"] for m in read_metrics(submit / "runs" / "-lr3")] == [1]
    assert (node_tmp / "data").is_dir() and not (submit / "runs" / "-lr3" / "code" / f"job-{job_a}" / ".#mnist_ddp.py").exists()
    base = sorted((submit / "runs" / "-lr3" / "checkpoints").glob("ckpt-*.pt"))[-1]
    client = one_node.sbatch(submit, ["--no-requeue", *options], ["--batch-size", "64", "--epochs", "2", "--resume",
                                                                  str(base), "--allow-changes", "--interrupt-at", "40:TERM"],
                             RUN_NAME="-ft", **job)
    job_b, out = finish(client, submit, code=75)
    line = re.search(r"^to continue from the newest checkpoint, from (.*?): (\S+=.*)$", out, re.M)
    assert line and shlex.split(line.group(1)) == [str(submit)], out[-3000:]
    command = line.group(2)
    assert "NODE_DATA_DIR='$TMPDIR/data'" in command and f"SHARED_DIR='{submit}'" in command, command
    assert "RUN_NAME=-ft " in command and not re.search(r"OMP_NUM_THREADS|--resume|--interrupt-at", command), command
    # As printed, through a shell, in the submit directory it names (`--wait` only makes the test wait).
    again = subprocess.run([str(LOCAL_SLURM), "exec", str(one_node.dir), "bash", "-c",
                            command.replace(" sbatch ", " sbatch --wait ", 1)], cwd=submit,
                           env={**one_node.env, "TMPDIR": str(node_tmp)}, capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, again.stdout + again.stderr
    job_c = re.search(r"Submitted batch job (\d+)", again.stdout).group(1)
    text = (submit / f"mnist-ddp-{job_c}.out").read_text()
    assert re.search(r"^START .* threads=1 ", text, re.M), text[:2000]
    resumed = rf"^0: resumed from {submit}/runs/-ft/checkpoints/ckpt-000000[45]\d\.pt: epoch 2"
    assert re.search(resumed, text, re.M), text[-3000:]
    assert [m["epoch"] for m in read_metrics(submit / "runs" / "-ft")] == [2]


def test_check_times_a_model_of_ones_own_on_an_image_folders_shape_and_passes(one_node, tmp_path):
    """CHECK=1 with a copy of the project whose default model is one of its own for 3-channel
    32 x 32 images (a name in MODELS and its branch in build_model, as docs/adapt.md says), on
    a folder of such images: every rank times that model on that shape, and the check passes."""
    project, submit = tmp_path / "project", tmp_path / "submit"
    project.mkdir()
    shutil.copytree(ROOT / "ddpkit", project / "ddpkit", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(SBATCH_FILE, project)
    recipe = (ROOT / "mnist_ddp.py").read_text()
    for old, new in (('MODELS = (', 'MODELS = ("cifar", '), ('model: str = kit.option("cnn",', 'model: str = kit.option("cifar",'),
                     ("    channels, height, width = shape\n",
                      "    channels, height, width = shape\n"
                      '    if recipe.model == "cifar":\n'
                      "        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),\n"
                      "                             nn.Linear(8 * 16 * 16, classes))\n")):
        assert recipe.count(old) == 1, old
        recipe = recipe.replace(old, new)
    (project / "mnist_ddp.py").write_text(recipe)
    folder = make_image_folder(tmp_path / "images", {"train": 8, "test": 4})
    client = one_node.sbatch(submit, ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"],
                             ["--dataset", "folder", "--data-dir", str(folder)], batch_file=project / "run_training.sbatch",
                             SCRIPT=None, CHECK="1")
    job_id, out = finish(client, submit)
    assert re.search(r"^0: check: a training step of the recipe's model \(cifar, 128 images of 3 x 32 x 32\) takes [\d.]+ ms ",
                     out, re.M), out[-3000:]
    assert re.search(rf"^END .* job={job_id} exit=0 \(CHECK=1: nothing was trained\)$", out, re.M), out[-3000:]


def test_conda_env_and_setup_file(one_node, tmp_path):
    """A conda environment (a prefix with bin/python and conda-meta/, no bin/activate),
    named by CONDA_ENV, after the site's setup file; the PREFLIGHT line says which ran."""
    env_dir = tmp_path / "conda-env"
    (env_dir / "bin").mkdir(parents=True)
    (env_dir / "conda-meta").mkdir()
    (env_dir / "bin" / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (env_dir / "bin" / "python").chmod(0o755)
    (env_dir / "bin" / "python3").symlink_to("python")
    setup = tmp_path / "cluster-env.sh"
    setup.write_text("# stands for: module load python\nexport SITE_MODULES_LOADED=yes\n")
    client = one_node.sbatch(tmp_path, ["--ntasks-per-node=1", "--cpus-per-task=1"], ["--epochs", "1", "--max-steps", "2"],
                             PYTHON=None, CONDA_ENV=str(env_dir), SHARED_DIR=str(tmp_path))
    _, out = finish(client, tmp_path)
    assert f"env=CONDA_ENV={env_dir}, after sourcing SETUP={setup}" in out and "PREFLIGHT python=" in out


def test_environment_without_torch_fails_before_srun(one_node, tmp_path):
    """A venv without torch: one line and exit code 2 from the batch file, no rank started."""
    venv = tmp_path / "empty-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, env=clean_env())
    client = one_node.sbatch(tmp_path, ["--ntasks-per-node=2", "--cpus-per-task=1"], [], PYTHON=None, VENV=str(venv))
    _, out = finish(client, tmp_path, code=2)
    errors = [line for line in out.splitlines() if "error" in line]
    assert errors == [f"run_training.sbatch: error: {venv}/bin/python3 (VENV={venv}) cannot import torch: "
                      "ModuleNotFoundError: No module named 'torch'. Install it there (pip install -r requirements.txt), "
                      "or set VENV, CONDA_ENV or SETUP"], out
    assert "[rank" not in out and "START" not in out


def test_submission_environment_wins_over_the_projects_venv(one_node, tmp_path):
    """Submitted from an active venv: that one runs, not SHARED_DIR/.venv, and it says so."""
    fake_project_venv = tmp_path / ".venv" / "bin"
    fake_project_venv.mkdir(parents=True)
    (fake_project_venv / "python").write_text("#!/bin/sh\nexit 99\n")
    (fake_project_venv / "python").chmod(0o755)
    venv = Path(sys.executable).parent.parent
    client = one_node.sbatch(tmp_path, ["--ntasks-per-node=1", "--cpus-per-task=1"], ["--epochs", "1", "--max-steps", "2"],
                             PYTHON=None, SHARED_DIR=str(tmp_path), VIRTUAL_ENV=str(venv),
                             PATH=f"{venv}/bin:{os.environ['PATH']}")
    _, out = finish(client, tmp_path)
    assert f"env=the environment you submitted from ({venv})" in out


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_scripts_are_clean(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    result = subprocess.run(["shellcheck", "--severity=style", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


# ----------------------------------------------------------------------------- what the batch file refuses

def refused(client: subprocess.Popen, submit_dir: Path, message: str) -> str:
    """The job ended with exit code 2 and its output is that one line: nothing started. Returns the job id."""
    job_id, out = finish(client, submit_dir, code=2)
    assert out.splitlines() == [f"run_training.sbatch: error: {message}"], out[-3000:]
    return job_id


def test_run_name_that_leaves_log_dir_is_refused_before_touching_the_disk(one_node, tmp_path):
    """RUN_NAME=../victim made the batch file rm -rf LOG_DIR/../victim/exit-codes and write
    there, and RUN_NAME=a/b left directories behind, before mnist_ddp.py refused the name."""
    (tmp_path / "outside" / "runs").mkdir(parents=True)  # LOG_DIR, there from earlier runs
    victim = tmp_path / "outside" / "victim" / "exit-codes"
    victim.mkdir(parents=True)
    (victim / "keep").write_text("someone else's\n")
    jobs = {name: (tmp_path / f"submit-{i}", one_node.sbatch(tmp_path / f"submit-{i}", ["--ntasks-per-node=1", "--cpus-per-task=1"],
                                                          ["--epochs", "1", "--max-steps", "2"], RUN_NAME=name,
                                                          LOG_DIR=str(tmp_path / "outside" / "runs")))
            for i, name in enumerate(["../victim", "a/b", ".."])}
    for _, client in jobs.values():
        client.wait(timeout=400)
    assert sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "outside").rglob("*")) == \
        ["outside/runs", "outside/victim", "outside/victim/exit-codes", "outside/victim/exit-codes/keep"]
    for name, (submit_dir, client) in jobs.items():
        job_id = refused(client, submit_dir, "RUN_NAME must be one directory name of letters, digits and ._-+=,@"
                                             f" (no / or spaces, not . or ..), got '{name}'")
        assert [p.name for p in submit_dir.iterdir()] == [f"mnist-ddp-{job_id}.out"]


def test_run_name_log_dir_run_dir_are_refused_after_the_file_name_and_no_prefix_names_them(one_node, tmp_path):
    """--run-name, --run-dir and --log-dir after the file name are refused before anything
    runs, as --name VALUE and --name=VALUE; mnist_ddp.py's parser takes no prefix of an
    option (allow_abbrev=False), so --run-n=x reaches it as an unknown option and is refused
    there, in one line, with nothing trained or written."""
    import mnist_ddp
    from ddpkit.launch import UsageError
    from ddpkit.options import build_parser
    parser = build_parser(mnist_ddp.Recipe)
    for prefix in ("--run-n", "--run-d", "--log-d", "--log-di"):
        with pytest.raises(UsageError, match=f"unrecognized arguments: {prefix}=x"):
            parser.parse_args([f"{prefix}=x"])
    clients = []
    for i, option in enumerate(("--run-name", "--run-dir", "--log-dir")):
        words = [f"{option}=elsewhere"] if i % 2 else [option, "elsewhere"]
        submit_dir = tmp_path / f"submit-{i}"
        clients.append((option, submit_dir, one_node.sbatch(submit_dir, ["--ntasks-per-node=1", "--cpus-per-task=1"],
                                                            ["--epochs", "1", "--max-steps", "1", *words])))
    for option, submit_dir, client in clients:
        refused(client, submit_dir, "name the run as RUN_NAME=NAME sbatch ... and its directory as LOG_DIR=DIR, "
                                    f"not with {option}: this file reads them to restart and resume the run")
        assert not (submit_dir / "elsewhere").exists() and not (submit_dir / "runs").exists()
    submit_dir = tmp_path / "prefix"
    _, out = finish(one_node.sbatch(submit_dir, ["--ntasks-per-node=1", "--cpus-per-task=1"],
                                    ["--epochs", "1", "--run-n", "elsewhere"]), submit_dir, code=2)
    assert "0: mnist_ddp.py: error: unrecognized arguments: --run-n elsewhere" in out, out[-3000:]
    assert not (submit_dir / "elsewhere").exists() and "epoch   1" not in out


def test_max_restarts_and_master_port_are_read_as_decimal(one_node, tmp_path):
    """MAX_RESTARTS=08 was octal to bash: the job died with "value too great for base" and
    no END line. Leading zeros now mean decimal; numbers out of bounds get one line."""
    options = ["--ntasks-per-node=1", "--cpus-per-task=1"]
    good = one_node.sbatch(tmp_path / "good", options, ["--epochs", "1", "--max-steps", "2"], RUN_NAME="eight",
                           MAX_RESTARTS="08", MASTER_PORT="029500")
    bad = {message: (tmp_path / f"bad-{i}", one_node.sbatch(tmp_path / f"bad-{i}", options, ["--epochs", "1", "--max-steps", "2"],
                                                            **env))
           for i, (env, message) in enumerate([
               ({"MAX_RESTARTS": "100000000000000000000"}, "MAX_RESTARTS must be a number from 0 to 100, got '100000000000000000000'"),
               ({"MAX_RESTARTS": "-1"}, "MAX_RESTARTS must be a number from 0 to 100, got '-1'"),
               ({"MASTER_PORT": "00080"}, "MASTER_PORT must be a number from 1024 to 65535, got '00080'")])}
    job_id, out = finish(good, tmp_path / "good")
    assert re.search(r"^START .* master=127\.0\.0\.1:29500 ", out, re.M), out[-3000:]
    assert re.search(rf"^END \S+ job={job_id} exit=0$", out, re.M) and "value too great" not in out, out[-3000:]
    run = json.loads((tmp_path / "good" / "runs" / "eight" / "run.json").read_text())
    assert run["environment"]["attempt"] == "1/9"  # 8 restarts at most: 9 attempts
    for message, (submit_dir, client) in bad.items():
        refused(client, submit_dir, message)


def test_wrong_python_is_named_in_the_error(one_node, tmp_path):
    """PYTHON= a path that does not exist, a file that is not executable, a directory, a
    command not on the PATH: the one line names the value given and what is wrong with it,
    not "no python3 on the PATH"."""
    (tmp_path / "python-text").write_text("not a program\n")
    missing, text, command = tmp_path / "no-such-env" / "bin" / "python3", tmp_path / "python-text", "python3.0-not-here"
    not_executable = "is not an executable file; point it at a python interpreter, or unset PYTHON to use VENV, CONDA_ENV"
    cases = {str(missing): f"PYTHON={missing} does not exist; fix the path, or unset PYTHON to use VENV, CONDA_ENV "
                           "or the project's .venv",
             str(text): f"PYTHON={text} {not_executable} or the project's .venv",
             str(tmp_path): f"PYTHON={tmp_path} {not_executable} or the project's .venv",
             command: f"no {command} on the PATH (PYTHON={command}); set VENV, CONDA_ENV or PYTHON"}
    clients = {python: (tmp_path / f"submit-{i}", one_node.sbatch(tmp_path / f"submit-{i}", ["--ntasks-per-node=1", "--cpus-per-task=1"],
                                                                 [], PYTHON=python))
               for i, python in enumerate(cases)}
    for python, (submit_dir, client) in clients.items():
        refused(client, submit_dir, cases[python])


def slurm_says(cluster, job: str, step: str, unknown: str) -> list[str]:
    """What ddpkit.files.slurm_job_state makes of `job`, of the step `step` and of a job Slurm
    never had, asked through the cluster's own squeue."""
    code = ("import json, sys; from ddpkit.files import slurm_job_state as state; "
            "print(json.dumps([state(sys.argv[1]), state(sys.argv[2], step=True), state(sys.argv[3])]))")
    done = subprocess.run([str(LOCAL_SLURM), "exec", str(cluster.dir), sys.executable, "-c", code, job, step, unknown],
                          env=cluster.env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_job_of_a_running_run_name_is_refused_and_leaves_it_alone(one_node, tmp_path):
    """A resubmission while the first job still runs: the second job meets the run's claim,
    exits 2 in one line, and touches nothing of the first one's (its exit codes, its line
    that continues, RUN_DIR/exit-code), which then stops on USR1 as usual."""
    options = ["--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=1", "--mem=1G", "--no-requeue"]
    env = {"RUN_NAME": "shared", "LOG_DIR": str(tmp_path / "runs"), "DATA_DIR": str(tmp_path / "data")}
    args = ["--batch-size", "64", "--epochs", "50"]
    first = one_node.sbatch(tmp_path / "a", options, args, **env)
    job_id = wait_for_epoch_1(first, tmp_path / "a")
    second = one_node.sbatch(tmp_path / "b", options, args, **env)
    _, out_b = finish(second, tmp_path / "b", code=2)
    assert re.search(r"^0: mnist_ddp.py: error: another run is using \S+/runs/shared \(pid \d+ on ", out_b, re.M), out_b[-2000:]
    assert first.poll() is None, "the first job should still be training"
    # What the run's lease asks Slurm of a holder's job and step (ddpkit.files.slurm_job_state), from real squeue
    run_dir = tmp_path / "runs" / "shared"
    record = json.loads(next((run_dir / ".claim.lease").glob("holder-*")).read_text())
    assert record["job"] == job_id and record["restarts"] == "0", record
    assert slurm_says(one_node, job_id, f"{job_id}.{record['step']}", "999999") == ["RUNNING", "RUNNING", ""]
    subprocess.run([str(LOCAL_SLURM), "exec", str(one_node.dir), "scancel", "--signal=USR1", job_id],
                   env=one_node.env, check=True, timeout=60)
    _, out_a = finish(first, tmp_path / "a", code=75)
    for _ in range(30):  # (COMPLETING a moment after its END line)
        ended, step = slurm_says(one_node, job_id, f"{job_id}.{record['step']}", "999999")[:2]
        if ended != "COMPLETING":
            break
        time.sleep(1)
    assert ended not in ("RUNNING", "COMPLETING") and step == "", (ended, step)
    assert (run_dir / "exit-code").read_text() == "75\n"
    assert "not training again" not in out_a and "to continue from the newest checkpoint, from " in out_a
    epochs = [m["epoch"] for m in read_metrics(run_dir)]
    assert epochs == list(range(1, len(epochs) + 1))
