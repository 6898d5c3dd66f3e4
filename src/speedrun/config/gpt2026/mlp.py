"""The MLP's storage and forward (`[model.mlp]`). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from speedrun.errors import ConfigError


@dataclass(frozen=True)
class MlpConfig:
    fc_transposed: bool = False  # #27
    fp8: bool = False  # #84/#89: FP8 MLP forward in training (refresh_fp8 after each optimizer step)
    hidden: int = 0  # the hidden width; 0 = model.mlp_ratio · model.n_embd (#92: 2816)
    # #92: these layers run a second MLP of the same shape beside their own, on the same normed input, its
    # output scaled by the same post lambda (the record's bank slot 11 on layer 8)
    parallel_layers: list[int] = field(default_factory=list)

    FLAT: ClassVar[dict[str, str | None]] = {
        "fc_transposed": "mlp_fc_transposed", "fp8": "mlp_fp8", "hidden": None, "parallel_layers": None,
    }  # fmt: skip


def hidden_width(m: Any) -> int:
    """The MLP's hidden width: model.mlp.hidden, else mlp_ratio · n_embd."""
    return m.mlp.hidden or m.mlp_ratio * m.n_embd


def check(p: MlpConfig, m: Any) -> None:
    if p.hidden < 0:
        raise ConfigError(f"model.mlp.hidden must be >= 0 (0: mlp_ratio · n_embd), got {p.hidden}")
    if not set(p.parallel_layers) <= set(m.mlp_layers) or len(set(p.parallel_layers)) < len(
        p.parallel_layers
    ):
        raise ConfigError(
            f"model.mlp.parallel_layers {list(p.parallel_layers)} (#92): distinct layers among "
            "model.mlp_layers"
        )
    if p.fp8 and p.fc_transposed:
        raise ConfigError(
            "model.mlp.fp8 (#84/#89) keeps the up-projection (hidden, dim): drop model.mlp.fc_transposed"
        )
