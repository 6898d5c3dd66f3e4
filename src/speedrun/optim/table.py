"""The optimizer table: for every parameter, which rule updates it, with which label's
hyperparameters, and whether its update is sharded over the processes or replicated on each.

How a parameter gets its row (docs/recipes.md, "The optimizer table"):
- its label, declared by the model part that creates it, picks the rule, the group and the LR
  multiplier (config/labels.label_table, built from the recipe): NorMuon for the matrices, an Adam group
  (embed, head, value_embed, scalar, x0, gates: each its own LR, betas and decay) for the rest;
- the size picks the communication: NorMuon matrices are always sharded (stacked by shape into banks,
  whole matrices per rank); an Adam tensor is sharded along its rows when it is an embedding or head
  whose row count the world size divides, else replicated (all-reduced, updated on every rank);
- the label's blocks pick a NorMuon row's blocks (``block_rows``, the matrices orthogonalized
  separately, cut down dim 0): a fused QKV is Q, K and V; with per-head-pair Q/K (#80) each group of
  heads of Q and of K is one block (2·head_dim rows), V stays whole.
The rule never depends on the world size except through that divisibility, and a sharded and a
replicated update do the same arithmetic, so the table changes how bytes travel, not the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from speedrun.optim.muon import muon_split
from speedrun.optim.rules import Entry, block_rows

SHARDED_LABELS = ("embed", "value_embed", "head")


@dataclass
class Row:
    """One parameter's row of the table."""

    name: str
    param: Tensor
    rule: str  # "normuon" | "adam"
    label: str  # its group: "matrix" (NorMuon), else the Adam group it joins (optim/rules.py)
    sharded: bool  # reduce-scatter + owner update + all-gather, else all-reduce + update everywhere
    block_rows: tuple[int, ...] = ()  # NorMuon: rows of each block down dim 0 (() = from the layout)
    lr_mul: float = 1.0  # NorMuon: LR multiplier of every block of this row (HEAD's per_matrix_lr_mul)
    gate_rows: bool = False  # NorMuon: one statistic per row whatever the shape (#48's attention gates)

    def __post_init__(self) -> None:
        if self.rule == "normuon" and not self.block_rows:
            view = _layout_blocks(self.param.detach(), self.param)
            self.block_rows = (view.shape[1],) * view.shape[0]
        assert sum(self.block_rows) * self.param.shape[-1] == self.param.numel() or self.rule != "normuon"

    def blocks(self, t: Tensor) -> tuple[Tensor, ...]:
        """``t`` (shaped like this row's param) as the (rows, cols) matrices NorMuon updates: views."""
        return t.view(-1, t.shape[-1]).split(self.block_rows)


@dataclass
class Bank:
    """Same-shape matrices (rows, cols) updated by NorMuon together, padded to a multiple of the world
    size and split along the bank dimension: rank r owns matrices [r·per_rank, (r+1)·per_rank)."""

    shape: tuple[int, int]
    dtype: torch.dtype
    members: list[tuple[Row, int]] = field(default_factory=list)  # (row, block index in the param)
    world: int = 1
    # (storage key, the members' weight views): built once per storage
    _views: tuple = field(default=((), ()), init=False, repr=False)

    def weight_views(self) -> list[Tensor]:
        """Every member's (rows, cols) block as a view of its parameter, built again only when a
        parameter's storage changes (a step then dispatches no view ops for them)."""
        key = tuple(row.param.data_ptr() for row, _ in self.members)
        if self._views[0] != key:
            split: dict[str, tuple[Tensor, ...]] = {}
            for row, _ in self.members:
                split.setdefault(row.name, row.blocks(row.param.data))
            self._views = (key, [split[row.name][i] for row, i in self.members])
        return self._views[1]

    def grad_rows(self) -> list[Tensor]:
        """The members' gradients as 2-D row ranges, one per run of consecutive blocks of one
        parameter (a whole 2-D gradient as it is): concatenated, they are the stacked blocks."""
        runs: list[tuple[Row, int, int]] = []  # (row, first block, end block)
        for row, i in self.members:
            if runs and runs[-1][0] is row and runs[-1][2] == i:
                runs[-1] = (row, runs[-1][1], i + 1)
            else:
                runs.append((row, i, i + 1))
        out = []
        for row, first, end in runs:
            g = row.param.grad
            if first == 0 and end == len(row.block_rows) and g.ndim == 2:
                out.append(g)
                continue
            g = g if g.ndim == 2 else g.view(-1, g.shape[-1])
            out.append(g[sum(row.block_rows[:first]) : sum(row.block_rows[:end])])
        return out

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

    def stats_rule(self, square: str) -> str:
        """NorMuon's statistics rule (optim/normuon.variance_axis): #48's gates one per row (per head)."""
        return "all-rows" if all(row.gate_rows for row, _ in self.members) else square

    @property
    def lr_multiplier(self) -> float:
        """Shape multiplier √max(1, rows/cols) of the matrix as stored (HEAD's shape_mult)."""
        rows, cols = self.shape
        return math.sqrt(max(1.0, rows / cols))


def _layout_blocks(t: Tensor, like: Tensor) -> Tensor:
    """``t`` (shaped like param ``like``) viewed as (count, rows, cols): the matrices of its layout
    (a fused QKV declared with ``set_muon_split`` is three, a stack over leading dims is its members)."""
    if like.ndim == 2:
        parts = muon_split(like)
        return t.view(parts, like.shape[0] // parts, like.shape[1])
    return t.view(-1, *like.shape[-2:])


def build_rows(entries: list[Entry], world: int) -> list[Row]:
    """The table for a model's labelled parameters (optim/rules.param_rules) on ``world`` processes, in
    the model's parameter order."""
    rows = []
    for e in entries:
        name, p, lab, rule = e
        if rule.rule == "normuon":
            blocks, lr_mul = block_rows(e), rule.lr_mul * lab.lr_mul
            rows.append(Row(name, p, "normuon", rule.group, True, blocks, lr_mul, rule.gate_rows))
            continue
        assert rule.rule == "adam" and lab.lr_mul == 1.0, f"{name}: an Adam row takes its group's LR"
        sharded = rule.group in SHARDED_LABELS and p.ndim == 2 and p.shape[0] % world == 0
        rows.append(Row(name, p, "adam", rule.group, sharded))
    return rows


def build_banks(rows: list[Row], world: int) -> list[Bank]:
    """NorMuon rows stacked into banks by (rows, cols, dtype), largest matrices first."""
    banks: dict[tuple, Bank] = {}
    for row in rows:
        if row.rule != "normuon":
            continue
        for i, block in enumerate(row.blocks(row.param.detach())):
            key = (tuple(block.shape), row.param.dtype)
            bank = banks.setdefault(key, Bank(key[0], row.param.dtype, world=world))
            bank.members.append((row, i))
    return sorted(banks.values(), key=lambda b: -b.shape[0] * b.shape[1])
