"""The README's and docs' figures agree with the output files they come from (make check-docs).

benchmarks/figures.py writes each figure block from docs/figures/; these tests run it as a
user would: on this checkout, and on a copy whose benchmark file changed.

    python -m pytest tests/unit/test_figures.py
"""

import ast
import datetime
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.options import TRACKER_PACKAGES
from helpers.processes import ROOT

FIGURES_SCRIPT = ROOT / "benchmarks" / "figures.py"


def figures(*args: str, root: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(root / "benchmarks" / "figures.py"), *args], capture_output=True, text=True,
                          timeout=120)


def test_the_readme_and_docs_agree_with_their_figure_files():
    result = figures()
    assert result.returncode == 0, result.stdout + result.stderr
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    blocks = [name for page in pages for name in re.findall(r"<!-- figures: (\S+) -->", page.read_text())]
    assert {"benchmark-summary", "benchmark-table", "ranks-table", "sweep-summary", "test-times", "lr-rule-gain"} <= set(blocks)


def test_every_figure_file_names_its_machine_and_date():
    for path in (ROOT / "docs" / "figures").glob("*.json"):
        machine = json.loads(path.read_text())["machine"]
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", machine["date"]), path
        assert machine["cpu"] and machine["cores"], path


def test_a_page_that_disagrees_with_its_files_fails_the_check_until_written(tmp_path):
    copy = tmp_path / "project"
    (copy / "benchmarks").mkdir(parents=True)
    shutil.copy(ROOT / "README.md", copy)
    shutil.copy(ROOT / "mnist_ddp.py", copy)  # its manual's figures
    shutil.copytree(ROOT / "docs", copy / "docs")
    for name in ("bench.py", "figures.py"):
        shutil.copy(ROOT / "benchmarks" / name, copy / "benchmarks")
    bench = json.loads((copy / "docs" / "figures" / "bench.json").read_text())
    bench["default"]["time_to_target_s"] = 4321.0
    (copy / "docs" / "figures" / "bench.json").write_text(json.dumps(bench))

    stale = figures(root=copy)
    assert stale.returncode == 1
    assert stale.stdout.splitlines() == [
        "figures.py: mnist_ddp.py: What it reaches differ from docs/figures/; run: python benchmarks/figures.py write",
        "figures.py: README.md: benchmark-summary differ from docs/figures/; run: python benchmarks/figures.py write",
        "figures.py: docs/benchmark.md: benchmark-table differ from docs/figures/; run: python benchmarks/figures.py write"]

    assert figures("write", root=copy).returncode == 0
    assert "4321.0 s from process start" in (copy / "README.md").read_text()
    assert figures(root=copy).returncode == 0
    # Only the blocks changed: everything outside them is as it was.
    strip = lambda text: re.sub(r"<!-- figures: \S+ -->.*?<!-- /figures -->", "", text, flags=re.S)
    assert strip((copy / "README.md").read_text()) == strip((ROOT / "README.md").read_text())


def copy_of_project(tmp_path: Path) -> Path:
    copy = tmp_path / "project"
    (copy / "benchmarks").mkdir(parents=True)
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copy(ROOT / "mnist_ddp.py", copy)
    for name in ("bench.py", "figures.py"):
        shutil.copy(ROOT / "benchmarks" / name, copy / "benchmarks")
    return copy


def test_a_block_of_no_known_name_or_without_its_end_is_refused_in_one_line(tmp_path):
    copy = copy_of_project(tmp_path)
    (copy / "README.md").write_text("Speed: <!-- figures: speed -->fast<!-- /figures -->\n")
    result = figures(root=copy)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith(
        "figures.py: README.md: no figure block is called 'speed'; the blocks: ")
    # An unclosed block would swallow the text up to the next block's end: refused instead.
    text = "A <!-- figures: sweep-source -->x\n\nprose to keep\n\nB <!-- figures: sweep-source -->y<!-- /figures -->\n"
    (copy / "README.md").write_text(text)
    for command in ("check", "write"):
        result = figures(command, root=copy)
        assert result.returncode == 1 and "has no `<!-- /figures -->` before the next block" in result.stderr
    assert (copy / "README.md").read_text() == text


def test_a_quick_benchmark_is_not_taken_for_the_figures(tmp_path):
    copy = copy_of_project(tmp_path)
    shutil.copy(ROOT / "README.md", copy)
    out = tmp_path / "bench-out"
    out.mkdir()
    (out / "bench.json").write_text(json.dumps({**json.loads((ROOT / "docs/figures/bench.json").read_text()), "quick": True}))
    before = (copy / "docs/figures/bench.json").read_text()
    result = figures("write", "--bench-out", str(out), root=copy)
    assert result.returncode == 1 and "is from bench.py --quick or --gpu" in result.stderr
    assert (copy / "docs/figures/bench.json").read_text() == before


# ----------------------------------------------------------------------------- the manual (--help)

# A measured figure as the manual writes one: a percentage, a decimal time or ratio, an approximate time.
FIGURE = re.compile(r"\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)? ?%|\d+\.\d+ ?(?:s|x)\b|~\d+ ?s\b")
IGNORED = shutil.ignore_patterns(".git", ".venv", "runs", "mutants", "bench-out", "__pycache__", ".pytest_cache")


def whole_copy(tmp_path: Path) -> Path:
    """The checkout as a user has it, without its environment and outputs."""
    copy = tmp_path / "project"
    shutil.copytree(ROOT, copy, ignore=IGNORED)
    return copy


def manual(root: Path) -> str:
    result = subprocess.run([sys.executable, str(root / "mnist_ddp.py"), "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.slow
def test_every_figure_in_help_is_written_from_the_figure_files_and_checked(tmp_path):
    """Every measured figure that --help shows moves when the files it comes from move, and
    make check-docs fails until the manual is written again: none is copied by hand."""
    copy = whole_copy(tmp_path)
    before = manual(copy)
    assert FIGURE.findall(before), "the manual shows no measured figure at all"

    def scaled(value):  # every measurement 0.8 times what it was; counts, seeds and the machine stay
        if isinstance(value, dict):
            return {k: v if k == "machine" else scaled(v) for k, v in value.items()}
        if isinstance(value, list):
            return [scaled(v) for v in value]
        return value * 0.8 if isinstance(value, float) else value
    for name in ("sample.json", "bench.json", "ranks.json"):
        path = copy / "docs" / "figures" / name
        path.write_text(json.dumps(scaled(json.loads(path.read_text()))))

    stale = figures(root=copy)
    assert stale.returncode == 1
    assert "figures.py: mnist_ddp.py: What it reaches differ from docs/figures/; run: python benchmarks/figures.py write" \
        in stale.stdout.splitlines()
    assert figures("write", root=copy).returncode == 0 and figures(root=copy).returncode == 0
    after = manual(copy)
    unmoved = [figure for figure in FIGURE.findall(before) if figure in FIGURE.findall(after)]
    assert not unmoved, f"figures in --help that no figure file writes: {unmoved}"


def test_every_block_of_measured_figures_names_its_machine_and_date():
    not_measured = {"hparams-columns", "tensorboard-output"}  # a count of options, a command's output
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    for page in pages:
        for name, text in re.findall(r"<!-- figures: (\S+) -->(.*?)<!-- /figures -->", page.read_text(), re.S):
            if name not in not_measured:
                assert re.search(r"\d{4}-\d\d-\d\d", text), f"{page.name}: the block {name} names no date"
                assert "cores" in text or "Machine:" in text, f"{page.name}: the block {name} names no machine"


# ----------------------------------------------------------------------------- the suite's figures

def junit_file(path: Path, seconds: float, cases: list[tuple[str, str]], start: float = 0) -> str:
    """A pytest --junitxml file whose cases all passed, of a session that began `start` seconds
    after a fixed moment and lasted `seconds`."""
    began = datetime.datetime(2026, 11, 27, 9, tzinfo=datetime.timezone.utc) + datetime.timedelta(seconds=start)
    path.write_text(f'<testsuites><testsuite name="pytest" time="{seconds}" timestamp="{began.isoformat()}">' + "".join(
        f'<testcase classname="{module}" name="{name}" time="1.0"/>' for module, name in cases) + "</testsuite></testsuites>")
    return str(path)


@pytest.mark.slow
def test_the_fast_tier_figure_comes_from_a_run_of_exactly_that_tier(tmp_path):
    """`figures.py tests` adds up make test's parts, Slurm groups that run at the same time as
    the longer of them, and takes the fast tier's figure only from a run that holds
    exactly the tests the markers leave in it (neither slurm, by folder, nor slow): one more,
    or one fewer, is refused."""
    copy = whole_copy(tmp_path)
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m",
                                "not slurm and not slow", "tests/unit/test_recovery.py"], cwd=ROOT, capture_output=True, text=True)
    fast = [("tests.unit.test_recovery", line.split("::")[-1]) for line in collected.stdout.splitlines() if "::" in line]
    assert ("tests.unit.test_recovery", "test_checkpoint_clock_with_a_fake_clock") in fast
    slurm = [("tests.cluster.one_node.test_recovery_on_slurm", "test_a_crash_loop_gives_up_after_max_restarts")]
    other = [("tests.cluster.mostly_waiting.test_recovery_across_nodes", "test_a_lost_node_requeues_the_job_onto_the_nodes_left")]
    parts = [junit_file(tmp_path / "a.xml", 91.5, fast), junit_file(tmp_path / "b.xml", 300.0, slurm, start=91.5),
             junit_file(tmp_path / "c.xml", 250.0, other, start=92.0)]  # (b and c at once: 391.5 s in all)
    for wrong, said in ((fast + slurm, "1 tests outside it, 0 of it missing"), (fast[1:], "0 tests outside it, 1 of it missing")):
        result = figures("tests", *parts, "--fast", junit_file(tmp_path / "f.xml", 12.5, wrong), root=copy)
        assert result.returncode == 1 and f"is not a run of the fast tier (make test-fast): {said}" in result.stderr
    result = figures("tests", *parts, "--fast", junit_file(tmp_path / "f.xml", 12.5, fast), root=copy)
    assert result.returncode == 0, result.stdout + result.stderr
    written = json.loads((copy / "docs" / "figures" / "tests.json").read_text())
    assert {k: v for k, v in written.items() if k != "machine"} == \
        {"tests": len(fast) + 2, "seconds": 391.5, "fast_tests": len(fast), "fast_seconds": 12.5}


# ----------------------------------------------------------------------------- claims the pages make

def exit_codes_of_the_manual() -> set[str]:
    text = ast.get_docstring(ast.parse((ROOT / "mnist_ddp.py").read_text()))
    section = text.split("\nExit codes\n", 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r"^ {0,3}(\d+)  ", section, re.M))


def test_the_readme_table_lists_every_exit_code_the_manual_and_launch_define():
    from ddpkit.job import contract
    defined = {str(value) for name, value in vars(contract).items() if name.startswith("EXIT_")}
    in_manual = exit_codes_of_the_manual()
    assert defined <= in_manual, f"--help lacks {defined - in_manual}"
    table = (ROOT / "README.md").read_text().split("| code | meaning |", 1)[1].split("\n\n", 1)[0]
    in_readme = set(re.findall(r"^\| (\d+) \|", table, re.M))
    assert in_manual <= in_readme, f"the README's exit code table lacks {in_manual - in_readme}"


def test_clusters_md_names_every_setting_of_the_batch_file_header():
    header = (ROOT / "run_training.sbatch").read_text().split("# Settings, as environment variables", 1)[1]
    header = header.split("\n#\n", 1)[0]
    settings = {name for names in re.findall(r"^#   ([A-Z_]+(?:, [A-Z_]+)*) ", header, re.M) for name in names.split(", ")}
    assert {"MAX_RESTARTS", "PROJECT_DIR", "SWEEP_FILE", "SIGNAL"} <= settings  # (the header is read as meant)
    section = (ROOT / "docs" / "clusters.md").read_text().split("## Settings", 1)[1].split("\n## ", 1)[0]
    assert not [name for name in settings if f"`{name}`" not in section]


def test_the_cluster_quick_start_asks_for_a_gpu_where_it_sets_a_gpu_partition():
    quick_start = (ROOT / "README.md").read_text().split("## Cluster quick start", 1)[1].split("\n## ", 1)[0]
    assert "SBATCH_PARTITION=gpu" in quick_start
    submit = next(line for line in quick_start.splitlines() if "sbatch" in line and "run_training.sbatch" in line)
    assert re.search(r"--gpus(-per-node|-per-task)?=\d|--gres=gpu", submit.split("run_training.sbatch")[0]), submit


def requirements(name: str) -> set[str]:
    lines = (ROOT / name).read_text().splitlines()
    return {re.match(r"[A-Za-z0-9_.-]+", line).group(0).lower() for line in lines
            if line and not line.startswith(("#", "-r"))}


def test_requirements_name_every_package_the_code_imports():
    """requirements.txt names every package the code imports; the trackers' packages, which
    only ddpkit/run/trackers.py imports (when asked for), requirements-dev.txt names instead."""
    local = {"ddpkit", "mnist_ddp", "sweep"}
    distribution = {"PIL": "pillow"}  # an import name that is not its package's
    imported, optional = set(), set(TRACKER_PACKAGES.values())
    for path in [ROOT / "mnist_ddp.py", ROOT / "sweep.py", *(ROOT / "ddpkit").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = {node.module.split(".")[0]}
            else:
                continue
            assert path.name == "trackers.py" or not names & optional, (path, names)
            imported |= names
    third_party = {distribution.get(name, name) for name in imported - local - set(sys.stdlib_module_names)}
    required = requirements("requirements.txt")
    assert third_party - optional <= required, f"imported but not in requirements.txt: {third_party - optional - required}"
    assert optional <= requirements("requirements-dev.txt") and not optional & required


def test_the_launching_commands_find_torch_and_torchrun_after_make_run_and_the_readmes_first_line():
    """README "Launching" opens with the line that makes its commands work after `make run`
    (which installs into .venv without activating it, as make cannot): run in a shell whose
    PATH holds no torchrun, it gives `python` a torch and puts `torchrun` on the PATH."""
    section = (ROOT / "README.md").read_text().split("\n## Launching\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    lines = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    commands = [line for line in lines if line.startswith(("python ", "torchrun ", "srun ", "sbatch "))]
    assert any(line.startswith("python mnist_ddp.py") for line in commands) and any(
        line.startswith("torchrun ") for line in commands), block
    first = " && ".join(lines[:lines.index(commands[0])])
    assert first, f"nothing before the Launching commands makes them work after `make run`:\n{block}"
    assert (ROOT / ".venv" / "bin" / "activate").is_file(), "make run (or make test) makes .venv; run it first"
    path = ":".join(d for d in ["/usr/local/bin", "/usr/bin", "/bin"] if not (Path(d) / "torchrun").exists())
    probe = "python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec(\"torch\") is None)' && command -v torchrun"
    result = subprocess.run(["bash", "-c", f"{first} && {probe}"], cwd=ROOT, env={"PATH": path, "HOME": "/tmp"},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"after {first!r}: {result.stdout}{result.stderr}"
    assert Path(result.stdout.strip()).parent == ROOT / ".venv" / "bin"


def test_what_it_does_md_and_evaluates_docstring_count_its_all_reduces():
    """"Evaluation is exact" names as many all-reduces as `evaluate` makes (a collective a
    reader of the page counts on), and so does evaluate's docstring."""
    tree = ast.parse((ROOT / "mnist_ddp.py").read_text())
    evaluate = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "evaluate")
    calls = [node for node in ast.walk(evaluate) if isinstance(node, ast.Call)
             and (getattr(node.func, "id", "") == "all_reduce" or getattr(node.func, "attr", "") == "all_reduce")]
    said = {1: "one all-reduce", 2: "two all-reduces", 3: "three all-reduces"}[len(calls)]
    bullet = (ROOT / "docs" / "what-it-does.md").read_text().split("**Evaluation is exact.**", 1)[1].split("\n- ", 1)[0]
    assert said in " ".join(bullet.split()), bullet
    assert said in " ".join(ast.get_docstring(evaluate).split())


def test_tensorboard_md_lists_the_hparams_columns_in_the_order_they_are_declared():
    """tensorboard.md's HPARAMS row names the options in the order HParams.of_run declares
    them, and those it shows first outside a sweep as SHOWN_FIRST orders them."""
    import mnist_ddp
    from ddpkit.run.runlog import SHOWN_FIRST, HParams
    row = next(line for line in (ROOT / "docs" / "tensorboard.md").read_text().splitlines() if line.startswith("| HPARAMS |"))
    declared = row.split("every option of the recipe", 1)[1].split("; against", 1)[0]
    assert re.findall(r"`(\w+)`", declared) == list(HParams.of_run(mnist_ddp.Recipe(), batch_size=128, world_size=1, amp=False).values)
    first = row.split("(else ", 1)[1].split(")", 1)[0]
    assert tuple(re.findall(r"`(\w+)`", first)) == SHOWN_FIRST


def test_tests_md_counts_the_unit_tests_that_the_fast_tier_leaves_out():
    """tests.md says how many unit tests are marked `slow` (make test-fast leaves them out):
    each mark on a test or a parametrization; none on a whole unit test file."""
    files = list((ROOT / "tests" / "unit").glob("test_*.py"))
    assert not [path for path in files if re.search(r"^pytestmark\b.*slow", path.read_text(), re.M)]
    marked = sum(len(re.findall(r"^@pytest\.mark\.slow$|marks=pytest\.mark\.slow\b", path.read_text(), re.M)) for path in files)
    text = " ".join((ROOT / "docs" / "tests.md").read_text().split())
    assert f"every unit test but the {marked} marked `slow`" in text


def test_the_readme_stays_under_300_lines():
    """The README is what a newcomer reads first: under 300 lines, its detail in docs/*.md."""
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines < 300, f"README.md has {lines} lines; move detail into the docs/*.md page it links"
