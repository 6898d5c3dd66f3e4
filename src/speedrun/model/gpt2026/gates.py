"""The gates of the gpt2026 family, each a small matrix from zero that scales what a part adds:
#28's per-head attention-output gate, #55's value-embedding gate (per head) and skip gate (per position),
#34's smear gate (in embeddings.py). The classes live in model/attn_gate.py and model/gates.py until the
gpt2024 GPT stops using them; here they are built and labelled for this family."""

from __future__ import annotations

from speedrun.model.attn_gate import AttentionGate
from speedrun.model.gates import SkipGate, ValueEmbedGate
from speedrun.model.labels import label


def attention_gate(dims: int, n_head: int) -> AttentionGate:
    """#28: sigmoid(W·x[:dims]) per head on the attention output, W (heads, dims) from zero."""
    gate = AttentionGate(dims, n_head)
    label(gate.proj.weight, "gate")
    return gate


def value_embed_gate(dims: int, n_head: int) -> ValueEmbedGate:
    """#55: 2·sigmoid(W·x[:dims]) per head on the value embedding."""
    gate = ValueEmbedGate(dims, n_head)
    label(gate.proj.weight, "gate")
    return gate


def skip_gate(dims: int) -> SkipGate:
    """#55: 2·sigmoid(u·x0[:dims]) per position on the skip."""
    gate = SkipGate(dims)
    label(gate.proj.weight, "skip_gate")
    return gate
