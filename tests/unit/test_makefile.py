"""make test's second part, the Slurm groups at once (the Makefile's test-slurm), run by
real make and bash with a stand-in for pytest in the .venv: every folder of tests/cluster is
a group it runs, and a group that fails fails make, however long before the others it ends.
(The groups themselves: tests/cluster/.)

    python -m pytest tests/unit/test_makefile.py
"""

import subprocess

import pytest

from helpers.processes import ROOT

# What the stand-in does for each group, by its name: its line, then its exit status.
STAND_IN = """#!/bin/bash
group=${@: -1}; group=${group##*/}
case $group in
    fails-first) echo "1 failed"; exit 1 ;;
    passes-late) sleep 2; echo "1 passed"; exit 0 ;;
    *) echo "1 passed"; exit 0 ;;
esac
"""


def make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_make_test_runs_every_group_of_the_slurm_tests():
    """Each folder of tests/cluster is a group that make test runs in a pytest process of its
    own (SLURM_GROUPS, as make itself reads it): a new folder left out of it would never run."""
    printed = make("-s", "--eval", "print-groups: ; @echo $(SLURM_GROUPS)", "print-groups")
    assert printed.returncode == 0, printed.stderr
    folders = {p.parent.name for p in (ROOT / "tests" / "cluster").glob("*/test_*.py")}
    assert sorted(printed.stdout.split()) == sorted(folders) and len(folders) == 3


@pytest.fixture
def stand_in_venv(tmp_path):
    """A .venv whose python is the stand-in, its install marks newer than the requirements."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(STAND_IN)
    (venv / "bin" / "python").chmod(0o755)
    for mark in (".installed", ".installed-dev"):
        (venv / mark).touch()
    return venv


def test_a_group_that_fails_fails_make_even_when_it_ends_before_the_others(stand_in_venv):
    result = make("test-slurm", f"VENV={stand_in_venv}", "SLURM_GROUPS=passes-late fails-first passes")
    assert result.returncode != 0, result.stdout
    lines = result.stdout.splitlines()
    assert "[fails-first] 1 failed" in lines and "[passes-late] 1 passed" in lines, result.stdout
    assert [line for line in lines if line.startswith("Slurm tests: ")] == [
        "Slurm tests: passes-late exit 0", "Slurm tests: fails-first exit 1", "Slurm tests: passes exit 0"]


def test_groups_that_all_pass_pass_make(stand_in_venv):
    result = make("test-slurm", f"VENV={stand_in_venv}", "SLURM_GROUPS=passes-late passes")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Slurm tests: passes-late exit 0" in result.stdout.splitlines()
