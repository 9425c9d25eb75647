"""The layout a copier meets, read from the code with `ast`: the recipe imports the kit through
its face (ddpkit/api.py) alone, besides the launch prologue; the face lists exactly the names
the recipe uses; the supervisor imports nothing of the kit but its own wing and the job's;
no wing imports the face or the job runner above it, and the run's and the data's wings
import neither the other; the recipe stays short, and the
functions a reader of the loop meets take a handful of parameters.

    python -m pytest tests/unit/test_layout.py
"""

import ast
import inspect
import io
import tokenize
from pathlib import Path

import mnist_ddp
from ddpkit import api, jobs
from helpers.processes import ROOT

KIT = ROOT / "ddpkit"


def kit_imports(path: Path) -> set[str]:
    """The ddpkit modules a file imports (`from ddpkit.job import contract` as ddpkit.job.contract),
    anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "ddpkit"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] == "ddpkit":
            folder = ROOT.joinpath(*node.module.split("."))  # (a module of a package, or a name of a module)
            found |= {f"{node.module}.{alias.name}" if (folder / f"{alias.name}.py").exists() else node.module
                      for alias in node.names}
    return found


def code_lines(path: Path) -> int:
    """Lines that hold code: not blank, not a comment, not a docstring."""
    source = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(node) is not None:
            docstrings.update(range(node.body[0].lineno, node.body[0].end_lineno + 1))
    skipped = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    lines = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skipped:
            lines.update(n for n in range(token.start[0], token.end[0] + 1) if n not in docstrings)
    return len(lines)


def test_the_recipe_imports_the_kit_through_its_face_alone_besides_the_launch_prologue():
    assert kit_imports(ROOT / "mnist_ddp.py") == {"ddpkit.api", "ddpkit.launch"}
    prologue = next(node for node in ast.parse((ROOT / "mnist_ddp.py").read_text()).body if isinstance(node, ast.Try))
    assert ast.unparse(prologue.body[0]) == "from ddpkit import launch"  # (the stop signals, before torch loads)


def test_the_face_lists_exactly_the_names_the_recipe_uses():
    tree = ast.parse((ROOT / "mnist_ddp.py").read_text())
    used = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "kit"}
    assert used == set(api.__all__)
    assert all(name in (api.__doc__ or "") for name in api.__all__)  # each one said in a few words


def test_the_supervisor_imports_only_its_own_wing_and_the_jobs():
    for path in (KIT / "supervisor").glob("*.py"):
        outside = {name for name in kit_imports(path) if not name.startswith(("ddpkit.supervisor", "ddpkit.job."))}
        assert not outside, (path, outside)
    for path in (KIT / "job").glob("*.py"):
        assert all(name.startswith("ddpkit.job.") for name in kit_imports(path)), path


def test_no_wing_imports_the_face_or_the_job_runner_above_it_and_run_and_data_stand_apart():
    for wing in ("run", "data", "job", "supervisor"):
        for path in (KIT / wing).glob("*.py"):
            above = kit_imports(path) & {"ddpkit.api", "ddpkit.jobs"}
            assert not above, (path, above)
    for wing, other in (("run", "ddpkit.data"), ("data", "ddpkit.run")):
        for path in (KIT / wing).glob("*.py"):
            assert not any(name.startswith(other) for name in kit_imports(path)), path


def test_the_recipe_is_short_and_its_loop_takes_a_handful_of_parameters():
    assert code_lines(ROOT / "mnist_ddp.py") <= 240
    for function in (mnist_ddp.train, mnist_ddp.build_training, jobs.Job.start_run):
        parameters = [p for p in inspect.signature(function).parameters if p != "self"]
        assert len(parameters) <= 6, (function.__qualname__, parameters)


def test_the_prologues_ctrl_c_line_is_the_kits():
    """The recipe's prologue cannot import the kit's words for a Ctrl-C before training (it runs
    while the kit loads): it spells the same line."""
    from ddpkit.launch import INTERRUPTED, PROG

    assert f'print("{PROG}: error: {INTERRUPTED}", file=sys.stderr)' in (ROOT / "mnist_ddp.py").read_text()
