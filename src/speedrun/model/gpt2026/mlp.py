"""The MLP of a gpt2026 layer: ReLU², no biases; #27 stores the up-projection transposed (dim, hidden)."""

from __future__ import annotations

from speedrun.model.gpt2026.fp8_mlp import Fp8MLP
from speedrun.model.layers import MLP


def mlp(dim: int, hidden: int, fc_transposed: bool, fp8: bool = False) -> MLP:
    """fp8: #84/#89's FP8 training forward (fp8_mlp.py); the up-projection then stays (hidden, dim). MLP
    labels its weights ("mlp_in", "mlp_out")."""
    if fp8:
        return Fp8MLP(dim, hidden)
    return MLP(dim, hidden, bias=False, relu2=True, fc_transposed=fc_transposed)
