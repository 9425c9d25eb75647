"""--cuda-graphs: the recipe's training step (forward, backward, optimizer) replayed as one
CUDA graph, so that a step costs one launch instead of hundreds of kernel launches.

It follows PyTorch's whole-network capture ("CUDA Graphs" in its CUDA semantics notes):
a few eager steps on a side stream first, then one capture with static input tensors,
then a copy of each batch into them and a replay. Every call is a real training step:
the warm-up steps train, and the step that captures replays at once, so a run with the
option takes the same steps as one without. The learning rate lives in a tensor that
the captured optimizer reads, and is written before each replay; the optimizer's group
keeps the plain number, for logs and checkpoints. A batch of another shape (an epoch's
last, shorter one) runs eagerly.

Where it does not apply, the run stops at start-up with one line (check_cuda_graphs): on
a CPU, with --compile (whose mode="reduce-overhead" makes graphs of its own), and with
several ranks, because DDP's gradient all-reduce inside a captured step failed on torch
2.11 with NCCL, the documented way (warm-up steps, TORCH_NCCL_ASYNC_ERROR_HANDLING=0)."""

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
        raise UsageError(f"--cuda-graphs captures one GPU's training step, and this run has {world_size} ranks: DDP's "
                         "gradient all-reduce cannot be captured with it; leave --cuda-graphs out, or train on one GPU")


class GraphedStep:
    """Call it as the training step it wraps: step(model, optimizer, lr, x, y, *rest) -> loss.
    The loss it returns is the graph's own tensor, overwritten by the next replay: read it
    (or copy it) before the next step, as the training run does."""

    def __init__(self, step: Callable[..., torch.Tensor], device: torch.device):
        self.step, self.device = step, device
        self.side = torch.cuda.Stream(device)
        self.warm, self.graph = 0, None
        self.x = self.y = self.lr = self.loss = None

    def __call__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, lr: float, x: torch.Tensor,
                 y: torch.Tensor, *rest) -> torch.Tensor:
        if self.graph is not None and (x.shape != self.x.shape or y.shape != self.y.shape):
            return self.step(model, optimizer, lr, x, y, *rest)  # a shorter batch: eagerly
        if self.warm < WARMUP_STEPS:
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
        with torch.cuda.graph(self.graph):
            self.loss = self.step(model, optimizer, self.lr, self.x, self.y, *rest)
