"""The job's contract (ddpkit/job/contract.py), what the supervisor, the ranks and sweep.py agree
on: that each variable and file they pass is spelled there alone, and that the side the
contract says writes it and the side it says reads it each refer to it; that no rank
imports the supervisor; the rules themselves (the rendezvous port, the ranks' codes, the
options a restart goes on with, the advice's name for another run).

    python -m pytest tests/unit/test_contract.py
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.job.contract import (
    JobEnv,
    JobPaths,
    continuing_args,
    hung_text,
    node_fault_text,
    port_from_job_id,
    read_codes,
    read_hung,
    read_node_fault,
)
from helpers.processes import ROOT

# ----------------------------------------------------------------------------- one name, two sides

CONTRACT = ROOT / "ddpkit" / "job" / "contract.py"
SIDES = {  # each side of the contract: its modules
    "supervisor": sorted((ROOT / "ddpkit" / "supervisor").glob("*.py")),
    "ranks": [ROOT / "mnist_ddp.py"] + sorted(p for p in (ROOT / "ddpkit").rglob("*.py")
                                               if p.parent.name not in ("job", "supervisor")),
    "sweep": [ROOT / "sweep.py"],
}
SHELL_FILES = [ROOT / "run_training.sbatch", ROOT / "local-slurm.sh"]
TABLES = {"JobEnv": JobEnv, "JobPaths": JobPaths}


def names_of(table: type) -> dict:
    """A table's names: attribute -> its string (JobEnv.EXIT_DIR -> MNIST_DDP_EXIT_DIR)."""
    return {name: value for name, value in vars(table).items() if name.isupper() and name != "SIDES"}


def literal_forms(node: ast.AST) -> list:
    """The strings a node spells: a constant as it is, an f-string with {} for each value."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return ["".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values)]
    return []


def shell_form(value: str) -> str:
    """How a shell line would spell a variable (a word) or a file of the contract (after a /)."""
    if value.startswith("MNIST_DDP_"):
        return rf"\b{value}\b"
    name = re.escape(value.replace("*", "{}").split("{")[0])
    return rf"/{name}" if "{" in value or "*" in value else rf"/{name}(?![\w-])"


def test_every_variable_and_file_the_sides_share_is_spelled_in_the_contract_alone():
    """Each MNIST_DDP_* variable and each file of the run directory and the job's folder is a
    string in ddpkit/job/contract.py alone: every other module names it through JobEnv or
    JobPaths (a rank's file rank-<r> too, as an f-string or a glob)."""
    spelled = {value: f"{table}.{name}" for table, cls in TABLES.items() for name, value in names_of(cls).items()}
    assert len(spelled) == sum(len(names_of(cls)) for cls in TABLES.values()), "two names spell the same string"
    spelled.update({value.format("*"): name for value, name in list(spelled.items()) if "{}" in value})
    found = []
    for path in sorted({p for paths in SIDES.values() for p in paths} | {CONTRACT}):
        text = path.read_text()
        if path != CONTRACT:
            found += [f"{path.name}: MNIST_DDP_" for _ in range(text.count("MNIST_DDP_"))]
            found += [f"{path.name}:{node.lineno}: {form!r} ({spelled[form]})" for node in ast.walk(ast.parse(text))
                      for form in literal_forms(node) if form in spelled]
    for path in SHELL_FILES:  # (a file's name, after a /: `requeue` in a comment or a command is no file)
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.lstrip().startswith("#"):
                found += [f"{path.name}:{number}: {value}" for value in spelled if re.search(shell_form(value), line)]
    assert found == []


PRODUCT = [ROOT / "mnist_ddp.py", ROOT / "sweep.py"] + sorted((ROOT / "ddpkit").rglob("*.py"))
# "job-" as a word's start: the prefix of a job's folder and code copy (not sbatch's --job-name).
JOB_PREFIX = re.compile(r"(?<![\w-])job-")


def outside_job_paths(tree: ast.AST) -> list:
    """Every node of a module but those of the class JobPaths and the docstrings."""
    found, todo = [], [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.ClassDef) and node.name == "JobPaths":
            continue
        found.append(node)
        children = list(ast.iter_child_nodes(node))
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body \
                and isinstance(body[0], ast.Expr) and literal_forms(body[0].value):
            children.remove(body[0])
        todo += children
    return found


def names_a_file(node: ast.AST) -> bool:
    """Whether a node is a file name of JobPaths (JobPaths.REQUEUE, JobPaths.RANK_CODE.format(r))."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
        node = node.func.value
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "JobPaths" \
        and node.attr.isupper()


def joins_a_file(node: ast.AST) -> bool:
    """Whether a node joins a file name of JobPaths to a folder by hand: os.path.join, Path(),
    joinpath or pathlib's /."""
    if isinstance(node, ast.Call):
        func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        return func in ("join", "Path", "PurePath", "joinpath") and any(map(names_a_file, node.args))
    return isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and (names_a_file(node.left)
                                                                              or names_a_file(node.right))


def test_no_path_of_the_job_is_joined_by_hand_and_job_is_spelled_once():
    """Each file and folder of the run directory and of the job's folder is a path of JobPaths:
    no module joins one of its file names to a folder itself, and "job-" (the prefix of a
    job's folder and of its copy of the code) is a string in the class JobPaths alone
    (docstrings and comments may say it)."""
    found = []
    for path in PRODUCT:
        for node in outside_job_paths(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
            if joins_a_file(node):
                found.append(f"{where}: joined by hand: {ast.unparse(node)}")
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and JOB_PREFIX.search(node.value):
                found.append(f"{where}: {node.value!r}")
    assert found == []


def contract_functions() -> dict:
    """Each function of the contract (JobPaths' as JobPaths.NAME) -> the table names it uses,
    itself or through the contract's other functions."""
    tree = ast.parse(CONTRACT.read_text())
    defs = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    for cls in (node for node in tree.body if isinstance(node, ast.ClassDef)):
        defs.update({f"{cls.name}.{node.name}": node for node in cls.body if isinstance(node, ast.FunctionDef)})
    direct = {name: uses(node, set(defs)) for name, node in defs.items()}
    closed = {}
    for name in direct:
        seen, todo = set(), [name]
        while todo:
            for used in direct[todo.pop()] - seen:
                seen.add(used)
                todo += [used] if used in direct else []
        closed[name] = {used for used in seen if used not in direct}
    return closed


def holds_job_paths(node: ast.AST) -> bool:
    """Whether a node is a JobPaths object: JobPaths(...), JobPaths.of_folder(...), or a name
    that ends in `paths` (paths, s.paths, launch.paths)."""
    if isinstance(node, ast.Call):
        return ast.unparse(node.func) in ("JobPaths", "JobPaths.of_folder")
    name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
    return name.endswith("paths")


def uses(tree: ast.AST, functions: set) -> set:
    """The table names (JobEnv.ATTEMPT) and the functions of the contract (of `functions`, and
    the paths of a JobPaths object: JobPaths.requeue) a piece of code refers to."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in TABLES:
            found.add(f"{node.value.id}.{node.attr}")
        elif isinstance(node, ast.Attribute) and holds_job_paths(node.value) and not node.attr.isupper():
            found.add(f"JobPaths.{node.attr}")
        elif isinstance(node, ast.Name) and node.id in functions:
            found.add(node.id)
    return found


def imported_from_contract(tree: ast.AST) -> set:
    return {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module == "ddpkit.job.contract"
            for alias in node.names}


def test_each_name_is_written_by_one_side_and_read_by_the_other():
    """JobEnv.SIDES and JobPaths.SIDES declare, for every name, who writes it and who reads
    it (the supervisor, the ranks, sweep.py): each of those sides refers to the name, itself
    or through a function of the contract, and a name that one side writes another reads, or,
    for a file, a later job of the same side."""
    functions = contract_functions()
    used_by = {}
    for side, paths in SIDES.items():
        for path in paths:
            tree = ast.parse(path.read_text())
            for name in uses(tree, imported_from_contract(tree) & set(functions)):
                used_by.setdefault(side, set()).update(functions.get(name, {name}) | {name})
    for table, cls in TABLES.items():
        assert set(cls.SIDES) == set(names_of(cls)), f"{table}.SIDES must name every entry of {table}, and no other"
        for name, (writers, readers) in cls.SIDES.items():
            writers, readers = writers.split(), readers.split()
            assert writers and readers and set(writers) | set(readers) <= set(SIDES), (table, name)
            # A file may also pass between two jobs of one side (the supervisor of a job and that of a
            # later job of the run): that side alone writes and reads it. A variable passes to another side.
            between_jobs = table == "JobPaths" and writers == readers
            assert between_jobs or any(w != r for w in writers for r in readers), \
                f"{table}.{name} does not pass between two sides, nor between two jobs of one side"
            for side in writers + readers:
                assert f"{table}.{name}" in used_by.get(side, set()), f"{table}.{name}: no module of the {side} refers to it"


def test_no_rank_imports_the_supervisor():
    """The ranks stand on the contract alone: nothing that mnist_ddp.py imports, directly or
    not, is the supervisor's."""
    found = subprocess.run([sys.executable, "-c", "import sys, mnist_ddp, ddpkit.jobs; "
                            "print([m for m in sys.modules if m.startswith('ddpkit.supervisor')])"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert found.stdout.strip() == "[]", found.stderr


# ----------------------------------------------------------------------------- the rules

def test_port_derivation_separates_jobs_and_avoids_ephemeral_ports():
    ports = {port_from_job_id(str(job)) for job in range(5000, 5100)}
    assert len(ports) == 100
    assert all(10000 <= p < 30000 for p in ports)
    assert port_from_job_id("987654") == port_from_job_id("987654")


def test_the_port_of_a_job_wraps_around_within_its_range():
    assert [port_from_job_id(job) for job in ("", "0", "19999", "20000", "20001")] == [10000, 10000, 29999, 10000, 10001]


def test_the_ranks_codes_are_read_by_rank_and_a_file_without_one_is_missing(tmp_path):
    assert read_codes(str(tmp_path / "none")) == {}
    for name, text in (("rank-0", "0\n"), ("rank-3", "75\n"), ("rank-1", "not a number\n"), ("rank-x", "1\n"),
                       ("requeue", "SIGUSR1\n"), ("rank-2", "")):
        (tmp_path / name).write_text(text)
    (tmp_path / "rank-10").mkdir()  # (not a file: unreadable)
    assert read_codes(str(tmp_path)) == {0: 0, 3: 75}
    assert JobPaths("/r", "7_1").job_dir == "/r/exit-codes/job-7_1"
    assert JobPaths("/r", "7_1").rank_code(3) == "/r/exit-codes/job-7_1/rank-3"
    assert JobPaths.of_folder("/x/job-7").requeue == "/x/job-7/requeue"
    assert (JobPaths("/r", "7").code_copy, JobPaths("/r", "7").node_failures) == \
        ("/r/code/job-7", "/r/exit-codes/node-failures-job-7")


def test_the_runs_node_failure_records_are_listed_by_job_in_the_order_the_jobs_came(tmp_path):
    run_dir = tmp_path / "run"
    assert JobPaths(str(run_dir)).node_failure_records() == []
    for job in ("10", "9", "12"):
        Path(JobPaths(str(run_dir), job).node_failures).parent.mkdir(parents=True, exist_ok=True)
        Path(JobPaths(str(run_dir), job).node_failures).write_text("n2\t1\tattempt 1, exit 4: why\n")
    Path(JobPaths(str(run_dir), "9").job_dir).mkdir()  # (a job's folder is no record)
    assert JobPaths(str(run_dir)).node_failure_records() == [(job, JobPaths(str(run_dir), job).node_failures)
                                                             for job in ("9", "10", "12")]


@pytest.mark.parametrize("given, continued", [
    (["--resume", "never", "--lr", "1e-3"], ["--lr", "1e-3"]),
    (["--resume=never", "--interrupt-at", "40:USR1", "--epochs", "2"], ["--epochs", "2"]),
    (["--interrupt-at=40:TERM", "--resume", "auto"], []),
    (["--resume", "/b/c.pt"], []),          # (the run holds a checkpoint of its own)
    (["--resume=/b/c.pt", "--max-steps", "9"], ["--max-steps", "9"]),
])
def test_what_a_restart_or_a_requeue_continues_with(tmp_path, given, continued):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "ckpt-best.pt").write_bytes(b"")  # (a user's copy: not the run's own)
    assert continuing_args(given, str(tmp_path)) == continued + (["--resume=/b/c.pt"] if "c.pt" in str(given)
                                                                          else [])
    (tmp_path / "checkpoints" / "ckpt-00000040.pt").write_bytes(b"")
    assert continuing_args(given, str(tmp_path)) == continued


def test_under_the_batch_file_the_advice_names_the_run_as_the_batch_file_does(tmp_path, monkeypatch):
    """run_training.sbatch refuses --run-name after its file name: the advice that starts
    another run names RUN_NAME there (a job submitted with --resume never into a run that
    holds checkpoints)."""
    from ddpkit.launch import UsageError
    from ddpkit.run.checkpoints import checkpoint_path, find_checkpoint
    checkpoint_path(tmp_path, 40).parent.mkdir()
    checkpoint_path(tmp_path, 40).write_bytes(b"")
    monkeypatch.delenv(JobEnv.RESUBMIT, raising=False)
    with pytest.raises(UsageError, match="pass another --run-name to start afresh, or --resume auto to continue"):
        find_checkpoint("never", False, {}, (), tmp_path)
    monkeypatch.setenv(JobEnv.RESUBMIT, "SHARED_DIR=/s sbatch run_training.sbatch")
    with pytest.raises(UsageError, match="pass another RUN_NAME to start afresh, or --resume auto to continue"):
        find_checkpoint("never", False, {}, (), tmp_path)


def test_the_hang_reports_and_the_node_faults_lines_are_written_and_read_by_one_pair_each():
    """The rank writes JobPaths.HUNG and JobPaths.NODE_FAULT with the contract's writer, and the
    supervisor reads them with its reader: what one writes, the other reads back."""
    assert hung_text([(1, "n2"), (3, "gpu-4")]) == "1 n2\n3 gpu-4\n"
    assert read_hung(hung_text([(1, "n2"), (3, "gpu-4")])) == [("1", "n2"), ("3", "gpu-4")]
    assert read_hung("") == []
    fault = "CUDA error: uncorrectable ECC error encountered"
    assert read_node_fault(node_fault_text("n3", fault)) == ("n3", fault)
    assert read_node_fault("") == ("", "")
