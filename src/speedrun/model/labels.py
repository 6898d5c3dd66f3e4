"""Optimizer labels, declared by the model part that creates a parameter (docs/design.md principle 14).

A part calls ``label(param, "qkv", blocks=(d, d, d))``; the optimizer table, memory estimate, FLOPs
count and checkpoint sharding read ``label_of(param)``, never the name. ``optim/rules.py`` maps labels to
rules with the recipe's ``[optim.labels]`` table; a parameter without a label or a label without a row is
refused. The label is an attribute of the Parameter object: it survives ``.to()``, compile and
state-dict loading, not ``copy.deepcopy`` or ``to_empty`` (build the model again instead)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from speedrun.config.labels import LABELS  # the vocabulary: what a part may declare (each has a row)

_ATTR = "_speedrun_label"


@dataclass(frozen=True)
class Label:
    """What a parameter is: `name` (one of ``LABELS``, a row of optim/rules.py's table); `blocks`, the rows
    (dim -2) of each block an orthogonalizing rule may treat as its own matrix (``"qkv"`` always names
    (q, k, v): fused ``(d, d, d)``, a separate K ``(0, d, 0)``; ``()`` the whole); `lr_mul`, the part's own
    LR multiplier on the recipe's base LR."""

    name: str
    blocks: tuple[int, ...] = ()
    lr_mul: float = 1.0


#: The weights the blocks multiply activations by (the head apart): the FLOPs count's matmuls.
MATMULS = frozenset(
    ("qkv", "attn_out", "mlp_in", "mlp_out", "matrix", "gate", "smear_gate", "skip_gate", "mudd", "mudd_gate")
)


def label(p: nn.Parameter, name: str, *, blocks: tuple[int, ...] = (), lr_mul: float = 1.0) -> nn.Parameter:
    """Attach ``Label(name, blocks, lr_mul)`` to ``p`` and return it (use where ``p`` is created)."""
    assert isinstance(p, nn.Parameter), f"label() takes an nn.Parameter, got {type(p).__name__}"
    assert name in LABELS, f"label {name!r} is not one of {LABELS}"
    assert not blocks or (p.ndim >= 2 and sum(blocks) == p.shape[-2]), f"blocks {blocks} for shape {p.shape}"
    setattr(p, _ATTR, Label(name, tuple(blocks), float(lr_mul)))
    return p


def label_linear(linear: nn.Linear, name: str, *, blocks: tuple[int, ...] = ()) -> nn.Linear:
    """Label a linear layer's weight ``name`` and its bias, if any, ``bias`` (``attn_out_bias`` for an
    attention output's: track 3 #46 trains it with its own beta2); return the layer."""
    label(linear.weight, name, blocks=blocks)
    if linear.bias is not None:
        label(linear.bias, "attn_out_bias" if name == "attn_out" else "bias")
    return linear


def label_of(p: nn.Parameter) -> Label | None:
    """The label a part gave ``p``, or None when it gave none."""
    return getattr(p, _ATTR, None)


def labelled(model: nn.Module) -> Iterator[tuple[str, nn.Parameter, Label | None]]:
    """Each distinct parameter of ``model`` once (a tied weight under its first name), with its label."""
    for name, p in model.named_parameters():  # named_parameters already skips repeats of a tied tensor
        yield name, p, label_of(p)
