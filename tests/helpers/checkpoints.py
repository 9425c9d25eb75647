"""Checkpoints for the tests: a folder's names, and changes that break a real checkpoint's fields
(each with what the warning says of it)."""


import torch


def names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def broken_progress(**fields):
    return lambda ckpt: {**ckpt, "progress": {**ckpt["progress"], **fields}}


# Each a change to a real checkpoint, and what the warning says of it.
BROKEN = {
    "its-format-alone": (lambda ckpt: {"format": 1}, "it has no config, world_size, progress, rank_states"),
    "a-progress-field-added-later": (broken_progress(warmup_done=True),
                                     "its progress has field(s) this version does not know: warmup_done"),
    "no-step": (lambda ckpt: {**ckpt, "progress": {k: v for k, v in ckpt["progress"].items() if k != "step"}},
                "its progress has no step"),
    "a-step-in-text": (broken_progress(step="4"), "its progress.step is '4', not a whole number from 0 up"),
    "epoch-0": (broken_progress(epoch=0), "its progress.epoch is 0, not a whole number from 1 up"),
    "finished-as-a-number": (broken_progress(finished=1), "its progress.finished is 1, not a bool"),
    "a-record-list": (broken_progress(last_record=[]), "its progress.last_record is [], not a dict of metrics by name"),
    "config-list": (lambda ckpt: {**ckpt, "config": []}, "its config is not a dict of options"),
    "classes-text": (lambda ckpt: {**ckpt, "classes": "cat,dog"}, "its classes are not a list of names"),
    "shape-of-2": (lambda ckpt: {**ckpt, "shape": [28, 28]}, "its shape is not the images' [channels, height, width]"),
    "world-size-true": (lambda ckpt: {**ckpt, "world_size": True}, "its world_size is True, not a count of ranks"),
    "global-batch-0": (lambda ckpt: {**ckpt, "global_batch": 0}, "its global_batch is 0, not a count of images"),
    "one-rank-state-of-2": (lambda ckpt: {**ckpt, "world_size": 2},
                            "its rank_states are not a list of its 2 ranks' states"),
    "a-rank-state-without-loss-sum": (
        lambda ckpt: {**ckpt, "rank_states": [{k: v for k, v in ckpt["rank_states"][0].items() if k != "loss_sum"}]},
        "its rank_states[0] is not a rank's cpu_rng, cuda_rng, loss_sum"),
    "a-model-that-is-no-state-dict": (lambda ckpt: {**ckpt, "model": torch.zeros(3)},
                                      "its model is a Tensor, not a state_dict"),
}
