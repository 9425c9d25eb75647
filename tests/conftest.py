"""Shared helpers: start mnist_ddp.py the way users do (plain, torchrun, as srun would)
in processes of their own, with a clean environment and a data directory of the test's own.
Plain and srun-style runs are forked from a process that imported torch once (preloaded.py)."""

import ast
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import preloaded
import pytest
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "mnist_ddp.py"
SAMPLE = ROOT / "data" / "mnist-sample"
sys.path.insert(0, str(ROOT))

# Three tiers (docs/tests.md). `slurm`: the tests that start a local Slurm cluster, network
# namespaces or sshd (by fixture or by file). `slow`: the longer end-to-end runs, SLOW below.
# The fast tier is the rest: `make test-fast` runs it on every core (pytest-xdist), `make test`
# runs all three, the Slurm tests in one process: their clusters listen on fixed ports.
SLURM_FIXTURES = {"one_node", "two_nodes", "three_nodes", "network"}
SLURM_MODULES = ("test_slurm", "test_tunnel")

# Each of these took 2 s or more in a full run on 2 cores (call time, fixtures not counted),
# or shares a fixture that costs as much with one that did: whole runs of mnist_ddp.py, under
# torchrun or sweep.py, or of the benchmark. By file, then test name (every parametrization),
# or name[id] (that one alone). SLOW_MODULES: every test of the file (test_tensorboard's share
# a fixture of four runs).
SLOW_MODULES = ("test_tensorboard",)
SLOW = {
    "test_adapt": {"test_own_image_folder_trains_through_both_feeds_alike",
                   "test_own_model_or_loss_edited_into_a_copy_trains_stops_and_resumes_on_2_ranks",
                   "test_own_test_metric_is_two_lines_in_evaluate_and_reaches_the_line_the_jsonl_and_tensorboard"},
    "test_bad_input": {"test_read_only_data_dir_that_holds_the_data_is_used",
                       "test_run_dir_in_a_read_only_parent_trains_without_the_hparams_declaration",
                       "test_read_only_log_dir_is_refused_in_one_line"},
    "test_benchmark": {"test_benchmark_quick_run", "test_ranks_quick_run",
                       "test_world_sizes_compares_each_continued_run_with_the_run_that_kept_its_ranks"},
    "test_checkpoints": {"test_a_copy_put_in_checkpoints_neither_wins_nor_is_lost"},
    "test_continue": {"test_torchrun_continue_line_works_with_no_torchrun_on_the_path",
                      "test_torchrun_continue_line_runs_as_printed",
                      "test_a_stop_whose_requeue_fails_prints_the_continue_line_and_it_works",
                      "test_train_it_longer_works_as_printed_twice",
                      "test_after_ctrl_c_the_continue_line_works_with_no_environment_on_the_path",
                      "test_stop_when_scontrol_cannot_reach_slurm_still_exits_75",
                      "test_signal_during_start_up_is_kept",
                      "test_same_run_name_continues_and_a_finished_run_says_so",
                      "test_continue_line_leaves_out_resume_and_interrupt_at",
                      "test_a_start_that_continues_the_job_goes_on_from_the_runs_own_checkpoint_not_back_to_resume_file",
                      "test_stopped_run_prints_the_command_that_continues_it"},
    "test_doctor": {"test_a_rank_that_never_comes_is_named_within_the_timeout", "test_check_of_two_ranks_under_torchrun"},
    "test_figures": {"test_the_fast_tier_figure_comes_from_a_run_of_exactly_that_tier",
                     "test_every_figure_in_help_is_written_from_the_figure_files_and_checked"},
    "test_hangs": {"test_a_rank_hung_in_python_is_named_with_its_host_and_line_and_the_run_then_goes_on",
                   "test_a_rank_stuck_in_a_backward_hook_outside_the_recipe_is_named_at_the_hooks_line",
                   "test_a_rank_stuck_in_a_c_call_that_holds_the_interpreter_is_named_from_its_faulthandler_stacks",
                   "test_a_slow_save_that_holds_the_others_up_is_named_and_the_run_goes_on",
                   "test_a_slowed_rank_is_named_as_the_straggler_and_tensorboard_has_the_speed_scalars",
                   "test_profile_writes_a_trace_per_rank_and_a_table_and_changes_no_result",
                   "test_touching_profile_now_profiles_the_next_steps_of_a_running_run"},
    "test_imagesets": {"test_empty_class_folder_is_refused"},
    "test_nothing_lost": {"test_ctrl_c_twice_under_torchrun_saves_and_leaves_no_traceback_on_the_ranks",
                          "test_unnamed_runs_started_in_the_same_second_get_their_own_directories",
                          "test_two_runs_of_one_name_at_once",
                          "test_ctrl_c_saves_a_checkpoint_and_records_it",
                          "test_ctrl_c_before_training_stops_at_once"},
    "test_overhead": {"test_default_run_on_staged_data_does_not_load_torchvision",
                      "test_the_first_step_says_how_long_start_up_took"},
    "test_profiling": {"test_a_profile_cut_short_by_the_runs_end_names_only_the_steps_it_recorded",
                       "test_a_resumed_run_profiles_the_steps_after_the_one_it_resumed_at",
                       "test_rank_0_says_once_when_it_mostly_waits_for_the_other_ranks"},
    "test_resume": {"test_killed_rank_ends_the_job",
                    "test_a_mid_epoch_resume_on_fewer_ranks_logs_the_epochs_train_loss_of_the_run_that_kept_its_own",
                    "test_a_run_goes_on_in_mid_epoch_on_another_number_of_ranks_as_if_it_had_kept_its_own"},
    "test_shell_scripts": {"test_printed_torchrun_lines_run_with_a_space_in_the_script_path",
                           "test_the_view_line_of_a_run_starts_tensorboard_sh_as_printed"},
    "test_staging": {"test_rank0_downloads_behind_the_barrier", "test_two_jobs_share_one_data_dir"},
    "test_sweep": {"test_a_sweep_runs_locally_and_its_summary_ranks_the_runs"},
    "test_sweep_files": {"test_ctrl_c_in_a_local_sweep_lets_the_run_save_and_the_printed_line_goes_on",
                         "test_a_refused_file_can_be_fixed_and_a_copy_that_nothing_ran_from_is_replaced",
                         "test_a_hash_starts_a_comment_anywhere_and_quoted_values_keep_theirs",
                         "test_sweep_run_records_each_exit_code_so_a_bad_option_shows_as_failed",
                         "test_every_line_is_checked_with_the_scripts_own_options_before_anything_is_written"},
    "test_training": {"test_torchrun_two_ranks", "test_two_ranks_match_one_process_with_twice_the_batch[compiled]",
                      "test_smoke_run_learns", "test_tensorboard_events_hold_the_expected_tags",
                      "test_gpu_speed_options_do_not_break_cpu_runs[compile]", "test_batchnorm_ranks_evaluate_rank_0s_model"},
}


def stale_slow_entries() -> list[str]:
    """SLOW's entries whose file no longer defines their test (read with ast: nothing imported)."""
    stale = []
    for module, names in SLOW.items():
        path = Path(__file__).with_name(f"{module}.py")
        tree = ast.parse(path.read_text()) if path.exists() else ast.Module(body=[])
        defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        stale += [f"tests/{module}.py::{name}" for name in sorted(names) if name.split("[")[0] not in defined]
    return stale


def pytest_configure(config):
    config.addinivalue_line("markers", "slurm: starts a local Slurm cluster, network namespaces or sshd")
    config.addinivalue_line("markers", "slow: a longer end-to-end run (tests/conftest.py's SLOW); not in `make test-fast`")
    stale = stale_slow_entries()
    if stale and not hasattr(config, "workerinput"):  # (said once, by pytest-xdist's controller)
        raise pytest.UsageError(f"tests/conftest.py: SLOW names {', '.join(stale)}, which no longer exist: rename "
                                "each entry with its test, or remove it")


def pytest_collection_modifyitems(items):
    for item in items:
        module = item.module.__name__
        if SLURM_FIXTURES & set(item.fixturenames) or module in SLURM_MODULES:
            item.add_marker(pytest.mark.slurm)
        if module in SLOW_MODULES or {item.name, item.originalname} & SLOW.get(module, set()):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Two pytest-xdist workers would each start the same cluster, on the same ports."""
    if item.get_closest_marker("slurm") and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        pytest.fail("the Slurm tests share clusters on fixed ports: run them in one process (-m slurm, without -n), "
                    "as `make test` does", pytrace=False)


LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without any launcher's variables (the tests may themselves run under one)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(ROOT)  # for commands that import mnist_ddp from another directory
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_single(args: list[str], cwd: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """`python mnist_ddp.py ARGS` in a process of its own (forked with torch imported: preloaded.py)."""
    return preloaded.Run(args, cwd, clean_env(**env)).wait(timeout)


def run_python(args: list[str], cwd: Path, code: str = "", script: Path | None = None, timeout: float = 300,
               **env: str) -> subprocess.CompletedProcess:
    """`python -c CODE ARGS` or `python SCRIPT ARGS` (a user's edit of mnist_ddp.py, a test's
    driver), forked with torch imported as run_single is."""
    return preloaded.Run(args, cwd, clean_env(**env), script=script or SCRIPT, code=code or None).wait(timeout)


def run_torchrun(nproc: int, args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(SCRIPT), *args]
    return subprocess.run(cmd, cwd=cwd, env=clean_env(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=timeout)


def run_as_srun(ntasks: int, args: list[str], cwd: Path, timeout: float = 300, job_id: str = "4242",
                command: list[str] | None = None, detach: bool = False, env: dict[str, str] | None = None):
    """One process per task with the variables srun gives its tasks on one node (job_id ""
    leaves SLURM_JOB_ID out), and `env`. Returns the finished results, or with detach the processes."""
    extra = env or {}
    host = socket.gethostname()
    port = str(free_port())
    procs = []
    for rank in range(ntasks):
        env = clean_env(**extra, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank), SLURM_NTASKS=str(ntasks),
                        SLURM_STEP_ID="0", SLURM_STEP_NUM_TASKS=str(ntasks), SLURM_JOB_NODELIST=host,
                        SLURM_STEP_NODELIST=host, SLURM_CPUS_PER_TASK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        if job_id:
            env["SLURM_JOB_ID"] = job_id
        code = command[2] if command and command[:2] == [sys.executable, "-c"] else None
        if not detach and (code or not command):  # forked with torch imported (preloaded.py)
            procs.append(preloaded.Run(args, cwd, env, code=code))
            continue
        cmd = command or [sys.executable, str(SCRIPT)]
        procs.append(subprocess.Popen([*cmd, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    if detach:
        return procs
    if all(isinstance(run, preloaded.Run) for run in procs):
        try:
            return [run.wait(timeout) for run in procs]
        finally:
            for run in procs:
                run.kill()
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def press_ctrl_c(command: list[str], cwd: Path, times: int = 1, **env: str) -> tuple[int, str]:
    """Start `command` as a terminal would start it, and once it logged its first epoch send
    SIGINT to its whole process group `times` times, 0.2 s apart, as Ctrl-C does. The
    preexec_fn matters: a non-interactive shell starts background jobs with SIGINT ignored,
    and Python then installs no KeyboardInterrupt handler. Returns (exit code, output)."""
    proc = subprocess.Popen(command, cwd=cwd, env=clean_env(**{"OMP_NUM_THREADS": "1", **env}), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("epoch   1 |"):
            for _ in range(times):
                os.killpg(proc.pid, signal.SIGINT)
                time.sleep(0.2)
            break
    rest, _ = proc.communicate(timeout=300)
    return proc.returncode, "".join(seen) + rest


CLASSES = ("column", "diagonal", "row")


def make_image_folder(root: Path, per_class: dict[str, int], size: int = 32, seed: int = 0) -> Path:
    """root/train/<class>/*.png and root/test/<class>/*.png, 3 x size x size RGB, each class a
    visible pattern (a bright column, diagonal or row in its own colour) on noise."""
    rng = np.random.default_rng(seed)
    for part, count in per_class.items():
        for label, name in enumerate(CLASSES):
            folder = root / part / name
            folder.mkdir(parents=True)
            for i in range(count):
                image = rng.integers(0, 120, (size, size, 3), dtype=np.uint8)
                at = rng.integers(2, size - 2)
                if name == "row":
                    image[at - 1: at + 2, :, label] = 255
                elif name == "column":
                    image[:, at - 1: at + 2, label] = 255
                else:
                    image[np.arange(size), np.arange(size), label] = 255
                Image.fromarray(image).save(folder / f"{i:03d}.png")
    return root


# A tiny image folder (3 classes x 8 training and 4 test images of 12 x 12): 24 training
# images, so with --batch-size 8 an epoch is 3 steps, for tests of epochs, stops, resumes and printed lines that need
# neither learning nor the sample's figures.
TINY = {"train": 8, "test": 4}


@pytest.fixture(scope="session")
def tiny_images(tmp_path_factory) -> Path:
    return make_image_folder(tmp_path_factory.mktemp("tiny"), TINY, size=12)


@pytest.fixture
def tiny_folder(tiny_images: Path, tmp_path: Path) -> Path:
    """The tiny folder, a copy of the test's own (a run caches the pixel statistics in it)."""
    return Path(shutil.copytree(tiny_images, tmp_path / "tiny"))


def on_folder(folder: Path) -> list[str]:
    """The options that train on `folder` instead of the sample."""
    return ["--dataset", "folder", "--data-dir", str(folder)]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


MEASURED = ("images_per_s", "epoch_s", "peak_rss_mb", "seconds_to_best")  # figures of the machine, not of the training


def read_results(run_dir: Path) -> list[dict]:
    """metrics.jsonl without the measured figures: what two identical runs must share."""
    return [{k: v for k, v in m.items() if k not in MEASURED} for m in read_metrics(run_dir)]


def load_params(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt", weights_only=True)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """An empty working directory: runs stage their data into its data/ and log into its runs/."""
    return tmp_path


def assert_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"


# ----------------------------------------------------------------------------- a real Slurm (local-slurm.sh)

LOCAL_SLURM = ROOT / "local-slurm.sh"
SBATCH_FILE = ROOT / "run_training.sbatch"


class Cluster:
    def __init__(self, directory: Path, nodes: int, env: dict[str, str]):
        self.dir, self.nodes, self.env = directory, nodes, env
        result = subprocess.run([str(LOCAL_SLURM), "start", str(directory), str(nodes)], env=env,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, f"cannot start a local Slurm cluster:\n{result.stdout}{result.stderr}"

    def sbatch(self, submit_dir: Path, options: list[str], args: list[str], batch_file: Path = SBATCH_FILE,
               **env: str) -> subprocess.Popen:
        """Start `sbatch --wait` of the real batch file (or a user's copy of it) from submit_dir;
        returns the running client. The job runs the tests' interpreter unless env names
        another environment."""
        submit_dir.mkdir(parents=True, exist_ok=True)
        job_env = {**self.env, "SCRIPT": str(ROOT / "mnist_ddp.py"), "PYTHON": sys.executable, **env}
        job_env = {k: v for k, v in job_env.items() if v is not None}
        cmd = [str(LOCAL_SLURM), "exec", str(self.dir), "sbatch", "--wait", "--parsable", *options, str(batch_file), *args]
        return subprocess.Popen(cmd, cwd=submit_dir, env=job_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def stop(self):
        subprocess.run([str(LOCAL_SLURM), "stop", str(self.dir)], env=self.env, capture_output=True, timeout=120)


def finish(client: subprocess.Popen, submit_dir: Path, timeout: float = 400, code: int = 0) -> tuple[str, str]:
    """Wait for `sbatch --wait`; return (job id, output file text) after checking the exit code."""
    out, err = client.communicate(timeout=timeout)
    job_id = out.strip().split(";")[0]
    log = submit_dir / f"mnist-ddp-{job_id}.out"
    text = log.read_text() if log.exists() else "(no output file)"
    assert client.returncode == code, f"sbatch exit {client.returncode}\n{err}\n{text[-4000:]}"
    return job_id, text


def wait_for_epoch_1(client: subprocess.Popen, submit_dir: Path) -> str:
    """Wait until a job's output shows its first epoch; returns the job id."""
    deadline = time.monotonic() + 300
    logs = []
    while time.monotonic() < deadline and client.poll() is None:
        logs = list(submit_dir.glob("mnist-ddp-*.out"))
        if logs and re.search(r"^0: epoch   1 \|", logs[0].read_text(), re.M):
            break
        time.sleep(0.2)
    assert logs, "the job wrote no output"
    return logs[0].name.split("-")[-1].removesuffix(".out")


# The clusters every test file shares live for the whole session: each start and stop costs
# seconds, and no test leaves a cluster other than it found it (jobs end, rules are removed).
@pytest.fixture(scope="session")
def one_node(tmp_path_factory):
    cluster = Cluster(tmp_path_factory.mktemp("slurm1"), 1, clean_env(LOCAL_SLURM_PORT="16817"))
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def two_nodes(tmp_path_factory):
    """Each node's own name resolves to 127.0.1.1 there, as on many real clusters: the batch
    file must still find an address the other node reaches, and Gloo an interface."""
    cluster = Cluster(tmp_path_factory.mktemp("slurm2"), 2,
                      clean_env(LOCAL_SLURM_PORT="16827", LOCAL_SLURM_PREFIX="mt", LOCAL_SLURM_SUBNET="10.231.9",
                                LOCAL_SLURM_SELF_LOOPBACK="1"))
    yield cluster
    cluster.stop()
