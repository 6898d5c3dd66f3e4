"""One optimizer object per run, built from the model's parameter roles."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from speedrun.config import Config
from speedrun.model.gpt import GPT
from speedrun.optim import Muon, set_muon_split
from speedrun.optim.sharded import ShardedNorMuonAdam
from speedrun.optim.table import adam_labels, build_rows
from speedrun.train.precision import fast_bf16


class RunOptimizer:
    """The optimizers of a run behind one `step()`, `zero_grad()` and state dict.

    Every param group is tagged with its `kind` ("adam" or "muon": what the schedule may set in it) and
    its peak LR `initial_lr`. Parts step in insertion order (Adam first, then Muon, as the records do).
    The "table" part (optim/sharded.py, the 2025–26 optimizer) tags its own groups.
    """

    def __init__(self, parts: dict[str, torch.optim.Optimizer | ShardedNorMuonAdam]):
        self.parts = parts
        for kind, opt in parts.items():
            for group in opt.param_groups:
                group.setdefault("kind", kind)
                group["initial_lr"] = group["lr"]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for opt in self.parts.values() for group in opt.param_groups]

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        for group in self.param_groups:
            yield from group["params"]

    @torch.no_grad()
    def step(self) -> None:
        for opt in self.parts.values():
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.parts.values():
            opt.zero_grad(set_to_none=set_to_none)

    def describe(self) -> str:
        """A log line about the optimizer when it has one to say (the sharded table does)."""
        return "\n".join(opt.describe() for opt in self.parts.values() if hasattr(opt, "describe"))

    def state_dict(self) -> dict[str, Any]:
        return {kind: opt.state_dict() for kind, opt in self.parts.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or set(state) != set(self.parts):
            found = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"optimizer state holds {found}, this run has {sorted(self.parts)}")
        for kind, opt in self.parts.items():
            opt.load_state_dict(state[kind])


def qkv_parts(name: str, cfg: Config) -> int:
    """How many matrices Muon sees in a block weight: q, k and v of a fused QKV separately, unless the
    recipe keeps it whole (the 2024-10-04 seed orthogonalized the 2304 x 768 matrix as one)."""
    if cfg.model.fused_qkv and name.endswith("c_attn.weight") and cfg.optim.muon_split_qkv:
        return 3
    return 1


def build_optimizer(model: GPT, cfg: Config) -> RunOptimizer:
    """AdamW alone (baseline), or Muon on block matrices + Adam on embeddings, head and scalars."""
    o = cfg.optim
    roles = model.param_roles()
    fused = {"fused": True} if next(model.parameters()).is_cuda else {}
    if o.name == "adamw":
        params = [p for group in roles.values() for _, p in group]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return RunOptimizer({"adam": torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, **fused)})
    adam_groups = [
        {"params": [p for _, p in roles[role]], "lr": lr}
        for role, lr in (("embed", o.embed_lr), ("head", o.head_lr), ("scalar", o.scalar_lr))
        if roles[role]
    ]
    for name, p in roles["matrix"]:
        set_muon_split(p, qkv_parts(name, cfg))
    if o.name == "normuon":
        return RunOptimizer({"table": build_table_optimizer(model, cfg)})
    muon = Muon(
        [p for _, p in roles["matrix"]],
        lr=o.muon_lr,
        momentum=o.muon_momentum_start if o.muon_momentum_warmup_steps else o.muon_momentum,
        nesterov=True,
        backend=o.muon_backend,
        ns_steps=o.muon_ns_steps,
        shape_scale=o.muon_shape_scale,
        weight_decay=o.muon_weight_decay,
        momentum_form=o.muon_momentum_form,
        ns_form=o.muon_ns_form,
        scale_in_update_dtype=o.muon_scale_in_bf16,
        ns_dtype=muon_ns_dtype(o.muon_ns_dtype, roles["matrix"][0][1].device if roles["matrix"] else None),
    )
    adam = torch.optim.Adam(adam_groups, betas=o.betas, eps=o.eps, weight_decay=0.0, **fused)
    return RunOptimizer({"adam": adam, "muon": muon})


def sharded_optimizer(cfg: Config) -> bool:
    """Whether the run's optimizer communicates itself (no DDP around the model)."""
    return cfg.optim.name == "normuon"


def build_table_optimizer(model: GPT, cfg: Config) -> ShardedNorMuonAdam:
    """The 2025–26 optimizer from the model's parameter table (optim/table.py) and the recipe.

    With `optim.tie_until`, the embedding starts as a copy of the head (HEAD: embed = lm_headᵀ)."""
    o = cfg.optim
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    qk_rows = o.muon_qk_block_heads * (model.cfg.n_embd // model.cfg.n_head)
    smear_gate = o.smear_gate_lr > 0  # #52
    rows = build_rows(
        model.param_roles(), world, qk_rows, o.mlp_proj_lr_mul, o.mlp_fc_lr_mul, smear_gate, o.attn_lr_mul,
        o.normuon_gate_row_stats, o.gate_lr > 0,
    )  # fmt: skip
    lrs = {
        "embed": o.embed_lr,
        "head": o.head_lr,
        "scalar": o.scalar_lr,
        "value_embed": o.value_embed_lr or o.embed_lr,
    }
    if getattr(model.cfg, "x0_lambda_apart", False):  # gpt2026's #52: the x0 lambdas in the main Adam
        lrs["x0"] = o.scalar_lr
    if smear_gate:
        lrs["smear_gate"] = o.smear_gate_lr
    if getattr(model.cfg, "skip_gate", 0):  # gpt2026's #55
        lrs["skip_gate"] = o.skip_gate_lr
    if o.gate_lr > 0:  # #56
        lrs["gate"] = o.gate_lr
    tie = None
    if o.tie_until:
        embed, head = model.wte.weight, model.lm_head.weight
        assert embed.shape == head.shape, "config checks guarantee one shape"
        with torch.no_grad():
            embed.copy_(head)
        tie = (embed, head, o.tie_until)
    start = o.muon_momentum_start if o.muon_momentum_warmup_steps else o.muon_momentum
    return ShardedNorMuonAdam(
        rows,
        adam_labels(o, lrs),
        muon_lr=o.muon_lr,
        momentum=start,
        beta2=o.normuon_beta2,
        muon_weight_decay=o.muon_weight_decay,
        backend=o.muon_backend,
        ns_steps=o.muon_ns_steps,
        ns_dtype=muon_ns_dtype(o.muon_ns_dtype, model.lm_head.weight.device),
        ns_form=o.muon_ns_form,
        adam_every=o.adam_every,
        square_stats=o.normuon_square_stats,
        frozen_labels=("scalar",) if o.scalar_freeze_steps else (),
        tie=tie,
    )


def muon_ns_dtype(asked: str, device: torch.device | None) -> torch.dtype:
    """Precision of Muon's iterations: bf16 as the records, unless `auto` finds that the device runs
    bf16 matmuls slowly (a CPU without bf16 instructions: ~100x slower than fp32)."""
    if asked == "auto":
        asked = "bf16" if device is None or fast_bf16(device.type)[0] else "fp32"
    return torch.bfloat16 if asked == "bf16" else torch.float32
