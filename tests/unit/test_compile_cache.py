"""ddpkit/run/compile_cache.py with real torch, no compile: the key of a run's compile cache
follows what the compiled graph depends on (the model, each rank's batch, the world size,
the image shape, --amp) and not what a resume may change (--epochs, --lr); a cache file
that is damaged is ignored with one warning on rank 0 alone (the start compiles as without
it), and one that is not there is no news. That a later start loads a saved one and trains
alike: tests/runs/test_training.py (--compile, two starts).

    python -m pytest tests/unit/test_compile_cache.py
"""

import dataclasses

import pytest
import torch

import mnist_ddp
from ddpkit.distributed import Runtime
from ddpkit.options import RunOptions, changeable
from ddpkit.run.compile_cache import CompileCache, cache_key, cache_path, load_compile_cache

CPU = torch.device("cpu")
RECIPE, COMPILED = mnist_ddp.Recipe(), RunOptions(compile=True)


def runtime(rank: int = 0, world_size: int = 1) -> Runtime:
    return Runtime(rank, rank, world_size, CPU, "gloo" if world_size > 1 else "none", rank == 0)


def key(recipe: mnist_ddp.Recipe = RECIPE, *, options: RunOptions = COMPILED, world_size=1, batch_size=128,
        shape=(1, 28, 28)) -> str:
    kept = {k: v for k, v in dataclasses.asdict(recipe).items() if k not in changeable(mnist_ddp.Recipe)}
    return cache_key(rt=runtime(0, world_size), batch_size=batch_size, shape=shape, classes=10, recipe=kept,
                     options=dataclasses.asdict(options))


def test_the_key_follows_what_the_graph_depends_on_and_not_what_a_resume_may_change():
    base = key()
    assert len(base) == 16 and base == key()
    assert key(mnist_ddp.Recipe(epochs=20, lr=1e-3, max_steps=7)) == base  # (--allow-changes: the same graph)
    assert key(options=RunOptions(compile=True, ckpt_every=3, log_every=7)) == base
    others = [key(mnist_ddp.Recipe(model="mlp")), key(options=RunOptions(compile=True, amp=True)),
              key(options=RunOptions(compile=True, channels_last=True)), key(world_size=2, batch_size=64), key(batch_size=64),
              key(shape=(3, 32, 32))]
    assert len({base, *others}) == len(others) + 1


@pytest.mark.slow
@pytest.mark.parametrize("damage", [b"", b"not the artifacts torch saved" * 40])
def test_a_damaged_cache_file_is_ignored_with_one_warning_on_rank_0(tmp_path, capsys, damage):
    """Torch checks its artifacts' checksum; its own message, a traceback, is kept out. (Slow:
    torch loads its modules of compiled code, 2-5 s.)"""
    path = cache_path(tmp_path, "0" * 16)
    path.write_bytes(damage)
    assert load_compile_cache(path, runtime(1, 2)) is False
    assert capsys.readouterr() == ("", "")  # (rank 1: silent)
    cache = CompileCache.start(path, runtime(0, 2))
    assert cache.to_save  # (the start compiles, and rank 0 saves it again)
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"warning: ignoring the compile cache {path}, which cannot be used (")
    assert err.endswith("); this start compiles without it and saves it again\n")


def test_no_cache_file_is_no_news(tmp_path, capsys):
    cache = CompileCache.start(cache_path(tmp_path, "0" * 16), runtime())
    assert cache.to_save and capsys.readouterr() == ("", "")
    assert not CompileCache.start(cache_path(tmp_path, "0" * 16), runtime(1, 2)).to_save  # (rank 0 alone saves)
