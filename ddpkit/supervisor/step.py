"""The job step that runs the ranks: the check that their interpreter imports torch
(preflight), their command line (training_args), the srun or torchrun step (step_command),
the sbatch line that continues the run (resubmit_line) and its submission by CHAIN
(chained_submission), the rendezvous's address and interface, NCCL's Flight Recorder, and
`task`, what srun starts in each task. Python 3.6, standard library only."""

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from typing import Dict, List, Mapping, Optional, Tuple

from ddpkit.job import sweeplines
from ddpkit.job.contract import SCONTROL_TIMEOUT, continuing_args, last_line, option_word, run, shell_setting, this_job
from ddpkit.supervisor.nodes import Step, whole_job
from ddpkit.supervisor.settings import PROG, SETTINGS, JobError, Settings

IP_TIMEOUT = 10.0  # seconds for `ip`, which answers from this node's own tables


# ----------------------------------------------------------------------------- the step

def where_ranks_run(s: Settings, command: List[str]) -> List[str]:
    """One command run where the ranks run: inside the container, if there is one."""
    if s.container_srun:
        return ["srun", "--nodes=1", "--ntasks=1"] + s.container_srun + command
    return s.container + command


def preflight(s: Settings) -> str:
    """One check before any rank starts, instead of one traceback per rank after the queue
    wait: the ranks' interpreter imports torch; what it found, as one line."""
    code = "\n".join([
        "import os, sys",
        "try:",
        "    import torch",
        "except Exception as err:",
        "    print('{}: {}'.format(type(err).__name__, err).splitlines()[0])",
        "    sys.exit(1)",
        "gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0",
        "print('python={} torch={} cuda_build={} gpus_visible={} cpus_per_task={}'.format(sys.executable,",
        "      torch.__version__, torch.version.cuda or 'none', gpus, os.environ.get('SLURM_CPUS_PER_TASK', 'unset')))",
    ])
    try:
        result = subprocess.run(where_ranks_run(s, [s.python, "-c", code]), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, encoding="utf-8", errors="replace")
    except OSError as err:
        raise JobError(f"{s.python} ({s.environment}) cannot run: {err}; set VENV, CONDA_ENV or PYTHON") from None
    if result.returncode != 0:
        raise JobError(f"{s.python} ({s.environment}) cannot import torch: {last_line(result.stdout)}. Install it "
                       "there (pip install -r requirements.txt), or set VENV, CONDA_ENV or SETUP")
    return last_line(result.stdout)


def training_args(s: Settings, script: str, first_start: bool = True) -> List[str]:
    """The training script's command line: the directories and run name of this job, then the
    sweep line's options and the ones given after the batch file's name (they win); after the
    first start, continuing_args. The directories and the name as option_word writes them."""
    args = [script, option_word("--data-dir", s.data_dir), option_word("--log-dir", s.log_dir),
            option_word("--run-name", s.run_name)]
    if s.node_data_dir:
        args.append(option_word("--node-data-dir", s.node_data_dir))
    given = s.sweep_args + s.args
    return args + (given if first_start else continuing_args(given, s.run_dir))


def step_command(s: Settings, task_file: str, train: List[str], launcher: str = "", *,
                 step: Optional[Step] = None) -> List[str]:
    """The job step that runs the ranks: srun starts each task through `task_file task`, which
    becomes the training process (srun) or the node's torchrun agent; `step`, on which nodes
    (nodes.py's Step; the job's every node by default)."""
    launcher, step = launcher or s.launcher, step or whole_job(s)
    srun = ["srun", "--label", "--kill-on-bad-exit=1"]
    if step.nodes < s.nodes:  # going on with the nodes left after a node was lost (MIN_NODES), from the
        srun += [f"--nodes={step.nodes}", f"--ntasks={step.ntasks}"]  # first (rank 0 by MASTER_ADDR), or without those left out
        srun += ["--exclude=" + ",".join(step.excluded)] if step.excluded else ["--relative=0"]
    if launcher == "torchrun":
        # One torchrun per node starts tasks_per_node workers; c10d rendezvous on the first
        # node. Its agents restart all workers when one fails, MAX_RESTARTS times at most.
        cpus = s.tasks_per_node * int(os.environ.get("SLURM_CPUS_PER_TASK") or 1)
        srun += [f"--nodes={s.nodes}", f"--ntasks={s.nodes}", "--ntasks-per-node=1",
                 f"--cpus-per-task={cpus}"]
        agent = ["torchrun", f"--nnodes={s.nodes}", f"--nproc-per-node={s.tasks_per_node}",
                 f"--max-restarts={s.max_restarts}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint={os.environ['MASTER_ADDR']}:{s.master_port}",
                 f"--rdzv-id={os.environ.get('SLURM_JOB_ID', s.job)}"]
        return srun + s.container_srun + s.container + [s.python, task_file, "task"] + agent + train
    return srun + s.container_srun + s.container + [s.python, task_file, "task", "train"] + train


def resubmit_line(s: Settings, env: Mapping[str, str], fields: Mapping[str, str]) -> str:
    """The beginning of the sbatch line that continues this run: its directories and the
    settings as given, the same request (nodes, tasks, CPUs, GPUs, memory, time, partition,
    account) and the original batch file. The ranks add the run's options to it."""
    request = ["sbatch", f"--nodes={s.nodes}"]
    # srun's tasks may be spread unevenly (--nodes=2 --ntasks=3: 2 and 1), which only --ntasks
    # asks for again; torchrun starts tasks_per_node workers on each node.
    if s.launcher == "srun" and s.ntasks != s.nodes * s.tasks_per_node:
        request.append(f"--ntasks={s.ntasks}")
    else:
        request.append(f"--ntasks-per-node={s.tasks_per_node}")
    if s.min_nodes < s.nodes:
        request.append("--no-kill")  # (MIN_NODES goes on with the nodes left only so)
    for variable, option, unit in (("SLURM_CPUS_PER_TASK", "--cpus-per-task", ""), ("SLURM_MEM_PER_NODE", "--mem", "M"),
                                   ("SLURM_MEM_PER_CPU", "--mem-per-cpu", "M")):
        if env.get(variable):
            request.append(f"{option}={env[variable]}{unit}")
    # UNLIMITED and Partition_Limit are no --time to ask for: the partition's own limit applies again.
    if fields.get("TimeLimit") not in (None, "", "UNLIMITED", "Partition_Limit"):
        request.append("--time=" + fields["TimeLimit"])
    for option, value in gpu_request(fields, env):
        request.append(f"{option}={value}")
    if env.get("SLURM_JOB_PARTITION"):
        request.append("--partition=" + env["SLURM_JOB_PARTITION"])
    if env.get("SLURM_JOB_ACCOUNT"):
        request.append("--account=" + env["SLURM_JOB_ACCOUNT"])
    # A batch job's name, as given; inside salloc (BatchFlag=0) SLURM_JOB_NAME is the allocation's
    # (interactive), and the batch file's own --job-name names the job the line submits.
    if env.get("SLURM_JOB_NAME", "mnist-ddp") != "mnist-ddp" and fields.get("BatchFlag") != "0":
        request.append("--job-name=" + env["SLURM_JOB_NAME"])
    if fields.get("ExcNodeList") not in (None, "", "(null)"):  # (yours, and the nodes a job left out)
        request.append("--exclude=" + fields["ExcNodeList"])
    request.append(s.batch_file or os.path.join(s.project, PROG))
    settings = [("SHARED_DIR", s.shared), ("DATA_DIR", s.data_dir), ("LOG_DIR", s.log_dir), ("RUN_NAME", s.run_name)]
    settings += list(s.passed_on.items())
    if s.chain:
        settings.append(("CHAIN", str(s.chain - 1)))  # (the job that continues the run may chain one fewer)
    return " ".join(shell_setting(name, value) for name, value in settings) + " " + sweeplines.quote_words(request)


def chained_submission(line: str, job: str, env: Mapping[str, str]) -> Tuple[List[str], Dict[str, str]]:
    """The sbatch command and its environment that submit `line` (the sbatch line that continues
    the run, as printed after END) as a job that starts once the job `job` has ended (CHAIN),
    with --parsable, which prints its id alone. `env` is this job's environment as run_training.sbatch
    handed it over: the job gets the settings the line sets in place of this job's (SETTINGS),
    and none of the SLURM_* variables that describe this job (Slurm would leave those the new
    job does not set itself, such as SLURM_MEM_PER_CPU or an array task's id), but SLURM_CONF,
    which says where the cluster's configuration is. ValueError when the line is no such line."""
    words = shlex.split(line)
    if "sbatch" not in words or not all(re.match(r"[A-Z_]+=", word) for word in words[:words.index("sbatch")]):
        raise ValueError(f"not a line of settings and sbatch: {line}")
    at = words.index("sbatch")
    kept = {name: value for name, value in env.items() if name not in SETTINGS and
            not (name.startswith("SLURM_") and name != "SLURM_CONF")}
    kept.update(word.split("=", 1) for word in words[:at])
    return ["sbatch", "--parsable", f"--dependency=afterany:{job}"] + words[at + 1:], kept


def gpu_request(fields: Mapping[str, str], env: Mapping[str, str]) -> List[Tuple[str, str]]:
    """The GPUs, however they were asked for (--gpus-per-node, --gres=gpu:N, --gpus,
    --gpus-per-task), as the job's TRES say (gres:gpu:2, gres/gpu:a100:2, older Slurm's
    gpu:2); without them, the variables two of those options set."""
    asked = []  # type: List[Tuple[str, str]]
    for field, option in (("TresPerNode", "--gpus-per-node"), ("TresPerJob", "--gpus"), ("TresPerTask", "--gpus-per-task")):
        for item in fields.get(field, "").split(","):
            match = re.fullmatch(r"(?:gres[:/])?gpu:(.+)", item)
            if match:
                asked.append((option, match.group(1)))
                break
    if not asked:
        for variable, option in (("SLURM_GPUS_PER_NODE", "--gpus-per-node"), ("SLURM_GPUS_PER_TASK", "--gpus-per-task")):
            if env.get(variable):
                asked.append((option, env[variable]))
    return asked


# ----------------------------------------------------------------------------- the rendezvous and each task

def first_ipv4(host: str) -> str:
    """The first IPv4 address a host name resolves to, or ""."""
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except (OSError, IndexError):
        return ""


def route_to(address: str, field: str) -> str:
    """This node's route towards an address, as `ip route get` says it: its src or its dev."""
    try:
        shown = run(["ip", "-o", "route", "get", address or "0.0.0.0"], IP_TIMEOUT).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    match = re.search(rf" {field} (\S+)", shown)
    return match.group(1) if match else ""


def hostnames(nodelist: str) -> List[str]:
    """The nodes of a Slurm node list (node[1-3]), as Slurm expands it; OSError or
    SubprocessError when scontrol cannot run."""
    return run(["scontrol", "show", "hostnames", nodelist], SCONTROL_TIMEOUT).stdout.split() if nodelist else []


def master_address(env: Mapping[str, str]) -> str:
    """Rank 0 runs on the first node of the allocation, where the supervisor runs too. The other
    nodes get an address, not a name: on many clusters a node's own name resolves to 127.0.1.1
    in its /etc/hosts, which no other node can reach. Then the address this node reaches the
    second node from, which the second node can reach back."""
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    try:
        hosts = hostnames(env.get("SLURM_JOB_NODELIST", ""))
    except (OSError, subprocess.SubprocessError) as err:
        raise JobError(f"cannot list the job's nodes (scontrol show hostnames: {err}); set MASTER_ADDR") from None
    address = first_ipv4(hosts[0]) if hosts else ""
    if len(hosts) > 1 and (not address or address.startswith("127.")):
        address = route_to(first_ipv4(hosts[1]), "src")
    if not address:
        first = hosts[0] if hosts else "the first node"
        raise JobError(f"cannot find an address of {first} that the other nodes reach; set MASTER_ADDR")
    return address


def gloo_interface(env: Mapping[str, str]) -> str:
    """Gloo binds the address its host's name resolves to (127.0.1.1 on many clusters): on a
    job of several nodes, this node's interface towards the master instead."""
    if env.get("GLOO_SOCKET_IFNAME") or int(env.get("SLURM_JOB_NUM_NODES") or 1) < 2 or not shutil.which("ip"):
        return env.get("GLOO_SOCKET_IFNAME", "")
    device = route_to(env["MASTER_ADDR"], "dev")
    if device == "lo":  # the master is on this node: the interface that holds its address
        try:
            shown = run(["ip", "-o", "addr", "show", "to", env["MASTER_ADDR"]], IP_TIMEOUT).stdout.split()
        except (OSError, subprocess.SubprocessError):
            shown = []
        device = shown[1] if len(shown) > 1 else ""
    return device


def task(argv: List[str]) -> None:
    """What srun starts in each task: it becomes the training process (train ARGS) or this
    node's torchrun agent (torchrun ARGS), with the ranks' interpreter."""
    mode, args = argv[0], argv[1:]
    interface = gloo_interface(os.environ)
    if interface:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    for name, folder in compile_caches(os.environ).items():
        os.environ[name] = os.environ.get(name) or folder  # (yours win)
    if mode == "torchrun":
        # Slurm's --signal reaches every process of the step, the agent too, which would die
        # of SIGUSR1 and, under proctrack/cgroup, take its workers with it. So the agent
        # ignores it; the workers install their own handler at once and save. is_host: this
        # node hosts the rendezvous, which torchrun cannot tell from an address it may not
        # know as its own.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        # A store of its own for each restart's workers: in the agent's shared store, restarted
        # workers read the addresses that the failed ones left there and cannot connect
        # (pytorch/pytorch#135712).
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        is_host = int((os.environ.get("SLURM_NODEID") or "0") == "0")
        args = ["-m", "torch.distributed.run", f"--rdzv-conf=is_host={is_host}"] + args
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable] + args)


def compile_caches(env: Mapping[str, str]) -> Dict[str, str]:
    """--compile's caches, Inductor's and Triton's, on this node's own scratch ($TMPDIR, else
    /tmp), in one folder per job: torch's defaults are shared by every job of the user, and
    Triton's is in the home directory, often on NFS, where torch's caches meet stale file
    handles and hangs. The run's own compile cache (RUN_DIR/compile-cache-*.bin) fills them
    at each start. torch makes the folders when it first writes there."""
    job = os.path.join(env.get("TMPDIR") or "/tmp", "mnist-ddp-" + this_job(env))
    return {"TORCHINDUCTOR_CACHE_DIR": os.path.join(job, "inductor"), "TRITON_CACHE_DIR": os.path.join(job, "triton")}


def flight_recorder(run_dir: str) -> Dict[str, str]:
    """NCCL's Flight Recorder: on a collective's timeout every NCCL rank dumps its last
    collectives to RUN_DIR/hangs/nccl-trace-rank-<r>, beside the hang report's stacks (the
    folder exists while the hang watch runs: the whole run, unless --hang-after -1), under
    torch's older names and its newer ones. Gloo ignores it. Not run here: no GPU
    (docs/recovery.md says how to read the dumps)."""
    dump = os.path.join(run_dir, "hangs", "nccl-trace-rank-")
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": dump, "TORCH_FR_DUMP_TEMP_FILE": dump}
