"""--cuda-graphs: the recipe's training step (forward, backward, optimizer) replayed as one
CUDA graph, so that a step costs one graph launch instead of each of its kernels' own.

It follows PyTorch's whole-network capture ("CUDA Graphs" in its CUDA semantics notes):
a few eager steps on a side stream first, then one capture with static input tensors,
then a copy of each batch into them and a replay. Every call is a real training step:
the warm-up steps train, and the step that captures replays at once, so a run with the
option takes the same steps as one without. The learning rate lives in a tensor that
the captured optimizer reads, and is written before each replay; the optimizer's group
keeps the plain number, for logs and checkpoints. Only full batches are captured and
replayed: a shorter one (an epoch's last) runs eagerly, on the default stream. The
capture waits until the optimizer holds state for every weight, so that no state is
made inside the graph (a replay would zero it again).

Where it does not apply, the run stops at start-up with one line (check_cuda_graphs): on
a CPU, with --compile (whose mode="reduce-overhead" makes graphs of its own), and with
several ranks: capturing DDP's gradient all-reduce needs NCCL's graph support and warm-up
rules of its own (PyTorch's notes, "Usage with DistributedDataParallel"), which this
template does not follow yet."""

from collections.abc import Callable

import torch

from ddpkit.launch import UsageError

WARMUP_STEPS = 3  # eager steps before the capture: the optimizer's state and cuDNN's choices are made by then


def check_cuda_graphs(device: torch.device, world_size: int, compile: bool) -> None:
    """Refuse --cuda-graphs where it cannot work, in one line, before anything starts."""
    if device.type != "cuda":
        raise UsageError(f"--cuda-graphs replays the training step on a CUDA GPU, and this run is on {device.type}; "
                         "leave it out on CPUs")
    if compile:
        raise UsageError("--cuda-graphs and --compile do not go together (torch.compile makes CUDA graphs of its own "
                         "with mode='reduce-overhead'); pass one of them")
    if world_size > 1:
        raise UsageError(f"--cuda-graphs captures one GPU's training step, and this run has {world_size} ranks: it does "
                         "not capture DDP's gradient all-reduce; leave --cuda-graphs out, or train on one GPU")


class GraphedStep:
    """Call it as the training step it wraps: step(model, optimizer, lr, x, y, *rest) -> loss.
    The loss it returns is the graph's own tensor, overwritten by the next replay: read it
    (or copy it) before the next step, as the training run does."""

    def __init__(self, step: Callable[..., torch.Tensor], device: torch.device, batch_size: int):
        self.step, self.device, self.batch_size = step, device, batch_size
        self.side = torch.cuda.Stream(device)
        self.warm, self.graph = 0, None
        self.x = self.y = self.lr = self.loss = None

    def __call__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr: float, x: torch.Tensor,
                 y: torch.Tensor, *rest) -> torch.Tensor:
        if len(x) != self.batch_size:
            return self.step(model, optimizer, lr, x, y, *rest)  # a shorter batch: eagerly
        if self.graph is None and (self.warm < WARMUP_STEPS or not has_state(optimizer)):
            self.warm += 1
            self.side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.side):
                loss = self.step(model, optimizer, lr, x, y, *rest)
            torch.cuda.current_stream(self.device).wait_stream(self.side)
            return loss
        if self.graph is None:
            self.capture(model, optimizer, x, y, rest)
        else:
            self.x.copy_(x, non_blocking=True)
            self.y.copy_(y, non_blocking=True)
        self.lr.fill_(lr)
        self.graph.replay()
        for group in optimizer.param_groups:
            group["lr"] = lr  # (the number, for logs and checkpoints; the graph reads self.lr)
        return self.loss

    def capture(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                rest: tuple) -> None:
        """Record one step on the static tensors (nothing runs yet: the caller replays it)."""
        self.x, self.y = x.clone(), y.clone()
        self.lr = torch.zeros((), dtype=torch.float32, device=self.device)
        optimizer.zero_grad(set_to_none=True)  # backward then makes the gradients inside the graph's memory
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: a DataLoader's pin-memory thread (--data-feed stream) may allocate
        # pinned memory meanwhile, which a global capture would take as its own error.
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.loss = self.step(model, optimizer, self.lr, self.x, self.y, *rest)


def has_state(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer has made its state for every weight that trains."""
    return all(optimizer.state.get(p) for group in optimizer.param_groups for p in group["params"] if p.requires_grad)
