"""ddpkit/data/staging.py's node-local copy of an image folder: it carries the cached statistics,
follows changes (copied again once the folder changed), follows symlinks and refuses a loop.
Staging for real over HTTP: tests/runs/test_staging.py.

    python -m pytest tests/unit/test_node_local_copy.py
"""


import pytest
import torch

from helpers.images import make_image_folder


def test_image_folder_copy_to_the_node_carries_the_statistics_and_follows_changes(tmp_path, capsys):
    """--node-data-dir with --dataset folder: the first copy brings train/, test/ and the
    cached statistics (so no node measures the pixels again); an unchanged folder is not
    copied twice; a folder that changed since (an image added) is copied anew."""
    from ddpkit.data.imagesets import read_splits
    from ddpkit.data.staging import STATS_FILE, copy_folder
    from ddpkit.distributed import Runtime
    one = Runtime(0, 0, 1, torch.device("cpu"), "none", True)
    shared = make_image_folder(tmp_path / "shared", {"train": 2, "test": 1}, size=8)
    read_splits("folder", shared, "memory", one, 1)  # measures once, caching beside the data
    local = tmp_path / "node"
    assert copy_folder(shared, local) is True
    assert (local / STATS_FILE).read_bytes() == (shared / STATS_FILE).read_bytes()
    assert sorted(p.name for p in (local / "train" / "row").iterdir()) == ["000.png", "001.png"]
    capsys.readouterr()
    read_splits("folder", local, "memory", one, 1)
    assert "measuring the pixels" not in capsys.readouterr().out  # the copied cache is current there
    assert copy_folder(shared, local) is False
    (shared / "train" / "row" / "002.png").write_bytes((shared / "train" / "row" / "000.png").read_bytes())
    assert copy_folder(shared, local) is True
    assert (local / "train" / "row" / "002.png").is_file()


def test_node_local_copy_of_an_image_folder_follows_symlinks_but_refuses_a_loop(tmp_path):
    """The copy walks the folder as training lists it: a symlinked image is copied as a file,
    a symlink loop is refused by name before anything is copied."""
    from ddpkit.data.staging import copy_folder
    from ddpkit.launch import UsageError
    shared, local = make_image_folder(tmp_path / "shared", {"train": 1, "test": 1}, size=8), tmp_path / "node"
    (shared / "train" / "row" / "linked.png").symlink_to(shared / "test" / "row" / "000.png")
    assert copy_folder(shared, local) is True
    copied = local / "train" / "row" / "linked.png"
    assert not copied.is_symlink() and copied.read_bytes() == (shared / "test" / "row" / "000.png").read_bytes()
    (shared / "test" / "row" / "loop").symlink_to("..")
    with pytest.raises(UsageError) as refused:
        copy_folder(shared, tmp_path / "other-node")
    assert str(refused.value).startswith(f"{shared / 'test' / 'row' / 'loop'} leads to {shared / 'test'} again")
    assert not (tmp_path / "other-node").exists()
