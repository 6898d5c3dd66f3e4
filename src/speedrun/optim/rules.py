"""Which rule trains each parameter label, with which hyperparameters (docs/design.md principle 14).

Where the recipe's label table meets the model: a model part declares what a parameter is
(``model/labels.py``), config/labels.py's ``label_table`` says how the recipe trains that kind of
parameter (its ``[optim.labels]`` rows over the rows derived from the flat ``[optim]`` fields),
``adam_groups`` gives each Adam group its hyperparameters, and ``param_rules`` joins the two, refusing a
parameter without a label or a label without a row, and a stated row no parameter uses. The builders
(optim/build.py), the memory estimate (train/plan/memory.py) and the table (optim/table.py) read these
rows and never a parameter's name.

A rule's ``group`` is the param group it joins: ``matrix`` for the orthogonalized matrices, else the
Adam group whose LR, betas and decay it shares (several labels may share one: a bigram table trains
with the value embeddings' settings, #65). The groups' names are those of saved optimizer states.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from torch import Tensor, nn

from speedrun.config.labels import LabelRow
from speedrun.errors import ConfigError
from speedrun.model.labels import Label, labelled
from speedrun.optim.cautious_adam import AdamLabel

#: The Muon/AdamW optimizers' groups, in the order their state is saved (Adam's embed, head, scalar).
MUON_GROUPS = ("embed", "head", "matrix", "scalar")
#: The NorMuon table's Adam groups that exist whether or not a parameter joins them (saved step counts),
#: after the others in this order
ALWAYS_ADAM = ("embed", "head", "value_embed", "scalar")
FIRST_ADAM = ("x0", "smear_gate", "skip_gate", "gate")
LabelRule = LabelRow  # the row a label's parameters are trained by (config/labels.py)


class LabelError(ConfigError, ValueError):
    """A parameter without a label, or a label without a row: one line naming the parameter (exit 2)."""


class Entry(NamedTuple):
    """One parameter with its label and rule."""

    name: str
    param: Tensor
    label: Label
    rule: LabelRule


def adam_groups(rules: dict[str, LabelRule], used: set[str]) -> dict[str, AdamLabel]:
    """The Adam groups of a table with their hyperparameters, in saved order: the groups in ``used``
    (those the model's rows join) that ``ALWAYS_ADAM`` leaves out, then ``ALWAYS_ADAM``. The labels of
    one group share one row's hyperparameters (label_table sees to it)."""
    hyper = {
        r.group: AdamLabel(r.lr, tuple(r.betas), r.wd, r.eps) for r in rules.values() if r.rule == "adam"
    }
    extra = sorted((g for g in used if g in hyper and g not in ALWAYS_ADAM), key=_adam_order)
    return {g: hyper[g] for g in (*extra, *ALWAYS_ADAM) if g in hyper}


def _adam_order(group: str) -> tuple[int, str]:
    return (FIRST_ADAM.index(group), "") if group in FIRST_ADAM else (len(FIRST_ADAM), group)


def param_rules(model: nn.Module, rules: dict[str, LabelRule], stated: Iterable[str] = ()) -> list[Entry]:
    """Every distinct parameter of ``model`` once, in its order, with its label and rule. Raises
    LabelError naming the first parameter without a label, whose label has no row in ``rules``, or that
    its row cannot train (a matrix rule on a vector, Q/K blocks that do not divide it), and a ``stated``
    row (``[optim.labels]``) for a label no parameter carries."""
    out = []
    for name, p, lab in labelled(model):
        if lab is None:
            raise LabelError(
                f"parameter {name} {tuple(p.shape)} has no optimizer label: its model part must declare one "
                "where it creates it (speedrun.model.labels.label)"
            )
        if lab.name not in rules:
            raise LabelError(f"parameter {name} has label {lab.name!r}, which no optimizer row trains")
        rule = rules[lab.name]
        if rule.rule != "adam" and p.ndim < 2:
            raise LabelError(
                f"parameter {name} {tuple(p.shape)} has label {lab.name!r}, whose rule {rule.rule} trains "
                "matrices only (optim.labels)"
            )
        if rule.qk_rows and any(b % rule.qk_rows for b in lab.blocks[:2]):
            raise LabelError(
                f"optim.labels.{lab.name}.qk_rows: {rule.qk_rows} does not divide the Q and K rows "
                f"{lab.blocks[:2]} of parameter {name}"
            )
        out.append(Entry(name, p, lab, rule))
    carried = {e.label.name for e in out}
    for label in stated:
        if label not in carried:
            raise LabelError(
                f"optim.labels.{label}: no parameter of this model has label {label!r} "
                f"(take the row back with optim.labels.{label}={{}})"
            )
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
        assert q % rule.qk_rows == 0 and k % rule.qk_rows == 0, "param_rules: heads divide into groups"
        blocks = (rule.qk_rows,) * ((q + k) // rule.qk_rows) + ((v,) if v else ())
    return blocks * members
