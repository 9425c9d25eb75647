"""ddpkit/run/checkpoints.py, at unit level with real files and torch.save/torch.load (the
atomic save itself: tests/unit/test_files.py): the temporaries of saves that never finished,
checkpoint names (by step, never by name; a user's copy under another name left alone), setting later checkpoints aside, rotation, the choice of the checkpoint to
resume from (damaged files, every field checked, other options, --allow-changes, --resume
never), and loading one into a model and optimizer (shapes that differ, other classes or
images, the hyperparameters given now). End to end, with real runs:
tests/runs/test_checkpoints_runs.py.

    python -m pytest tests/unit/test_checkpoints.py
"""

import dataclasses
import re
import shutil
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import ddpkit.files
from ddpkit.distributed import Runtime
from ddpkit.launch import HeldUp, UsageError
from ddpkit.run.checkpoints import (
    Progress,
    RunState,
    checkpoint_differences,
    checkpoint_step,
    find_checkpoint,
    read_checkpoint,
    remove_stale_temporaries,
    resume_from,
    save_checkpoint,
    set_aside_checkpoints,
)
from helpers.checkpoints import BROKEN, names

ONE = Runtime(0, 0, 1, torch.device("cpu"), "none", True)
RECIPE = {"epochs": 3, "lr": 0.1, "seed": 0}
CHANGEABLE = ("epochs", "lr")


def model_and_optimizer(out: int = 2, lr: float = 0.1, weight_decay: float = 0.01, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Linear(3, out)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    return model, optimizer


def take_a_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.ones(4, 3)).square().sum().backward()
    optimizer.step()


def save(run_dir, step: int, recipe: dict = RECIPE, keep: int = 10, state: dict | None = None,
         loss_sum: torch.Tensor | None = None, classes: tuple[str, ...] = ("cat", "dog"),
         shape: tuple[int, int, int] | None = None):
    if state is None:
        model, optimizer = model_and_optimizer()
        state = {"model": model, "optimizer": optimizer, "average": None}
    loss_sum = torch.zeros(2, dtype=torch.float64) if loss_sum is None else loss_sum
    plan = SimpleNamespace(classes=classes, shape=shape, global_batch=128)  # (what a checkpoint records of a RunPlan)
    run = RunState(state=state, progress=Progress(epoch=1, step_in_epoch=step, step=step), loss_sums=loss_sum,
                   config=recipe)
    return save_checkpoint(run_dir, plan, run, ONE, keep=keep)


# ----------------------------------------------------------------------------- names, temporaries, setting aside

@pytest.mark.parametrize("name, step", [
    ("ckpt-00000120.pt", 120), ("ckpt-00000000.pt", 0), ("ckpt-123456789.pt", 123456789),
    ("model.pt", -1), ("ckpt-00000120.pt.bak", -1), (".ckpt-00000120.pt.tmp-77", -1), ("ckpt-12a.pt", -1),
    # Names a user gives a copy: only the name a run writes for a step is that step's checkpoint.
    ("ckpt-best.pt", -1), ("ckpt-120.pt", -1), ("ckpt-0000000120.pt", -1), ("ckpt-00000120 copy.pt", -1),
])
def test_checkpoint_step(tmp_path, name, step):
    assert checkpoint_step(tmp_path / name) == step


def test_remove_stale_temporaries(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    stale = [tmp_path / ".metrics.jsonl.tmp-4242", checkpoints / ".ckpt-00000002.pt.tmp-17"]
    kept = [tmp_path / "metrics.jsonl", tmp_path / ".claim", tmp_path / "notes.tmp-12", tmp_path / ".x.tmp-abc",
            checkpoints / "ckpt-00000002.pt"]
    for path in stale + kept:
        path.write_text("x")
    (checkpoints / ".odd.tmp-5").mkdir()  # a directory is not a temporary file
    assert remove_stale_temporaries(tmp_path) == [stale[0], stale[1]]
    assert not any(p.exists() for p in stale)
    assert all(p.exists() for p in kept) and (checkpoints / ".odd.tmp-5").is_dir()
    assert remove_stale_temporaries(tmp_path / "missing") == []


def test_set_aside_moves_later_checkpoints_but_the_one_kept(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    for step in (2, 4, 6, 8):
        (checkpoints / f"ckpt-{step:08d}.pt").write_text(str(step))
    started = time.strftime("%Y%m%d-%H%M%S")
    moved = set_aside_checkpoints(tmp_path, 4, keep=str(checkpoints / "ckpt-00000006.pt"))
    assert moved == [checkpoints / "ckpt-00000004.pt", checkpoints / "ckpt-00000008.pt"]
    assert names(checkpoints) == ["ckpt-00000002.pt", "ckpt-00000006.pt", "superseded"]
    [aside] = (checkpoints / "superseded").iterdir()
    stamp = re.fullmatch(r"(\d{8}-\d{6})-going-on-from-step-4", aside.name)
    assert stamp and started <= stamp.group(1) <= time.strftime("%Y%m%d-%H%M%S")
    assert names(aside) == ["ckpt-00000004.pt", "ckpt-00000008.pt"]
    assert (aside / "ckpt-00000008.pt").read_text() == "8"  # moved, not rewritten


def test_set_aside_with_nothing_later_makes_no_folder(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "ckpt-00000002.pt").write_text("2")
    assert set_aside_checkpoints(tmp_path, 3) == []
    assert names(tmp_path / "checkpoints") == ["ckpt-00000002.pt"]


# ----------------------------------------------------------------------------- save_checkpoint

def test_save_checkpoint_keeps_the_newest_up_to_the_step(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    (checkpoints / "ckpt-00000009.pt").write_text("a later file, which a rewound run resumed from")
    for step in range(1, 6):
        path = save(tmp_path, step, keep=2)
        assert path == checkpoints / f"ckpt-{step:08d}.pt"
    assert names(checkpoints) == ["ckpt-00000004.pt", "ckpt-00000005.pt", "ckpt-00000009.pt"]


def test_save_checkpoint_holds_what_resuming_needs(tmp_path):
    model, optimizer = model_and_optimizer()
    take_a_step(model, optimizer)
    path = save(tmp_path, 7, state={"model": model, "optimizer": optimizer, "average": None},
                loss_sum=torch.tensor([3.5, 10.0], dtype=torch.float64))
    ckpt = read_checkpoint(path, "cpu")
    assert (ckpt["format"], ckpt["config"], ckpt["world_size"], ckpt["average"]) == (1, RECIPE, 1, None)
    assert ckpt["progress"] == dataclasses.asdict(Progress(epoch=1, step_in_epoch=7, step=7))
    torch.testing.assert_close(ckpt["model"], model.state_dict())
    assert ckpt["optimizer"]["state"][0]["step"] == 1
    [rank_state] = ckpt["rank_states"]
    assert torch.equal(rank_state["loss_sum"], torch.tensor([3.5, 10.0], dtype=torch.float64))
    assert names(tmp_path / "checkpoints") == ["ckpt-00000007.pt"]  # no temporary left


def test_a_state_named_like_a_checkpoint_key_does_not_replace_it(tmp_path):
    model, optimizer = model_and_optimizer()
    state = {"model": model, "optimizer": optimizer, "config": nn.Linear(2, 1)}  # e.g. a recipe's own "config" module
    try:
        path = save(tmp_path, 2, state=state)
    except (ValueError, UsageError) as refused:  # refusing the name up front is a fix too
        assert "config" in str(refused)
        return
    assert find_checkpoint("auto", False, RECIPE, CHANGEABLE, tmp_path) == (path, "")


# ----------------------------------------------------------------------------- find_checkpoint

def test_find_checkpoint_takes_the_newest(tmp_path):
    save(tmp_path, 2)
    newest = save(tmp_path, 4)
    assert find_checkpoint("auto", False, RECIPE, CHANGEABLE, tmp_path) == (newest, "")


def test_find_checkpoint_skips_a_truncated_file_with_a_warning(tmp_path, capsys):
    good = save(tmp_path, 2)
    torn = tmp_path / "checkpoints" / "ckpt-00000004.pt"
    torn.write_bytes(good.read_bytes()[:300])  # a save cut short, by hand
    assert find_checkpoint("auto", False, RECIPE, CHANGEABLE, tmp_path) == (good, "")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"warning: skipping checkpoint {torn}: "), lines


def test_find_checkpoint_refuses_a_truncated_file_named_by_resume(tmp_path):
    torn = tmp_path / "elsewhere.pt"
    torn.write_bytes(save(tmp_path, 2).read_bytes()[:300])
    with pytest.raises(UsageError, match=rf"^cannot resume from {re.escape(str(torn))}: .+") as refused:
        find_checkpoint(str(torn), False, RECIPE, CHANGEABLE, tmp_path)
    assert "\n" not in str(refused.value)


def test_find_checkpoint_refuses_another_recipe_in_one_line(tmp_path):
    path = save(tmp_path, 2)
    for allow_changes in (False, True):  # --allow-changes does not let --seed differ
        with pytest.raises(UsageError) as refused:
            find_checkpoint("auto", allow_changes, {**RECIPE, "seed": 1, "lr": 0.2}, CHANGEABLE, tmp_path)
        assert str(refused.value) == (f"checkpoint {path} is from a different configuration (--lr 0.1 there, 0.2 here; "
                                      "--seed 0 there, 1 here); resume with the same options, or pass another "
                                      "--run-name to start afresh")


def test_only_the_changeable_options_may_differ_with_allow_changes(tmp_path):
    path = save(tmp_path, 2)
    longer = {**RECIPE, "epochs": 5}
    with pytest.raises(UsageError) as refused:
        find_checkpoint("auto", False, longer, CHANGEABLE, tmp_path)
    assert str(refused.value) == (f"checkpoint {path} is from a different configuration (--epochs 3 there, 5 here); "
                                  "resume with the same options, or pass another --run-name to start afresh, or add "
                                  "--allow-changes to carry on with new --epochs, --lr")
    assert find_checkpoint("auto", True, longer, CHANGEABLE, tmp_path) == (path, "--epochs 3 there, 5 here")


def test_resume_never_refuses_a_run_with_checkpoints(tmp_path):
    assert find_checkpoint("never", False, RECIPE, CHANGEABLE, tmp_path) == (None, "")
    save(tmp_path, 2)
    with pytest.raises(UsageError) as refused:
        find_checkpoint("never", False, RECIPE, CHANGEABLE, tmp_path)
    assert str(refused.value) == (f"{tmp_path / 'checkpoints'} holds checkpoints and --resume is never; pass another "
                                  "--run-name to start afresh, or --resume auto to continue")


def test_no_checkpoint_starts_afresh_and_says_so_when_logs_are_there(tmp_path, capsys):
    assert find_checkpoint("auto", False, RECIPE, CHANGEABLE, tmp_path) == (None, "")
    assert capsys.readouterr().err == ""
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 1, "step": 2}\n')
    assert find_checkpoint("auto", False, RECIPE, CHANGEABLE, tmp_path) == (None, "")
    assert capsys.readouterr().err == (f"warning: {tmp_path} holds an earlier attempt's logs but no checkpoint that "
                                       "loads: starting the run over from step 0, replacing its logged epochs\n")


def test_checkpoints_are_ordered_by_step_not_by_name(tmp_path):
    """By name, ckpt-99999999.pt comes after ckpt-100000000.pt: the step number decides."""
    save(tmp_path, 99_999_999)
    newest = save(tmp_path, 100_000_000)
    assert find_checkpoint("auto", False, RECIPE, CHANGEABLE, tmp_path) == (newest, "")
    save(tmp_path, 100_000_001, keep=2)
    assert names(tmp_path / "checkpoints") == ["ckpt-100000000.pt", "ckpt-100000001.pt"]


def test_a_users_copy_in_checkpoints_is_never_picked_rotated_counted_or_set_aside(tmp_path, capsys):
    checkpoints = tmp_path / "checkpoints"
    first = save(tmp_path, 2)
    for name in ("ckpt-best.pt", "ckpt-4.pt", "notes.txt"):  # ckpt-4.pt: a second name for step 4
        shutil.copy(first, checkpoints / name)
    newest = save(tmp_path, 4, keep=1)
    assert names(checkpoints) == ["ckpt-00000004.pt", "ckpt-4.pt", "ckpt-best.pt", "notes.txt"]
    assert find_checkpoint("auto", False, RECIPE, CHANGEABLE, tmp_path) == (newest, "")
    assert capsys.readouterr().err.splitlines() == [
        f"note: --resume auto ignores ckpt-4.pt, ckpt-best.pt, notes.txt in {checkpoints}, not named as the run's "
        "checkpoints are (ckpt-00000120.pt for step 120); to resume from one of them, pass --resume PATH"]
    assert set_aside_checkpoints(tmp_path, 0) == [newest]
    assert names(checkpoints) == ["ckpt-4.pt", "ckpt-best.pt", "notes.txt", "superseded"]
    assert find_checkpoint("never", False, RECIPE, CHANGEABLE, tmp_path) == (None, "")  # no checkpoint of the run's
    best = checkpoints / "ckpt-best.pt"
    assert find_checkpoint(str(best), False, RECIPE, CHANGEABLE, tmp_path) == (best, "")


def test_a_start_that_continues_the_job_takes_the_runs_newest_checkpoint_over_resume(tmp_path, capsys):
    """--resume FILE or never hold for the job's first start; a restart or a requeue goes on
    from the run's own newest checkpoint, once it has one."""
    start = save(tmp_path / "base", 2)
    assert find_checkpoint(str(start), False, RECIPE, CHANGEABLE, tmp_path, "attempt 2/4, requeued 0x") == (start, "")
    newest = save(tmp_path, 4)
    for resume in (str(start), "never"):
        assert find_checkpoint(resume, False, RECIPE, CHANGEABLE, tmp_path, "attempt 1/4, requeued 1x") == (newest, "")
        assert capsys.readouterr().out == ("this start continues the job (attempt 1/4, requeued 1x): it resumes from the "
                                           f"run's newest checkpoint, not --resume {resume}\n")
    assert find_checkpoint(str(start), False, RECIPE, CHANGEABLE, tmp_path) == (start, "")  # a first start


@pytest.mark.parametrize("case", BROKEN)
def test_a_checkpoint_with_any_field_wrong_is_skipped_by_auto_and_refused_by_path(tmp_path, capsys, case):
    change, reason = BROKEN[case]
    good = save(tmp_path, 2)
    newest = save(tmp_path, 4)
    torch.save(change(torch.load(newest, weights_only=True)), newest)
    assert find_checkpoint("auto", False, RECIPE, CHANGEABLE, tmp_path) == (good, "")
    assert capsys.readouterr().err.splitlines() == [f"warning: skipping checkpoint {newest}: {reason}"]
    with pytest.raises(UsageError) as refused:
        find_checkpoint(str(newest), False, RECIPE, CHANGEABLE, tmp_path)
    assert str(refused.value) == f"cannot resume from {newest}: {reason}"


def test_a_checkpoint_from_before_classes_shape_and_finished_were_saved_still_loads(tmp_path):
    path = save(tmp_path, 2)
    old = torch.load(path, weights_only=True)
    del old["classes"], old["progress"]["finished"]  # (and it has no shape)
    torch.save(old, path)
    model, optimizer = model_and_optimizer()
    assert find_checkpoint("auto", False, RECIPE, CHANGEABLE, tmp_path) == (path, "")
    progress, _ = resume_from(path, {"model": model, "optimizer": optimizer, "average": None}, ONE, global_batch=128, epochs=3,
                              max_steps=0, classes=("cat", "dog"), shape=(1, 28, 28))
    assert progress == Progress(epoch=1, step_in_epoch=2, step=2, finished=False)


# ----------------------------------------------------------------------------- resume_from

def test_a_checkpoint_shorter_than_rank_0_saw_is_waited_for_then_named_with_its_file_system(tmp_path, monkeypatch):
    """NFS on another node than rank 0's: the file's old length for a while. It resumes once
    the rest arrives; a file that never grows ends the start with HeldUp (exit 4), in one line."""
    monkeypatch.setattr(ddpkit.files, "REREAD_SECONDS", 1.0)
    path = save(tmp_path, 2)
    whole = path.read_bytes()
    state = {"model": model_and_optimizer()[0], "optimizer": None, "average": None}
    path.write_bytes(whole[: len(whole) // 2])
    threading.Timer(0.3, path.write_bytes, (whole,)).start()
    assert resume_from(path, state, ONE, global_batch=128, epochs=3, max_steps=0, size=len(whole))[0].step == 2
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(HeldUp, match=rf"^cannot read {re.escape(str(path))} \({len(whole) // 2} of its {len(whole)} bytes\) "
                                     r"after 1 s of retries: it is on \w+ at /\S*, .* nothing saved is lost$"):
        resume_from(path, state, ONE, global_batch=128, epochs=3, max_steps=0, size=len(whole))


def test_resume_from_loads_each_thing_by_name(tmp_path):
    model, optimizer = model_and_optimizer(lr=0.1, weight_decay=0.01, seed=0)
    take_a_step(model, optimizer)
    path = save(tmp_path, 6, state={"model": model, "optimizer": optimizer, "average": None},
                loss_sum=torch.tensor([1.5, 4.0], dtype=torch.float64))
    rng_after_save = torch.rand(3)  # what the saved RNG state draws next

    fresh, fresh_optimizer = model_and_optimizer(lr=0.5, weight_decay=0.2, seed=1)  # other weights, other settings
    progress, loss_sum = resume_from(path, {"model": fresh, "optimizer": fresh_optimizer, "average": None}, ONE, global_batch=128,
                                     epochs=3, max_steps=0)
    assert progress == Progress(epoch=1, step_in_epoch=6, step=6)
    assert torch.equal(loss_sum, torch.tensor([1.5, 4.0], dtype=torch.float64))
    torch.testing.assert_close(fresh.state_dict(), model.state_dict())
    torch.testing.assert_close(fresh_optimizer.state_dict()["state"], optimizer.state_dict()["state"])
    # load_optimizer: the optimizer's state and learning rate from the file (where the
    # schedule stood), its other hyperparameters from now.
    group = fresh_optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"]) == (0.1, 0.2)
    assert torch.equal(torch.rand(3), rng_after_save)  # this rank's RNG goes on where it was saved


def test_resume_from_refuses_a_model_whose_shapes_differ(tmp_path):
    path = save(tmp_path, 2)
    wider, optimizer = model_and_optimizer(out=4)
    with pytest.raises(UsageError) as refused:
        resume_from(path, {"model": wider, "optimizer": optimizer}, ONE, global_batch=128, epochs=3, max_steps=0)
    assert str(refused.value) == (f"checkpoint {path} does not fit this model (weight has shape [2, 3] there, [4, 3] "
                                  "here): the model's code changed since it was saved. Pass another --run-name to train "
                                  "the changed model afresh, or undo the change to resume this run")


def test_resume_from_refuses_a_thing_the_checkpoint_does_not_hold(tmp_path):
    path = save(tmp_path, 2)  # its "average" is None
    model, _ = model_and_optimizer()
    with pytest.raises(UsageError) as refused:
        resume_from(path, {"model": model, "average": model_and_optimizer()[0]}, ONE, global_batch=128, epochs=3, max_steps=0)
    assert str(refused.value) == (f"checkpoint {path} holds no average: the recipe's code changed since it was saved. "
                                  "Pass another --run-name to train afresh, or undo the change to resume this run")


def test_resume_from_refuses_a_checkpoint_of_other_classes(tmp_path):
    """Another image folder (a class added, renamed or in another order) would silently
    relabel the data or fail as an unfitting model: one line says what differs instead."""
    path = save(tmp_path, 2, classes=("cat", "dog"))
    model, optimizer = model_and_optimizer()
    with pytest.raises(UsageError) as refused:
        resume_from(path, {"model": model, "optimizer": optimizer, "average": None}, ONE, global_batch=128, epochs=3, max_steps=0,
                    classes=("dog", "cat"))
    assert str(refused.value) == (f"checkpoint {path} was trained on other classes (cat, dog) than this data has (dog, "
                                  "cat): pass the data it was trained on, or another --run-name to start afresh")
    progress, _ = resume_from(path, {"model": model, "optimizer": optimizer, "average": None}, ONE, global_batch=128, epochs=3,
                              max_steps=0, classes=("cat", "dog"))
    assert progress.step == 2


@pytest.mark.parametrize("here, says", [
    ((3, 28, 28), "3x28x28 (an image folder is read in colour when any one of its images is in colour): pass the data it "
                  "was trained on (every image grayscale)"),
    ((1, 32, 32), "1x32x32: pass the data it was trained on (its images 28x28 pixels)"),
], ids=["3-channels", "32x32"])
def test_resume_from_refuses_images_of_another_shape_in_one_line(tmp_path, here, says):
    """Before the model's shapes are compared: it is the data that changed, not the code."""
    path = save(tmp_path, 2, shape=(1, 28, 28))
    model, optimizer = model_and_optimizer()
    state = {"model": model, "optimizer": optimizer, "average": None}
    with pytest.raises(UsageError) as refused:
        resume_from(path, state, ONE, global_batch=128, epochs=3, max_steps=0, shape=here)
    assert str(refused.value) == (f"checkpoint {path} was trained on images of 1x28x28 (channels x height x width) and "
                                  f"this data's are {says}, or another --run-name to start afresh")
    assert resume_from(path, state, ONE, global_batch=128, epochs=3, max_steps=0, shape=(1, 28, 28))[0].step == 2


def test_a_checkpoint_from_before_an_option_existed_is_compared_on_what_it_knew():
    """A run saved when --batch-size was 128 per rank and --global-batch did not exist:
    the refusal says to pass --batch-size 128, and with it the run goes on."""
    old = {"config": {"batch_size": 128, "lr": 0.003}}
    assert checkpoint_differences(old, {"global_batch": 128, "batch_size": 0, "lr": 0.003}) == {
        "batch_size": "--batch-size 128 there, 0 here"}
    assert checkpoint_differences(old, {"global_batch": 128, "batch_size": 128, "lr": 0.003}) == {}
