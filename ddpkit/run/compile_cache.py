"""--compile's cache in the run's directory: what torch compiled at a run's first start serves
every later start (a restart, a heal, a requeue, a resubmission, another node), which then
skips Inductor's lowering and code generation and, on a GPU, the Triton builds (torch
bundles the built kernels into the artifacts); on a CPU it still builds the kernels' C++.

Rank 0 saves torch.compiler.save_cache_artifacts() after its first compiled step (every rank
compiles the same graph, so its artifacts serve them all), atomically, as
RUN_DIR/compile-cache-<key>.bin; the evaluation runs the model uncompiled, so nothing compiles
there. At each later start every rank hands the file to torch.compiler.load_cache_artifacts
before its first step, which writes the artifacts into torch's own local caches
(TORCHINDUCTOR_CACHE_DIR, which run_training.sbatch puts on node-local scratch); the compile
then finds them there. The key is a hash of what the compiled graph depends on: torch's
version, the device, the world size and each rank's batch, the image shape and classes, the
recipe's options that a run keeps (the model among them) and the kit's options that change
the graph. A file of another key is simply not found; one that is damaged (torch checks its
checksum) or that torch refuses otherwise is ignored with one warning, and that start compiles as without it, then
saves it again."""

import dataclasses
import hashlib
import json
import logging
import sys
from pathlib import Path

import torch

from ddpkit.distributed import Runtime
from ddpkit.files import replace_with

# The kit's options that change the compiled graph: autocast's dtype, the input's memory
# layout, deterministic kernels.
GRAPH_OPTIONS = ("amp", "channels_last", "compile", "deterministic")
# torch's module of cache artifacts, which checks their checksum and logs a refused file with
# its traceback: the warning here is the one line.
TORCH_CACHE_LOG = "torch.compiler._cache"


def cache_key(*, rt: Runtime, batch_size: int, shape: tuple | None, classes: int, recipe: dict, options: dict) -> str:
    """The hash of what the compiled graph depends on (16 hex digits). `recipe`: the recipe's
    options that a run keeps (those --allow-changes may change, such as --epochs or --lr, stay
    out: the schedule sets the lr outside the graph); `options`: the kit's RunOptions."""
    device = rt.device
    kind = device.type
    if kind == "cuda":
        kind += "-sm{}{}-{}".format(*torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device))
    depends = {"torch": torch.__version__, "device": kind, "world_size": rt.world_size, "batch_size": batch_size,
               "shape": list(shape or ()), "classes": classes, "recipe": recipe,
               "options": {name: options.get(name) for name in GRAPH_OPTIONS}}
    return hashlib.sha256(json.dumps(depends, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cache_path(run_dir: Path, key: str) -> Path:
    return run_dir / f"compile-cache-{key}.bin"


def load_compile_cache(path: Path, rt: Runtime) -> bool:
    """Every rank, before its first compiled step: hand the file's artifacts to torch, which
    writes them into its local caches. True when they were loaded. A file that is absent is
    no news (a first start, or another key); one that is damaged or that torch refuses is
    ignored, with one warning (rank 0's), and the start compiles as without it."""
    log = logging.getLogger(TORCH_CACHE_LOG)
    level = log.level
    try:
        artifacts = path.read_bytes()
        log.setLevel(logging.ERROR)
        info = torch.compiler.load_cache_artifacts(artifacts)
        if info is None:
            raise ValueError("torch finds its artifacts damaged")
    except FileNotFoundError:
        return False
    except Exception as err:  # (whatever torch raises on artifacts it cannot use: compiling is the way on)
        if rt.is_main:
            print(f"warning: ignoring the compile cache {path}, which cannot be used ({' '.join(str(err).split())[:200]}); this start "
                  "compiles without it and saves it again", file=sys.stderr, flush=True)
        return False
    finally:
        log.setLevel(level)
    if rt.is_main:
        count = sum(len(keys) for keys in info.artifacts.values())
        print(f"compile: loaded the compile cache {path} ({count} artifacts)", flush=True)
    return True


def save_compile_cache(path: Path) -> None:
    """(rank 0, after its first compiled step) Write what torch compiled (and found in its
    local caches) so far to `path`, atomically. A failure to write warns and training goes on:
    the cache only saves time."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:  # (nothing was compiled)
        return
    artifacts, info = saved
    try:
        replace_with(path, lambda fh: fh.write(artifacts), binary=True, fsync=True)
    except OSError as err:
        print(f"warning: cannot save the compile cache {path} ({err.strerror or err}); training goes on, and later "
              "starts compile again", file=sys.stderr, flush=True)
        return
    count = sum(len(keys) for keys in info.artifacts.values())
    print(f"compile: saved the compile cache {path} ({count} artifacts), which later starts load", flush=True)


@dataclasses.dataclass
class CompileCache:
    """A start's compile cache: its file, and whether this start still has to save it (rank 0,
    once, after the first compiled step; not when it loaded the file)."""
    path: Path
    to_save: bool

    @classmethod
    def start(cls, path: Path, rt: Runtime) -> "CompileCache":
        """Every rank, before the first compiled step: load the file if it is there."""
        loaded = load_compile_cache(path, rt)
        return cls(path, to_save=rt.is_main and not loaded)

    def compiled(self) -> None:
        """After the start's first step: save the file, once."""
        if self.to_save:
            self.to_save = False
            save_compile_cache(self.path)
