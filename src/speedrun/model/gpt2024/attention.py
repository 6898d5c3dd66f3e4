"""The attention of a block: projections (fused or separate QKV), value mixing (value residual, value
embeddings), QK-norm, rotary, the attention call and the output projection. How it is
called (the forward's mask, a KV cache) comes from its context (model/contexts.py)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from speedrun.config import ModelConfig
from speedrun.model.contexts import CAUSAL, Context
from speedrun.model.labels import label, label_linear
from speedrun.model.layers import CastedLinear, Rotary


def make_rotary(cfg: ModelConfig) -> Rotary | None:
    """The recipe's rotary tables, or None for learned positions. One per model, shared by its layers
    (per layer, the fp32 tables of a 65,536-token recipe would be 0.37 GB of copies)."""
    if cfg.positional != "rotary":
        return None
    head_dim = cfg.n_embd // cfg.n_head
    return Rotary(head_dim, cfg.max_seq_len, 10000.0, cfg.rope_half_truncated, cfg.rope_precision)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary | None = None):
        super().__init__()
        d, self.n_head = cfg.n_embd, cfg.n_head
        self.head_dim = d // cfg.n_head
        if cfg.fused_qkv:  # "qkv" names its (q, k, v) rows: the optimizer may orthogonalize them apart
            self.c_attn = label_linear(CastedLinear(d, 3 * d, bias=cfg.bias), "qkv", blocks=(d, d, d))
        else:
            self.c_q = label_linear(CastedLinear(d, d, bias=cfg.bias), "qkv", blocks=(d, 0, 0))
            self.c_k = label_linear(CastedLinear(d, d, bias=cfg.bias), "qkv", blocks=(0, d, 0))
            self.c_v = label_linear(CastedLinear(d, d, bias=cfg.bias), "qkv", blocks=(0, 0, d))
        self.c_proj = label_linear(CastedLinear(d, d, bias=cfg.bias), "attn_out")
        self.qk_norm = cfg.qk_norm
        self.rotary = rotary if rotary is not None else make_rotary(cfg)
        self.qk_norm_after_rotary = cfg.qk_norm_after_rotary
        self.sdpa_kernel = cfg.sdpa_kernel
        # The value residual mixes layer 0's v with itself, as the record does: a no-op in value, but
        # every λ then gets a gradient (DDP refuses parameters that never receive one).
        self.self_mix = cfg.value_residual
        self.out_scale = 1 / math.sqrt(2 * cfg.n_layer) if cfg.attn_residual_scale else 1.0
        self.scale = cfg.attn_scale if cfg.attn_scale > 0 else None
        self.paired = False  # the decode interface (model/kv_cache.py): paired heads are gpt2026's (#58)
        mixes = cfg.value_residual or cfg.value_embeds != "none"
        self.value_mix = cfg.value_mix if mixes else None
        if self.value_mix == "lerp":
            self.lamb = label(nn.Parameter(torch.tensor(0.5)), "scalar")
        elif self.value_mix == "lambdas":
            self.lambdas = label(nn.Parameter(torch.tensor([0.5, 0.5])), "scalar")

    def mix_values(self, v: torch.Tensor, other: torch.Tensor | None) -> torch.Tensor:
        """Value residual / value embeddings: lerp (1-λ)v + λ·other, or lambdas λ0·v + λ1·other (λ0·v alone
        where a layer has no value embedding, as Sub3Min)."""
        if self.value_mix is None:
            return v
        other = other.view_as(v) if other is not None else None
        if self.value_mix == "lerp":
            return v if other is None else (1 - self.lamb) * v + self.lamb * other
        v = self.lambdas[0] * v
        return v if other is None else v + self.lambdas[1] * other

    def forward(
        self, x: torch.Tensor, ctx: Context = CAUSAL, other_v: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, C) → (output (B, T, C), this layer's unmixed v (B, T, H, D) for the value residual),
        called as `ctx` says (the forward's mask or a KV cache: model/contexts.py)."""
        q, k, v, raw_v = self.project(x, other_v, ctx.start)
        k, v = ctx.keys_values(k, v)
        return self.output(ctx.attend(q, k, v, self.scale, self.sdpa_kernel), x), raw_v

    def output(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Attention result (B, H, T, D) of the normed input x (B, T, C) → the layer's output (B, T, C)."""
        B, _, T, _ = y.shape
        y = self.c_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))
        return y * self.out_scale if self.out_scale != 1.0 else y

    def project(
        self, x: torch.Tensor, other_v: torch.Tensor | None = None, start: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (B, H, T, D) of positions start.. of x (B, T, C): projected, v mixed, QK-normed and
        rotated; plus the unmixed v (B, T, H, D). Shared by the forward and cached decoding."""
        B, T, C = x.shape
        if hasattr(self, "c_attn"):
            q, k, v = self.c_attn(x).split(C, dim=-1)
        else:
            q, k, v = self.c_q(x), self.c_k(x), self.c_v(x)
        q, k, v = (t.view(B, T, self.n_head, self.head_dim) for t in (q, k, v))
        raw_v = v
        v = self.mix_values(v, raw_v if other_v is None and self.self_mix else other_v)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.qk_norm and not self.qk_norm_after_rotary:
            q, k = F.rms_norm(q, (self.head_dim,)), F.rms_norm(k, (self.head_dim,))
        if self.rotary is not None:
            q, k = self.rotary(q, start), self.rotary(k, start)
        if self.qk_norm and self.qk_norm_after_rotary:  # 2024-10-14
            q, k = F.rms_norm(q, (self.head_dim,)), F.rms_norm(k, (self.head_dim,))
        return q, k, v, raw_v
