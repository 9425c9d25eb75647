"""The README's and docs' figures agree with the output files they come from (make check-docs).

benchmarks/figures.py writes each figure block from docs/figures/; these tests run it as a
user would: on this checkout, and on a copy whose benchmark file changed.

    python -m pytest tests/test_figures.py
"""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURES_SCRIPT = ROOT / "benchmarks" / "figures.py"


def figures(*args: str, root: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(root / "benchmarks" / "figures.py"), *args], capture_output=True, text=True,
                          timeout=120)


def test_the_readme_and_docs_agree_with_their_figure_files():
    result = figures()
    assert result.returncode == 0, result.stdout + result.stderr
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    blocks = [name for page in pages for name in re.findall(r"<!-- figures: (\S+) -->", page.read_text())]
    assert {"benchmark-summary", "benchmark-table", "ranks-table", "sweep-summary", "test-times"} <= set(blocks)


def test_every_figure_file_names_its_machine_and_date():
    for path in (ROOT / "docs" / "figures").glob("*.json"):
        machine = json.loads(path.read_text())["machine"]
        assert re.fullmatch(r"\d{4}-\d\d-\d\d", machine["date"]), path
        assert machine["cpu"] and machine["cores"], path


def test_a_page_that_disagrees_with_its_files_fails_the_check_until_written(tmp_path):
    copy = tmp_path / "project"
    (copy / "benchmarks").mkdir(parents=True)
    shutil.copy(ROOT / "README.md", copy)
    shutil.copytree(ROOT / "docs", copy / "docs")
    for name in ("bench.py", "figures.py"):
        shutil.copy(ROOT / "benchmarks" / name, copy / "benchmarks")
    bench = json.loads((copy / "docs" / "figures" / "bench.json").read_text())
    bench["default"]["time_to_target_s"] = 4321.0
    (copy / "docs" / "figures" / "bench.json").write_text(json.dumps(bench))

    stale = figures(root=copy)
    assert stale.returncode == 1
    assert stale.stdout.splitlines() == [
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
