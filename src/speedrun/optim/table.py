"""The optimizer table: for every parameter, which rule updates it, with which label's
hyperparameters, and whether its update is sharded over the processes or replicated on each.

How a parameter gets its row (docs/recipes.md, "The optimizer table"):
- the model's role (``GPT.param_roles``) picks the rule: 'matrix' → NorMuon, anything else → Adam;
- the name picks the Adam label: ``wte.``/``wpe.`` → embed, ``value_embeds.`` → value_embed,
  ``lm_head.`` → head, the rest → scalar (each label has its own LR, betas and decay);
- the size picks the communication: NorMuon matrices are always sharded (stacked by shape into banks,
  whole matrices per rank); an Adam tensor is sharded along its rows when it is an embedding or head
  whose row count the world size divides, else replicated (all-reduced, updated on every rank).
The rule never depends on the world size except through that divisibility, and a sharded and a
replicated update do the same arithmetic, so the table changes how bytes travel, not the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from speedrun.optim.cautious_adam import AdamLabel
from speedrun.optim.muon import muon_split

RULES = ("normuon", "adam")
LABELS = ("matrix", "embed", "value_embed", "head", "scalar")
SHARDED_LABELS = ("embed", "value_embed", "head")


@dataclass
class Row:
    """One parameter's row of the table."""

    name: str
    param: Tensor
    rule: str  # "normuon" | "adam"
    label: str  # one of LABELS
    sharded: bool  # reduce-scatter + owner update + all-gather, else all-reduce + update everywhere


@dataclass
class Bank:
    """Same-shape matrices (rows, cols) updated by NorMuon together, padded to a multiple of the world
    size and split along the bank dimension: rank r owns matrices [r·per_rank, (r+1)·per_rank)."""

    shape: tuple[int, int]
    dtype: torch.dtype
    members: list[tuple[Row, int]] = field(default_factory=list)  # (row, block index in the param)
    world: int = 1

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def per_rank(self) -> int:
        return math.ceil(self.size / self.world)

    @property
    def padded(self) -> int:
        return self.per_rank * self.world

    def owned(self, rank: int) -> range:
        """Indices of the real (not padding) matrices rank ``rank`` updates."""
        start = rank * self.per_rank
        return range(min(start, self.size), min(start + self.per_rank, self.size))

    @property
    def lr_multiplier(self) -> float:
        """Shape multiplier √max(1, rows/cols) of the matrix as stored (HEAD's shape_mult)."""
        rows, cols = self.shape
        return math.sqrt(max(1.0, rows / cols))


def blocks(t: Tensor, like: Tensor) -> Tensor:
    """``t`` (shaped like param ``like``) viewed as (count, rows, cols): the matrices NorMuon sees
    (a fused QKV declared with ``set_muon_split`` is three)."""
    if like.ndim == 2:
        parts = muon_split(like)
        return t.view(parts, like.shape[0] // parts, like.shape[1])
    return t.view(-1, *like.shape[-2:])


def label_of(role: str, name: str) -> str:
    if role == "matrix":
        return "matrix"
    if role == "head":
        return "head"
    if role == "embed":
        return "value_embed" if name.startswith("value_embeds.") else "embed"
    return "scalar"


def build_rows(roles: dict[str, list[tuple[str, Tensor]]], world: int) -> list[Row]:
    """The table for a model's parameter roles on ``world`` processes, in the model's role order."""
    rows = []
    for role, params in roles.items():
        for name, p in params:
            label = label_of(role, name)
            rule = "normuon" if label == "matrix" else "adam"
            sharded = rule == "normuon" or (
                label in SHARDED_LABELS and p.ndim == 2 and p.shape[0] % world == 0
            )
            rows.append(Row(name, p, rule, label, sharded))
    return rows


def build_banks(rows: list[Row], world: int) -> list[Bank]:
    """NorMuon rows stacked into banks by (rows, cols, dtype), largest matrices first."""
    banks: dict[tuple, Bank] = {}
    for row in rows:
        if row.rule != "normuon":
            continue
        view = blocks(row.param.detach(), row.param)
        key = (tuple(view.shape[1:]), row.param.dtype)
        bank = banks.setdefault(key, Bank(key[0], row.param.dtype, world=world))
        bank.members.extend((row, i) for i in range(view.shape[0]))
    return sorted(banks.values(), key=lambda b: -b.shape[0] * b.shape[1])


def adam_labels(o, lrs: dict[str, float]) -> dict[str, AdamLabel]:
    """Per-label Adam hyperparameters from an OptimConfig (``o``) and the labels' peak LRs."""
    wd = o.adam_weight_decay
    return {
        "embed": AdamLabel(lrs["embed"], tuple(o.embed_betas), wd * o.embed_wd_mul, o.eps),
        "head": AdamLabel(lrs["head"], tuple(o.embed_betas), wd * o.embed_wd_mul, o.eps),
        "value_embed": AdamLabel(
            lrs["value_embed"], tuple(o.value_embed_betas), wd * o.value_embed_wd_mul, o.eps
        ),
        "scalar": AdamLabel(lrs["scalar"], tuple(o.scalar_betas), 0.0, o.eps),
    }
