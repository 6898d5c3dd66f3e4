"""The optimizer table: for every parameter, which rule updates it, with which label's
hyperparameters, and whether its update is sharded over the processes or replicated on each.

How a parameter gets its row (docs/recipes.md, "The optimizer table"):
- the model's role (``GPT.param_roles``) picks the rule: 'matrix' → NorMuon, anything else → Adam;
- the name picks the Adam label: ``wte.``/``wpe.`` → embed, ``value_embeds.`` → value_embed,
  ``lm_head.`` → head, ``.x0_lambda`` → x0 (#52: the x0 shortcut's weights stay in the main Adam),
  the rest → scalar (each label has its own LR, betas and decay); with ``smear_gate`` (#52) the smear
  gate leaves NorMuon for Adam's label smear_gate;
- the size picks the communication: NorMuon matrices are always sharded (stacked by shape into banks,
  whole matrices per rank); an Adam tensor is sharded along its rows when it is an embedding or head
  whose row count the world size divides, else replicated (all-reduced, updated on every rank);
- the layout picks a NorMuon row's blocks (``block_rows``, the matrices orthogonalized separately, cut
  down dim 0): a fused QKV is Q, K and V; with per-head-pair Q/K (#80) each group of heads of Q and of
  K is one block (2·head_dim rows), V stays whole;
- the name picks a NorMuon row's LR multiplier (``lr_mul``, on top of the bank's shape multiplier):
  the MLP output and input projections may get their own (HEAD's c_proj ×2, #42's c_fc ×2).
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
LABELS = ("matrix", "embed", "value_embed", "head", "scalar", "x0", "smear_gate", "skip_gate", "gate")
GATES = (
    ".attn.gate.proj.weight",
    ".attn.ve_gate.proj.weight",
)  # #28's attention and #55's value-embedding gates
SHARDED_LABELS = ("embed", "value_embed", "head")


@dataclass
class Row:
    """One parameter's row of the table."""

    name: str
    param: Tensor
    rule: str  # "normuon" | "adam"
    label: str  # one of LABELS
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


def label_of(role: str, name: str, smear_gate: bool = False, gates_in_adam: bool = False) -> str:
    if smear_gate and name.startswith("smear.gate"):
        return "smear_gate"
    if gates_in_adam and name.endswith(GATES):  # #56: Adam, not NorMuon
        return "gate"
    if name.startswith("skip_gate."):  # #55: Adam (main betas) at its own LR, no decay
        return "skip_gate"
    if role == "matrix":
        return "matrix"
    if role == "head":
        return "head"
    if role == "embed":
        # #62/#65: the bigram table has the value embeddings' Adam settings (betas, LR x75, decay x5)
        return "value_embed" if name.startswith(("value_embeds.", "bigram.embed.")) else "embed"
    return "x0" if name.endswith(".x0_lambda") else "scalar"


def qk_block_rows(name: str, p: Tensor, qk_rows: int) -> tuple[int, ...]:
    """Blocks of an attention weight with Q and K cut into blocks of ``qk_rows`` rows (#80: a head pair,
    2·head_dim) and V whole: a fused QKV (3d, d) gives (qk_rows, …, qk_rows, d); a separate Q or K
    (d, d) its blocks; anything else () (its layout)."""
    rows = p.shape[0]
    if qk_rows <= 0 or p.ndim != 2:
        return ()
    if name.endswith("attn.c_attn.weight") and muon_split(p) == 3:
        d = rows // 3
        return (qk_rows,) * (2 * d // qk_rows) + (d,)
    if name.endswith(("attn.c_q.weight", "attn.c_k.weight")):
        return (qk_rows,) * (rows // qk_rows)
    return ()


def build_rows(
    roles: dict[str, list[tuple[str, Tensor]]],
    world: int,
    qk_rows: int = 0,
    proj_lr_mul: float = 1.0,
    fc_lr_mul: float = 1.0,
    smear_gate: bool = False,
    attn_lr_mul: float = 1.0,
    gate_row_stats: bool = False,
    gates_in_adam: bool = False,
) -> list[Row]:
    """The table for a model's parameter roles on ``world`` processes, in the model's role order.

    ``qk_rows``: rows per Q/K block (0 = Q and K whole); ``proj_lr_mul`` and ``fc_lr_mul``: LR
    multipliers of the MLP output and input projections (``mlp.c_proj``, ``mlp.c_fc``); ``smear_gate``:
    Adam, not NorMuon, trains the smear gate (#52); ``attn_lr_mul``: LR multiplier of the attention's
    QKV and output matrices (#48 on: the record's (3072, 768) qkvo parameter gets shape LR x2);
    ``gate_row_stats``: the attention gates' NorMuon statistics per row (#48); ``gates_in_adam``: Adam's
    label gate trains the attention and value-embedding gates (#56)."""
    rows = []
    for role, params in roles.items():
        for name, p in params:
            label = label_of(role, name, smear_gate, gates_in_adam)
            rule = "normuon" if label == "matrix" else "adam"
            sharded = rule == "normuon" or (
                label in SHARDED_LABELS and p.ndim == 2 and p.shape[0] % world == 0
            )
            row = Row(name, p, rule, label, sharded)
            if rule == "normuon":
                row.block_rows = qk_block_rows(name, p, qk_rows) or row.block_rows
                muls = {"mlp.c_proj.weight": proj_lr_mul, "mlp.c_fc.weight": fc_lr_mul}
                muls |= {"attn.c_attn.weight": attn_lr_mul, "attn.c_proj.weight": attn_lr_mul}
                row.gate_rows = gate_row_stats and name.endswith(GATES)  # #48, #55
                row.lr_mul = next((m for end, m in muls.items() if name.endswith(end)), 1.0)
            rows.append(row)
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


def adam_labels(o, lrs: dict[str, float]) -> dict[str, AdamLabel]:
    """Per-label Adam hyperparameters from an OptimConfig (``o``) and the labels' peak LRs (x0 and the
    gates only where ``lrs`` names them): x0 at ``x0_betas``, the smear and skip gates without decay, the
    attention/value-embedding gates (#56) with it; the gates' betas the main Adam's or the scalars'."""
    wd = o.adam_weight_decay
    gate_betas = tuple(o.scalar_betas if o.gate_betas == "scalar" else o.embed_betas)
    own = {"x0": (tuple(o.x0_betas), 0.0), "smear_gate": (gate_betas, 0.0), "skip_gate": (gate_betas, 0.0)}
    own["gate"] = (gate_betas, wd)
    extra = {k: AdamLabel(lrs[k], betas, decay, o.eps) for k, (betas, decay) in own.items() if k in lrs}
    return extra | {
        "embed": AdamLabel(lrs["embed"], tuple(o.embed_betas), wd * o.embed_wd_mul, o.eps),
        "head": AdamLabel(lrs["head"], tuple(o.embed_betas), wd * o.embed_wd_mul, o.eps),
        "value_embed": AdamLabel(
            lrs["value_embed"], tuple(o.value_embed_betas), wd * o.value_embed_wd_mul, o.eps
        ),
        "scalar": AdamLabel(lrs["scalar"], tuple(o.scalar_betas), 0.0, o.eps),
    }
