"""The attention of a gpt2026 layer: fused QKV (λ-scaled weights with #47/#48), value embeddings mixed
into v (#45's layouts, #55's gate), QK-norm, half-truncated rotary (YaRN-updated, #31), paired heads (#58),
key offset on long layers (#49), the attention call and the output projection with #28's gate.
`project`, `attended_keys` and `output` are the decode interface (model/kv_cache.py, varlen windows)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from speedrun.model import paired_heads
from speedrun.model.attention import AttentionMask, attend
from speedrun.model.gpt2026.gates import attention_gate
from speedrun.model.gpt2026.specs import LayerSpec
from speedrun.model.key_offset import offset_keys
from speedrun.model.labels import label
from speedrun.model.layers import CastedLinear, Rotary


class Attention(nn.Module):
    def __init__(
        self,
        spec: LayerSpec,
        dim: int,
        n_head: int,
        rotary: Rotary,
        scale: float,
        gate: int,
        weights_mix: bool,
    ):
        super().__init__()
        self.n_head, self.head_dim = n_head, dim // n_head
        self.c_attn = CastedLinear(dim, 3 * dim, bias=False)
        label(self.c_attn.weight, "qkv", blocks=(dim, dim, dim))
        self.c_proj = CastedLinear(dim, dim, bias=False)
        label(self.c_proj.weight, "attn_out")
        self.rotary = rotary
        self.scale = scale  # YaRN (#31) rewrites it at each long-window growth
        self.gate = attention_gate(gate, n_head) if gate else None  # #28
        self.ve_gate = None  # #55: set by the model on the value-embedding layers (after every block)
        self.paired = spec.paired  # #58
        self.key_offset = spec.key_offset  # #49
        self.weights_mix = weights_mix  # #47/#48: λ0 scales the QKV weight, λ1 the output's
        self.lambdas = label(nn.Parameter(torch.tensor([0.5, 1.0] if weights_mix else [0.5, 0.5])), "scalar")

    def forward(
        self, x: torch.Tensor, mask: AttentionMask = None, other_v: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, C) → (output (B, T, C), this layer's unmixed v)."""
        q, k, v, raw_v = self.project(x, other_v)
        return self.output(attend(q, self.attended_keys(k), v, mask, self.scale), x), raw_v

    def attended_keys(self, k: torch.Tensor) -> torch.Tensor:
        """The keys (B, H, T, D) as attended: #49 shifts the stationary dims one token on its layers."""
        return offset_keys(k, seq_dim=2) if self.key_offset else k

    def project(
        self, x: torch.Tensor, other_v: torch.Tensor | None = None, start: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (B, H, T, D) of positions start.. (paired: (B, H/2, 2T, D)) and the unmixed v."""
        B, T, C = x.shape
        w = self.c_attn.weight
        w = (self.lambdas[0] * w).type_as(x) if self.weights_mix else w.to(x.dtype)
        q, k, v = (t.view(B, T, self.n_head, self.head_dim) for t in F.linear(x, w).split(C, dim=-1))
        raw_v = v
        if not self.weights_mix:
            v = self.lambdas[0] * v
        if other_v is not None:
            other_v = other_v.view_as(v)
            if self.ve_gate is not None:  # #55
                other_v = self.ve_gate.gate(other_v, x)
            v = v + other_v if self.weights_mix else v + self.lambdas[1] * other_v
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = F.rms_norm(q, (self.head_dim,)), F.rms_norm(k, (self.head_dim,))
        if self.paired:  # #58: the record's rotation, then the interleave
            q, k = paired_heads.rotate(self.rotary, q, start), paired_heads.rotate(self.rotary, k, start)
            return (*(paired_heads.interleave(t) for t in (q, k, v)), raw_v)
        return self.rotary(q, start), self.rotary(k, start), v, raw_v

    def output(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Attention result (B, H, T, D) of the normed input x (B, T, C) → the layer's output (B, T, C)."""
        y = paired_heads.deinterleave(y) if self.paired else y
        B, _, T, _ = y.shape
        if self.gate is not None:
            y = self.gate(y, x)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)
        if self.weights_mix:  # #48
            return F.linear(y, (self.lambdas[1] * self.c_proj.weight).type_as(y))
        return self.c_proj(y)
