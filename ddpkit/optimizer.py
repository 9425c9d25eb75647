"""FusedAdamW: torch.optim.AdamW(fused=True) without what torch.optim adds around its kernel.

Both run the same fused kernel (torch._fused_adamw_), so the weights come out bit for bit
the same. But torch.optim's constructor and every step import torch._dynamo (1.6 s on 2
CPU cores, more from a cold file system; torch 2.14) and sort the tensors by device and
dtype again at each step. This one does neither: one call of the kernel per step (a
one-process run then never loads torch._dynamo; DDP's constructor imports it anyway). Its
state and parameter groups are torch.optim.AdamW's own layout, so a state_dict of either
loads into the other, and anything that checks for a torch.optim.Optimizer accepts it.
Another optimizer works too: the recipe's training step and checkpoints take any
torch.optim.Optimizer, at the price of that import."""

from collections.abc import Iterable

import torch

# torch.optim.AdamW's parameter group, as its state_dict stores it.
ADAMW_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2, "amsgrad": False,
                  "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": True,
                  "decoupled_weight_decay": True}


class FusedAdamW(torch.optim.Optimizer):
    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2):
        if not (lr >= 0 and eps >= 0 and weight_decay >= 0 and all(0 <= beta < 1 for beta in betas)):
            raise ValueError(f"invalid AdamW settings: lr {lr}, betas {betas}, eps {eps}, weight decay {weight_decay}")
        super().__init__(params, {**ADAMW_DEFAULTS, "lr": lr, "betas": tuple(betas), "eps": eps,
                                  "weight_decay": weight_decay})

    # torch.optim.Optimizer's own versions of these four import torch._dynamo on first use.

    def add_param_group(self, param_group: dict) -> None:
        params = param_group["params"]
        group = {**self.defaults, **param_group,
                 "params": [params] if isinstance(params, torch.Tensor) else list(params)}
        kinds = {(p.device, p.dtype) for p in group["params"]}
        if len(kinds) > 1 or any(device.type not in ("cpu", "cuda") or not dtype.is_floating_point for device, dtype in kinds):
            raise ValueError(f"FusedAdamW takes floating-point CPU or CUDA tensors of one device and dtype per parameter "
                             f"group, not {sorted(map(str, kinds))}")
        if group["amsgrad"] or group["capturable"]:
            raise ValueError("FusedAdamW does neither amsgrad nor capturable; use torch.optim.AdamW for those")
        self.param_groups.append(group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().requires_grad_(False).zero_()

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("FusedAdamW.step takes no closure")
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if not self.state[p]:
                    self.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                                     "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                     "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
            states = [self.state[p] for p in params]
            steps = [s["step"] for s in states]
            torch._foreach_add_(steps, 1)
            beta1, beta2 = group["betas"]
            torch._fused_adamw_(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                                [s["exp_avg_sq"] for s in states], [], steps, lr=group["lr"], beta1=beta1, beta2=beta2,
                                weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False,
                                maximize=group["maximize"])
        return None

    def state_dict(self) -> dict:
        index = {}
        groups = []
        for group in self.param_groups:
            ids = [index.setdefault(id(p), len(index)) for p in group["params"]]
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        state = {index[id(p)]: dict(s) for p, s in self.state.items() if s}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        saved_groups = state_dict["param_groups"]
        if [len(g["params"]) for g in saved_groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("loaded state dict has a different number of parameter groups or parameters")
        if any(g.get("amsgrad") or g.get("capturable") for g in saved_groups):
            raise ValueError("loaded state dict is of an AdamW with amsgrad or capturable, which FusedAdamW does not do")
        by_id = {}
        for mine, saved in zip(self.param_groups, saved_groups, strict=True):
            by_id.update(zip(saved["params"], mine["params"], strict=True))
            mine.update({k: v for k, v in saved.items() if k != "params"})
        self.state.clear()
        for key, saved in state_dict["state"].items():
            if int(key) not in by_id:
                raise ValueError(f"loaded state dict holds state for parameter {key}, which no parameter group lists")
            p = by_id[int(key)]
            self.state[p] = {"step": saved["step"].to(device=p.device, dtype=torch.float32),
                             **{k: v.to(device=p.device, dtype=p.dtype) for k, v in saved.items() if k != "step"}}
