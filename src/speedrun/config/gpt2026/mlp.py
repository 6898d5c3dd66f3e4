"""The MLP's storage and forward (`[model.mlp]`). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from speedrun.errors import ConfigError


@dataclass(frozen=True)
class MlpConfig:
    fc_transposed: bool = False  # #27
    fp8: bool = False  # #84/#89: FP8 MLP forward in training (refresh_fp8 after each optimizer step)

    FLAT: ClassVar[dict[str, str]] = {"fc_transposed": "mlp_fc_transposed", "fp8": "mlp_fp8"}


def check(p: MlpConfig, m: Any) -> None:
    if p.fp8 and p.fc_transposed:
        raise ConfigError(
            "model.mlp.fp8 (#84/#89) keeps the up-projection (hidden, dim): drop model.mlp.fc_transposed"
        )
