"""The MLP of a gpt2026 layer: ReLU², no biases; #27 stores the up-projection transposed (dim, hidden)."""

from __future__ import annotations

from speedrun.model.labels import label
from speedrun.model.layers import MLP


def mlp(dim: int, hidden: int, fc_transposed: bool) -> MLP:
    m = MLP(dim, hidden, bias=False, relu2=True, fc_transposed=fc_transposed)
    label(m.c_fc.weight, "mlp_in")
    label(m.c_proj.weight, "mlp_out")
    return m
