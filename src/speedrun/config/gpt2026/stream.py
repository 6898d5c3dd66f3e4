"""The residual stream's connections: skip weights and gates, λ inits, x0 weights, the second embedding,
backout and the residual form (`[model.stream]`). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from speedrun.errors import ConfigError


@dataclass(frozen=True)
class StreamConfig:
    skip_gate_form: Literal["weight", "sigmoid"] = "weight"  # #32: sigmoid
    skip_gate: int = 0  # #55: input dims of the skip gate; 0 none
    resid_lambda_init: float = 1.0  # #45: 1.1
    x0_lambda_apart: bool = False  # #52
    # medium-2025-12 (#124's second embedding): a second token embedding, normed, added to every layer's
    # input with its own x0 weight (needs x0_lambda_apart: the two weights are one "x0" pair per layer)
    embed2: bool = False
    backout_layer: int = 0  # #40; 0 none
    # #77 (SimplifyHC): "sublayer" = x ← r_a·x + p_a·attn + x0·λ_x0 + bigram·λ_b, x ← r_m·x + p_m·mlp, the
    # first layer's bigram share added before it, λ_x0 its own weight (label x0); "x0-first" = x ← λ0·x +
    # λ1·x0 + bigram, then x += attn, mlp
    residual_form: Literal["x0-first", "sublayer"] = "x0-first"
    # #92's injection sites (with #85's gate network): the layers whose stream gets x0 and the bigram input
    # added, each through its own gate lane; empty: both on every attention layer but the last (#85). A
    # site without attention scales its stream by its attention's resid lambda first; a site with neither
    # attention nor MLP (#92's layer 7) is a resting layer: x ← r_m·(r_a·x + x0·g)
    x0_layers: list[int] = field(default_factory=list)
    bigram_layers: list[int] = field(default_factory=list)

    FLAT: ClassVar[dict[str, str | None]] = {"x0_layers": None, "bigram_layers": None}


def check(p: StreamConfig, m: Any) -> None:
    if p.x0_layers or p.bigram_layers:
        sites = p.x0_layers + p.bigram_layers
        if not m.mudd.gate_layer or any(not 0 <= i < m.n_layer - 1 for i in sites):
            raise ConfigError(
                "model.stream.x0_layers / bigram_layers (#92) need #85's gate network "
                f"(model.mudd.gate_layer) and layers 0..{m.n_layer - 2} (the last injects through MUDD)"
            )
        if any(len(set(lst)) < len(lst) for lst in (p.x0_layers, p.bigram_layers)):
            raise ConfigError("model.stream.x0_layers / bigram_layers: distinct layers")
    if p.residual_form == "sublayer" and p.x0_lambda_apart:
        raise ConfigError(
            "model.stream.residual_form = 'sublayer' has its own x0 lambdas: drop x0_lambda_apart"
        )
    if p.skip_gate > m.n_embd or (p.skip_gate and not m.skips):  # #55
        raise ConfigError(
            "model.stream.skip_gate (#55) must be 0..model.n_embd input dims and needs model.skips"
        )
    if p.embed2 and (not p.x0_lambda_apart or p.residual_form != "x0-first"):
        raise ConfigError(
            "model.stream.embed2 needs model.stream.x0_lambda_apart=true (its weight joins the x0 pair)"
        )
    if not 0 <= p.backout_layer < m.n_layer:
        raise ConfigError(
            f"model.stream.backout_layer ({p.backout_layer}) must be below model.n_layer ({m.n_layer})"
        )
