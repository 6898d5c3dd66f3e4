"""How the value embeddings enter attention's v: #47/#48's mix and #55/#70's gates (`[model.values]`).
Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from speedrun.errors import ConfigError


@dataclass(frozen=True)
class ValuesConfig:
    gate: int = 0  # #55: input dims of the value-embedding gate; 0 none
    ve_dims: int = 0  # #70: the gate reads x[:gate − n] and the embedding's first n dims (6)
    paired_ve_dims: bool = False  # #89's script: paired layers' gates read them too (#70: x[:12])
    mix: Literal["lambdas", "weights"] = "lambdas"  # #47/#48: weights

    FLAT: ClassVar[dict[str, str]] = {
        "gate": "ve_gate",
        "ve_dims": "ve_gate_ve_dims",
        "paired_ve_dims": "ve_gate_paired_ve_dims",
        "mix": "value_mix",
    }


def check(p: ValuesConfig, m: Any) -> None:
    if p.paired_ve_dims and not p.ve_dims:
        raise ConfigError("model.values.paired_ve_dims needs model.values.ve_dims")
    if p.gate > m.n_embd or (p.gate and max(m.value_embeds, default=-1) < 0):  # #55
        raise ConfigError(
            "model.values.gate (#55) must be 0..model.n_embd input dims and needs model.value_embeds"
        )
    if p.ve_dims and not 0 < p.ve_dims < p.gate:
        raise ConfigError(f"model.values.ve_dims (#70) must be 1..model.values.gate - 1, got {p.ve_dims}")
