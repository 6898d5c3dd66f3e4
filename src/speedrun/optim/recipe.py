"""What a recipe asks of Muon beyond lr and momentum: the record's momentum form, Newton–Schulz op
order and whether a fused QKV is orthogonalized as one matrix or three.

The optimizer builder calls `configure_muon(muon, model_matrices, cfg)` once after creating Muon;
Muon reads these options from its param groups at every step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from speedrun.config import Config
from speedrun.optim.muon import Muon, set_muon_split


def muon_group_options(cfg: Config) -> dict[str, Any]:
    """Param-group options of Muon set by the recipe (see OptimConfig.muon_*)."""
    o = cfg.optim
    return {
        "momentum_form": o.muon_momentum_form,
        "ns_form": o.muon_ns_form,
        "shape_scale": o.muon_shape_scale,
        "scale_in_update_dtype": o.muon_scale_in_bf16,
    }


def qkv_parts(name: str, cfg: Config) -> int:
    """How many matrices Muon sees in a block weight: 3 for a fused QKV unless the recipe keeps it whole
    (the 2024-10-04 seed orthogonalized the 2304 × 768 matrix as one), else 1."""
    if cfg.model.fused_qkv and name.endswith("c_attn.weight") and cfg.optim.muon_split_qkv:
        return 3
    return 1


def configure_muon(muon: Muon, matrices: Iterable[tuple[str, Tensor]], cfg: Config) -> None:
    """Apply the recipe's Muon options to every group and declare the QKV splits on the named matrices."""
    for name, p in matrices:
        set_muon_split(p, qkv_parts(name, cfg))
    options = muon_group_options(cfg)
    for group in muon.param_groups:
        group.update(options)
