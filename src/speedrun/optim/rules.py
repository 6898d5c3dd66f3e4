"""Which rule trains each parameter label, with which hyperparameters (DESIGN principle 14).

The one place where a recipe's optimizer fields become the optimizer's rows: a model part declares what
a parameter is (``model/labels.py``), ``label_rules`` says how the recipe trains that kind of parameter,
``adam_groups`` gives each Adam group its hyperparameters, and ``param_rules`` joins the two, refusing a
parameter without a label or a label without a row. The builders (train/optimizers.py), the memory
estimate (train/memory.py) and the table (optim/table.py) read these rows and never a parameter's name.

A rule's ``group`` is the param group it joins: ``matrix`` for the orthogonalized matrices, else the
Adam group whose LR, betas and decay it shares (several labels may share one: a bigram table trains
with the value embeddings' settings, #65). The groups' names are those of saved optimizer states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import Tensor, nn

from speedrun.errors import ConfigError
from speedrun.model.labels import Label, labelled
from speedrun.optim.cautious_adam import AdamLabel

#: Labels of the matrices every optimizer but AdamW orthogonalizes (the gates only without their own LR).
MATRIX_LABELS = ("qkv", "attn_out", "mlp_in", "mlp_out", "matrix", "gate", "smear_gate")
#: The Muon/AdamW optimizers' groups, in the order their state is saved (Adam's embed, head, scalar).
MUON_GROUPS = ("embed", "head", "matrix", "scalar")


class LabelError(ConfigError, ValueError):
    """A parameter without a label, or a label without a row: one line naming the parameter (exit 2)."""


@dataclass(frozen=True)
class LabelRule:
    """How every parameter with one label is trained."""

    rule: str  # "muon" | "normuon" (orthogonalized) | "adam"; under optim.name=adamw only the group counts
    group: str  # "matrix", or the Adam group (hyperparameters) it joins
    lr_mul: float = 1.0  # NorMuon: LR multiplier on top of the bank's shape multiplier
    gate_rows: bool = False  # NorMuon: one second-moment statistic per row (#48's attention gates)
    split: bool = True  # orthogonalize the label's declared blocks apart (false: the 2024-10-04 seed)
    qk_rows: int = 0  # NorMuon: a qkv's Q and K cut into blocks of this many rows (#80: a head pair)


class Entry(NamedTuple):
    """One parameter with its label and rule."""

    name: str
    param: Tensor
    label: Label
    rule: LabelRule


def label_rules(o: Any, head_dim: int) -> dict[str, LabelRule]:
    """Each label's rule under the recipe's optimizer ``o`` (an OptimConfig); ``head_dim`` sizes #80's
    per-head-pair Q/K blocks.

    Muon (and AdamW, which keeps Muon's group order): the matrices in Muon, embeddings and value
    embeddings at the embedding LR, the head at its own, everything else with the scalars. NorMuon
    (the 2025–26 table): the MLP and attention matrices with their LR multipliers; the gates in Adam
    at their own LR where the recipe gives one (#52 smear gate, #56 attention/value-embedding gates),
    else in NorMuon (#48: one statistic per head); the skip gate (#55) and the x0 lambdas (#52) in
    Adam groups of their own; the bigram table (#62) with the value embeddings' settings."""
    if o.name != "normuon":
        rules = dict.fromkeys(MATRIX_LABELS, LabelRule("muon", "matrix", split=o.muon_split_qkv))
        rules |= dict.fromkeys(("embed", "value_embed", "bigram", "embed2"), LabelRule("adam", "embed"))
        rules |= dict.fromkeys(("scalar", "x0", "skip_gate"), LabelRule("adam", "scalar"))
        return rules | {"head": LabelRule("adam", "head")}

    def normuon(lr_mul: float = 1.0, gate_rows: bool = False, qk_rows: int = 0) -> LabelRule:
        return LabelRule("normuon", "matrix", lr_mul, gate_rows, o.muon_split_qkv, qk_rows)

    rules = {name: LabelRule("adam", name) for name in ("embed", "head", "value_embed", "scalar", "x0")}
    return rules | {
        "bigram": LabelRule("adam", "value_embed"),
        "embed2": LabelRule("adam", "value_embed"),  # the medium record: lr x75, wd x5, as value embeddings
        "skip_gate": LabelRule("adam", "skip_gate"),
        "qkv": normuon(o.attn_lr_mul, qk_rows=o.muon_qk_block_heads * head_dim),
        "attn_out": normuon(o.attn_lr_mul),
        "mlp_in": normuon(o.mlp_fc_lr_mul),
        "mlp_out": normuon(o.mlp_proj_lr_mul),
        "matrix": normuon(),
        "gate": (
            LabelRule("adam", "gate")
            if o.gate_lr > 0
            else normuon(o.gate_lr_mul, gate_rows=o.normuon_gate_row_stats)
        ),
        "smear_gate": LabelRule("adam", "smear_gate") if o.smear_gate_lr > 0 else normuon(),
    }


def adam_groups(o: Any, used: set[str]) -> dict[str, AdamLabel]:
    """The NorMuon table's Adam groups with their hyperparameters: embed, head, value_embed and scalar
    always, x0 and the gates where ``used`` (the groups of the model's rows) names them. x0 at
    ``x0_betas``; the smear and skip gates without decay, the attention/value-embedding gates (#56) with
    it; the gates' betas the main Adam's or the scalars'."""
    wd = o.adam_weight_decay
    gate_betas = tuple(o.scalar_betas if o.gate_betas == "scalar" else o.embed_betas)
    own = {
        "x0": (o.x0_lr or o.scalar_lr, tuple(o.x0_betas), 0.0),
        "smear_gate": (o.smear_gate_lr, gate_betas, 0.0),
        "skip_gate": (o.skip_gate_lr, gate_betas, 0.0),
        "gate": (o.gate_lr, gate_betas, wd),
    }
    extra = {k: AdamLabel(lr, betas, decay, o.eps) for k, (lr, betas, decay) in own.items() if k in used}
    return extra | {
        "embed": AdamLabel(o.embed_lr, tuple(o.embed_betas), wd * o.embed_wd_mul, o.eps),
        "head": AdamLabel(o.head_lr, tuple(o.embed_betas), wd * o.embed_wd_mul, o.eps),
        "value_embed": AdamLabel(
            o.value_embed_lr or o.embed_lr, tuple(o.value_embed_betas), wd * o.value_embed_wd_mul, o.eps
        ),
        "scalar": AdamLabel(o.scalar_lr, tuple(o.scalar_betas), 0.0, o.eps),
    }


def muon_adam_lrs(o: Any) -> dict[str, float]:
    """The Muon optimizer's Adam groups (shared betas, no decay) and their peak LRs, in saved order."""
    return {"embed": o.embed_lr, "head": o.head_lr, "scalar": o.scalar_lr}


def param_rules(model: nn.Module, rules: dict[str, LabelRule]) -> list[Entry]:
    """Every distinct parameter of ``model`` once, in its order, with its label and rule. Raises
    LabelError naming the first parameter without a label, or whose label has no row in ``rules``."""
    out = []
    for name, p, lab in labelled(model):
        if lab is None:
            raise LabelError(
                f"parameter {name} {tuple(p.shape)} has no optimizer label: its model part must declare one "
                "where it creates it (speedrun.model.labels.label)"
            )
        if lab.name not in rules:
            raise LabelError(f"parameter {name} has label {lab.name!r}, which no optimizer row trains")
        out.append(Entry(name, p, lab, rules[lab.name]))
    return out


def muon_parts(entry: Entry) -> int:
    """How many matrices Muon sees in a 2-D weight: its declared blocks (a fused QKV's q, k and v) apart,
    unless its rule keeps it whole."""
    return sum(1 for b in entry.label.blocks if b) if entry.rule.split and entry.label.blocks else 1


def block_rows(entry: Entry) -> tuple[int, ...]:
    """The rows of each matrix NorMuon orthogonalizes apart, down the rows of the parameter flattened
    to 2-D: per member of a stack (one for a 2-D weight), its declared blocks (empty ones dropped), or
    the whole matrix; with ``qk_rows`` a qkv's Q and K cut into blocks of that many rows, V whole."""
    p, lab, rule = entry.param, entry.label, entry.rule
    members = p.numel() // (p.shape[-2] * p.shape[-1])
    if not (lab.blocks and rule.split):
        return (p.shape[-2],) * members
    blocks = tuple(b for b in lab.blocks if b)
    if rule.qk_rows:
        q, k, v = lab.blocks
        assert q % rule.qk_rows == 0 and k % rule.qk_rows == 0, "config_checks: heads divide into groups"
        blocks = (rule.qk_rows,) * ((q + k) // rule.qk_rows) + ((v,) if v else ())
    return blocks * members
