"""Build the optimizers a recipe asks for from the model's parameter roles."""

from __future__ import annotations

import torch

from speedrun.config import Config
from speedrun.model.gpt import GPT
from speedrun.optim import Muon, set_muon_split


def build_optimizers(model: GPT, cfg: Config) -> list[torch.optim.Optimizer]:
    """AdamW alone (baseline), or Muon on block matrices + Adam on embeddings, head and scalars.

    Every param group remembers its peak LR as `initial_lr`; the loop scales it by the schedule.
    """
    o = cfg.optim
    roles = model.param_roles()
    fused = {"fused": True} if next(model.parameters()).is_cuda else {}
    if o.name == "adamw":
        params = [p for group in roles.values() for _, p in group]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizers: list[torch.optim.Optimizer] = [
            torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, **fused)
        ]
    else:
        adam_groups = [
            {"params": [p for _, p in roles[role]], "lr": lr}
            for role, lr in (("embed", o.embed_lr), ("head", o.head_lr), ("scalar", o.scalar_lr))
            if roles[role]
        ]
        if cfg.model.fused_qkv:
            for name, p in roles["matrix"]:
                if name.endswith("c_attn.weight"):
                    set_muon_split(p, 3)  # q, k and v are orthogonalized as three matrices
        muon = Muon(
            [p for _, p in roles["matrix"]],
            lr=o.muon_lr,
            momentum=o.muon_momentum_start if o.muon_momentum_warmup_steps else o.muon_momentum,
            nesterov=True,
            backend=o.muon_backend,
            ns_steps=o.muon_ns_steps,
            shape_scale=o.muon_shape_scale,
            weight_decay=o.muon_weight_decay,
        )
        adam = torch.optim.Adam(adam_groups, betas=o.betas, eps=o.eps, weight_decay=0.0, **fused)
        optimizers = [adam, muon]
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return optimizers
