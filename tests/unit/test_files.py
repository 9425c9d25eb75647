"""ddpkit/files.py with real files: each write replaces its file whole or leaves it as it was,
and leaves no temporary behind, when it fails for real (an object pickle refuses, a full
1 MB tmpfs) or succeeds; the atomic save's error names the file. A read-only folder, through
the image sets' cache: tests/unit/test_imagesets.py.

    python -m pytest tests/unit/test_files.py
"""

import errno
import json
import subprocess

import pytest
import torch

from ddpkit.files import replace_json, replace_text, save_atomic
from ddpkit.run.checkpoints import remove_stale_temporaries
from helpers.checkpoints import names


@pytest.fixture
def full_disk(tmp_path):
    """A real 1 MB tmpfs (docs: /work/shared/notes/odd-cases.md), unmounted afterwards."""
    folder = tmp_path / "small"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield folder
    subprocess.run(["umount", str(folder)], check=True)


def test_save_atomic_writes_the_file_and_nothing_else(tmp_path):
    save_atomic({"x": torch.arange(3)}, tmp_path / "a.pt")
    assert names(tmp_path) == ["a.pt"]
    assert torch.equal(torch.load(tmp_path / "a.pt")["x"], torch.arange(3))


def test_a_failed_save_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "ckpt-00000002.pt"
    save_atomic({"step": 2}, path)
    before = path.read_bytes()
    with pytest.raises(Exception, match="pickle"):
        save_atomic({"step": 4, "hook": lambda: None}, path)  # a lambda cannot be pickled
    assert path.read_bytes() == before
    assert names(tmp_path) == ["ckpt-00000002.pt"]


def test_a_save_that_fills_the_disk_names_the_file_and_cleans_up(full_disk):
    path = full_disk / "ckpt-00000002.pt"
    save_atomic({"step": 2}, path)
    before = path.read_bytes()
    with pytest.raises(OSError) as failed:
        save_atomic({"weights": torch.zeros(500_000)}, path)  # 2 MB
    assert (failed.value.errno, failed.value.filename) == (errno.ENOSPC, str(path))
    assert path.read_bytes() == before
    assert names(full_disk) == ["ckpt-00000002.pt"]


def test_text_that_fills_the_disk_keeps_the_old_file_and_cleans_up(full_disk):
    path = full_disk / "metrics.jsonl"
    replace_text(path, "one\n")
    with pytest.raises(OSError) as failed:
        replace_text(path, "x" * 2_000_000)
    assert failed.value.errno == errno.ENOSPC
    assert path.read_text() == "one\n"
    assert names(full_disk) == ["metrics.jsonl"]


def test_json_is_one_line_or_indented_and_a_kept_temporary_is_not_swept(tmp_path):
    """suffix ".": a writer that outlives the run's claim of its directory (the tracker's
    sender) names its temporary so that remove_stale_temporaries leaves it alone."""
    replace_json(tmp_path / "run.json", {"a": [1, 2]})
    replace_json(tmp_path / "tracker.json", {"a": 1}, indent=1, suffix=".")
    assert (tmp_path / "run.json").read_text() == '{"a": [1, 2]}\n'
    assert json.loads((tmp_path / "tracker.json").read_text()) == {"a": 1}
    assert "\n " in (tmp_path / "tracker.json").read_text()
    (tmp_path / ".tracker.json.77").write_text("{")  # (another process's write under way)
    (tmp_path / ".run.json.tmp-77").write_text("{")  # (a write that never finished)
    assert remove_stale_temporaries(tmp_path) == [tmp_path / ".run.json.tmp-77"]
    assert names(tmp_path) == [".tracker.json.77", "run.json", "tracker.json"]
