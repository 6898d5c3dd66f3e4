"""Optimizer labels, declared by the model part that creates a parameter (DESIGN principle 14).

A part calls ``label(param, "qkv", blocks=(d, d, d))`` where it creates ``param``; the optimizer table,
the memory estimate, the FLOPs count and checkpoint sharding read ``label_of(param)`` and never the
parameter's name, so renaming an attribute cannot change how it is trained. The recipe maps each label
name to a rule and its hyperparameters (``[optim.labels]``); building the optimizer refuses a parameter
without a label and a label without a row. This module imports nothing from ``optim/`` or ``train/``.

The label is an attribute of the Parameter object: it survives ``.to()``, ``torch.compile`` and
state-dict loading, but not ``copy.deepcopy`` or ``to_empty`` of a meta model (they make new
Parameters); build the model again instead of copying it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

_ATTR = "_speedrun_label"


@dataclass(frozen=True)
class Label:
    """What a parameter is, as its creator knows it.

    name: the row of the recipe's label table (``matrix``, ``qkv``, ``embed``, ``value_embed``, ``head``,
    ``scalar``, ``gate``, ``bigram``, ...). blocks: rows of each block down dim 0 that an orthogonalizing
    rule treats as separate matrices (a fused QKV is ``(d, d, d)``); ``()`` means the whole matrix (or
    the leading dims of a stacked one). lr_mul: a per-parameter LR multiplier the part itself defines
    (e.g. a transposed MLP's x2); the recipe's row still sets the base LR.
    """

    name: str
    blocks: tuple[int, ...] = ()
    lr_mul: float = 1.0


def label(p: nn.Parameter, name: str, *, blocks: tuple[int, ...] = (), lr_mul: float = 1.0) -> nn.Parameter:
    """Attach ``Label(name, blocks, lr_mul)`` to ``p`` and return it (use where ``p`` is created)."""
    assert isinstance(p, nn.Parameter), f"label() takes an nn.Parameter, got {type(p).__name__}"
    assert not blocks or sum(blocks) == p.shape[0], f"blocks {blocks} do not cover {p.shape[0]} rows"
    setattr(p, _ATTR, Label(name, tuple(blocks), float(lr_mul)))
    return p


def label_of(p: nn.Parameter) -> Label | None:
    """The label a part gave ``p``, or None when it gave none."""
    return getattr(p, _ATTR, None)


def labelled(model: nn.Module) -> Iterator[tuple[str, nn.Parameter, Label | None]]:
    """Each distinct parameter of ``model`` once (a tied weight under its first name), with its label."""
    for name, p in model.named_parameters():  # named_parameters already skips repeats of a tied tensor
        yield name, p, label_of(p)
