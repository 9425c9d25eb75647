"""ddpkit/files.py with real files: each write replaces its file whole or leaves it as it was,
and leaves no temporary behind, when it fails for real (an object pickle refuses, a full
1 MB tmpfs) or succeeds; the atomic save's error names the file. A read-only folder, through
the image sets' cache: tests/unit/test_imagesets.py.

Shared storage: make_folder with processes racing to make one deep folder, and with the
answers NFS gives another host mid-race made at a chosen moment (a parent removed between
two of Path.mkdir's steps, EEXIST for a name not yet seen): it retries those, a bounded
number of times, and raises a real error (a file in the way, EROFS) at once.
read_written_elsewhere retries ENOENT, ESTALE and a file shorter than its writer saw, then
gives up in one line that names the file and its file system.

    python -m pytest tests/unit/test_files.py
"""

import errno
import json
import multiprocessing
import os
import subprocess
import threading
import time

import pytest
import torch

import ddpkit.files
from ddpkit.files import FileNotSeen, file_system, make_folder, read_written_elsewhere, replace_json, replace_text, save_atomic
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


# ----------------------------------------------------------------------------- make_folder

def make_folders(root: str, start: threading.Barrier, rounds: int) -> None:
    start.wait()
    for n in range(rounds):
        make_folder(f"{root}/{n}/a/b/c/d/e")


def test_processes_racing_to_make_one_deep_folder_all_succeed(tmp_path):
    start = multiprocessing.Barrier(6)
    racers = [multiprocessing.Process(target=make_folders, args=(str(tmp_path), start, 40)) for _ in range(6)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(60)
    assert [racer.exitcode for racer in racers] == [0] * 6
    assert all((tmp_path / str(n) / "a/b/c/d/e").is_dir() for n in range(40))


@pytest.fixture
def mkdir_calls(monkeypatch):
    """os.mkdir as Path.mkdir calls it, with `before(path, call)` run first: another host's
    doing at that moment. Returns the paths it was called with."""
    calls, plain = [], os.mkdir

    def install(before):
        def mkdir(path, *args, **kwargs):
            calls.append(os.fspath(path))
            before(os.fspath(path), len(calls))
            return plain(path, *args, **kwargs)
        monkeypatch.setattr(os, "mkdir", mkdir)
        return calls
    monkeypatch.setattr(ddpkit.files, "FOLDER_PAUSE", 0.001)
    return install


def test_a_parent_another_rank_removes_mid_make_is_made_again(tmp_path, mkdir_calls):
    leaf = tmp_path / "shared" / "hangs"
    leaf.parent.mkdir()
    removed = []

    def remove_parent_twice(path, _):  # (another rank's cleanup of an empty folder, before each try at the leaf)
        if path == str(leaf) and len(removed) < 2:
            removed.append(path)
            os.rmdir(leaf.parent)
    mkdir_calls(remove_parent_twice)
    with pytest.raises(FileNotFoundError):  # what Path.mkdir does alone
        leaf.mkdir(parents=True, exist_ok=True)
    removed.clear()
    leaf.parent.mkdir(exist_ok=True)
    assert make_folder(leaf) == leaf and leaf.is_dir()


def test_a_folder_another_host_made_but_this_one_does_not_see_yet_is_waited_for(tmp_path, mkdir_calls):
    leaf = tmp_path / "profile" / "steps-1-3"

    def exists_elsewhere(path, call):  # (NFS: EEXIST from the server, no such name in this host's cache)
        if path == str(leaf) and call <= 2:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), path)
    mkdir_calls(exists_elsewhere)
    with pytest.raises(FileExistsError):
        leaf.mkdir(parents=True, exist_ok=True)
    assert make_folder(leaf).is_dir()


def test_make_folder_gives_up_after_its_tries(tmp_path, mkdir_calls):
    leaf = tmp_path / "gone" / "leaf"

    def parent_always_gone(path, _):
        if path == str(leaf) and leaf.parent.is_dir():
            os.rmdir(leaf.parent)
    calls = mkdir_calls(parent_always_gone)
    with pytest.raises(FileNotFoundError):
        make_folder(leaf)
    assert calls.count(str(leaf)) == 2 * ddpkit.files.FOLDER_TRIES  # (Path.mkdir tries the leaf twice each time)


@pytest.mark.parametrize("blocker", ["the folder", "a parent"])
def test_a_file_in_the_way_raises_at_once(tmp_path, mkdir_calls, blocker):
    calls = mkdir_calls(lambda *_: None)
    (tmp_path / "runs").write_text("")
    folder = tmp_path / "runs" if blocker == "the folder" else tmp_path / "runs" / "sub"
    with pytest.raises((FileExistsError, NotADirectoryError)):
        make_folder(folder)
    assert len(calls) == 1


def test_a_read_only_file_system_raises_at_once(tmp_path, mkdir_calls):
    def read_only(path, _):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
    calls = mkdir_calls(read_only)
    with pytest.raises(OSError) as raised:
        make_folder(tmp_path / "runs")
    assert raised.value.errno == errno.EROFS and len(calls) == 1


# ----------------------------------------------------------------------------- read_written_elsewhere

def test_stale_handles_are_retried(tmp_path):
    path, opens = tmp_path / "ckpt-00000010.pt", []
    path.write_bytes(b"weights")

    def read(p):
        opens.append(p)
        if len(opens) <= 3:
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), str(p))
        return p.read_bytes()
    assert read_written_elsewhere(path, read) == b"weights" and len(opens) == 4


def test_a_file_shorter_than_its_writer_saw_is_read_once_whole(tmp_path):
    path = tmp_path / "ckpt-00000010.pt"
    path.write_bytes(b"half")
    threading.Timer(0.3, lambda: path.write_bytes(b"half and the rest")).start()
    assert read_written_elsewhere(path, lambda p: p.read_bytes(), size=len(b"half and the rest")) == b"half and the rest"


def test_a_whole_file_that_does_not_load_raises_at_once(tmp_path):
    path = tmp_path / "ckpt-00000010.pt"
    path.write_bytes(b"garbage")

    def load(p):
        raise RuntimeError("PytorchStreamReader failed reading zip archive")
    began = time.monotonic()
    with pytest.raises(RuntimeError):
        read_written_elsewhere(path, load, size=len(b"garbage"), short_read=(RuntimeError,))
    assert time.monotonic() - began < 5  # (not the retries' 60 s)


def test_a_file_never_seen_is_named_with_its_file_system(tmp_path):
    path = tmp_path / "checkpoints" / "ckpt-00000010.pt"
    mount, kind = file_system(tmp_path)
    with pytest.raises(FileNotSeen) as gave_up:
        read_written_elsewhere(path, lambda p: p.read_bytes(), seconds=0.3)
    assert str(gave_up.value) == (
        f"cannot read {path} (No such file or directory) after 0.3 s of retries: it is on {kind} at {mount}, where another "
        "node wrote it, and this node does not see it whole; check that the file system is mounted alike on every node "
        f"(findmnt {mount}), then run the same command again: nothing saved is lost")


def test_the_file_system_is_the_innermost_mount(full_disk):
    assert file_system(full_disk / "ckpt.pt") == (str(full_disk), "tmpfs")
