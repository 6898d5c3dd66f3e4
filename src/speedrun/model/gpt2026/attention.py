"""The attention of a gpt2026 layer: fused QKV (λ-scaled weights with #47/#48), value embeddings mixed
into v (#45's layouts, #55's gate), QK-norm, half-truncated rotary (YaRN-updated, #31), paired heads (#58),
key offset on long layers (#49), the attention call and the output projection with #28's gate. With #344's
`model.qk_head_dim` Q and K are narrower than V (96 vs 128): the fused weight has 2·H·96 + C rows, QK-norm,
rotary and the key offset act on the 96 dims, and V, the attention output and the projection keep 128.
The layer is written once, in `forward`; how it is called (the forward's mask, packed documents, a KV
cache) comes from its context (model/contexts.py)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from speedrun.config.gpt2026.attn import AttnConfig
from speedrun.model.attention import MaskSpec
from speedrun.model.contexts import CAUSAL, Context
from speedrun.model.gpt2026.dc import DC_WINDOW, dc_gate, dc_masked
from speedrun.model.gpt2026.fp8_qkv import Fp8QKV, PlainQKV
from speedrun.model.gpt2026.gates import AttentionGate
from speedrun.model.gpt2026.mudd import xsa_per_token
from speedrun.model.gpt2026.specs import LayerSpec
from speedrun.model.gpt2026.xsa import GatedXSA
from speedrun.model.labels import label
from speedrun.model.layers import CastedLinear, Rotary

# Partial key offset (record #49, 2025-12-14, PR #169): on the long-window layers, the key dimensions
# that rotary leaves stationary (the zero-frequency half of each rotary half: dims D/4 … D/2 and
# 3D/4 … D of a head of D) are taken from the previous token's key. A query can then match "the token
# after an X" in one layer — a cheap induction head. The record shifts after QK-norm and rotary, over
# the whole packed row (across document boundaries too); the first position keeps its own key.
#
# The shift is a function of the whole key sequence, so it is applied where the keys are attended
# (forward and cached decoding alike, model/kv_cache.py keeps the unshifted keys).


def offset_keys(k: torch.Tensor, seq_dim: int = -2) -> torch.Tensor:
    """k (…, T, …, D) with its stationary dims shifted one position forward along `seq_dim` (#49):
    out[t] = k[t − 1] on dims D/4:D/2 and 3D/4:D for t >= 1, k elsewhere. Out of place."""
    d = k.size(-1)
    shifted = torch.cat([k.narrow(seq_dim, 0, 1), k.narrow(seq_dim, 0, k.size(seq_dim) - 1)], dim=seq_dim)
    quarter = torch.arange(d, device=k.device) % (d // 2) >= d // 4  # the stationary dims
    return torch.where(quarter, shifted, k)


# Paired-head attention (record #58, 2026-01-07, PR #191; on layers 0, 2, 5, 9 through #65): heads
# share attention in pairs. The record's views of (T, H, D) tensors as (2T, H/2, D) interleave head h of
# token t at position 2t + h // (H/2), head slot h mod (H/2): the pairs are heads p and p + H/2 (adjacent
# heads only with 2 heads), attended causally as one sequence twice as long, with the documents' bounds
# doubled (`cu_seqlens` x2) and the same window, now counted in positions (half as many tokens). A query
# of a pair sees both heads' keys of earlier tokens (the second head also the first's key of its own
# token). Rotary comes first, on the record's (T, H/2, 2D) view with the YarnPairedHead tables: head h
# is rotated as position 2t + h mod 2, whatever its place in the interleaved sequence (the record's
# arithmetic, kept). The value embedding and its gate act per head before the interleave (the same
# elementwise products); the output is un-interleaved before the attention gate and output projection.


def interleave(t: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) → (B, H/2, 2T, D): [b, p, 2t + s] = t[b, s·H/2 + p, t] (the record's reshape)."""
    B, H, T, D = t.shape
    return t.view(B, 2, H // 2, T, D).permute(0, 2, 3, 1, 4).reshape(B, H // 2, 2 * T, D)


def deinterleave(y: torch.Tensor) -> torch.Tensor:
    """The inverse of `interleave`: (B, H/2, 2T, D) → (B, H, T, D)."""
    B, P, T2, D = y.shape
    return y.view(B, P, T2 // 2, 2, D).permute(0, 3, 1, 2, 4).reshape(B, 2 * P, T2 // 2, D)


def rotate_paired(rotary: Rotary, x: torch.Tensor, start: int) -> torch.Tensor:
    """x (B, H, T, D) at tokens start.. rotated as the record's paired tables do: head h as position
    2t + h mod 2 (its (T, H/2, 2D) view puts head 2p at angle 2t and head 2p + 1 at 2t + 1)."""
    B, H, T, D = x.shape
    adjacent = x.view(B, H // 2, 2, T, D).transpose(2, 3).reshape(B, H // 2, 2 * T, D)  # 2p, 2p+1 → 2t, 2t+1
    rotated = rotary(adjacent, 2 * start)
    return rotated.view(B, H // 2, T, 2, D).transpose(2, 3).reshape(B, H, T, D)


def paired_spec(spec: MaskSpec) -> MaskSpec:
    """A layer's mask over the interleaved sequence: each token's document twice, the same window."""
    docs = spec.doc_ids.repeat_interleave(2, dim=1) if spec.doc_ids is not None else None
    return replace(spec, doc_ids=docs)


# Mixed-width attention (record #92, 2026-09-28, PR #360): on its narrow layers a head's Q and K are the
# rotating half of the full-width head, fully rotating at the same frequencies, with their own rotary table,
# scale (0.13) and YaRN (by the short window); two of them also halve V and O (their leading dims per head).
# The weights stay full width, as the record's banks do: the unread rows get no gradient. The record's
# heads are interleaved pairs, whose leading half are its rotating pairs; ours are half-split, whose
# rotating pairs are dims 0 … D/4 and D/2 … 3D/4: the same numbers under the Q/K row permutation that maps
# the two layouts (tests/fidelity/test_banks_model.py).


def rotating_half(t: torch.Tensor) -> torch.Tensor:
    """(…, D) → (…, D/2): the dims a half-truncated rotary turns (0 … D/4 and D/2 … 3D/4), still
    half-split: pair (i, i + D/4) of the result is pair (i, i + D/2) of the head."""
    d = t.size(-1)
    return torch.cat((t[..., : d // 4], t[..., d // 2 : 3 * d // 4]), dim=-1)


def leading(t: torch.Tensor, heads: int, width: int) -> torch.Tensor:
    """(…, H·D) → (…, H·width): the leading `width` dims of each of the `heads` heads."""
    return t.unflatten(-1, (heads, -1))[..., :width].flatten(-2)


class Attention(nn.Module):
    def __init__(
        self,
        spec: LayerSpec,
        dim: int,
        n_head: int,
        rotary: Rotary,
        scale: float,
        part: AttnConfig,
        weights_mix: bool,
        ve_gate: nn.Module | None = None,
        xsa_label: str | None = "scalar",
    ):
        """`part`: the model's `[model.attn]` table (a technique inside the attention reads its own field
        there); `ve_gate`: #55's value-embedding gate of the layer; `xsa_label`: #82's α's label, None
        where #85's gate network gives α per token."""
        super().__init__()
        self.n_head, self.head_dim = n_head, dim // n_head
        self.qk_full = part.qk_head_dim or self.head_dim  # #344: Q/K width per head; V keeps head_dim
        self.narrow_qk, self.narrow_v = spec.narrow_qk, spec.narrow_v  # #92: read half of each head
        self.qk_dim = self.qk_full // 2 if spec.narrow_qk else self.qk_full
        self.v_dim = self.head_dim // 2 if spec.narrow_v else self.head_dim
        qk = n_head * self.qk_full
        self.c_attn = (Fp8QKV if part.fp8_qkv else PlainQKV)(dim, 2 * qk + dim)  # #344
        label(self.c_attn.weight, "qkv", blocks=(qk, qk, dim))
        self.c_proj = CastedLinear(dim, dim, bias=False)
        label(self.c_proj.weight, "attn_out")
        self.rotary = rotary
        self.scale = scale  # YaRN (#31) rewrites it at each long-window growth
        self.gate = AttentionGate(part.gate, n_head) if part.gate else None  # #28
        self.paired = spec.paired  # #58
        self.key_offset = spec.key_offset  # #49
        self.xsa = GatedXSA(n_head, xsa_label) if spec.xsa and xsa_label else None  # #82
        self.ve_gate = ve_gate  # #55 (registered after the rest, as the records build it)
        self.weights_mix = weights_mix  # #47/#48: λ0 scales the QKV weight, λ1 the output's
        self.lambdas = label(nn.Parameter(torch.tensor([0.5, 1.0] if weights_mix else [0.5, 0.5])), "scalar")

    def forward(
        self, x: torch.Tensor, ctx: Context = CAUSAL, other_v: torch.Tensor | None = None, dyn=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, C) → (output (B, T, C), this layer's unmixed v), called as `ctx` says (the forward's
        mask, packed documents, a KV cache: model/contexts.py); `dyn`: #85's per-token gates of the layer
        (XSA α, output gate, DC weights)."""
        q, k, v, raw_v = self.project(x, other_v, ctx.start)
        k, v = ctx.keys_values(k, v)
        k = self.attended_keys(k)
        y = ctx.attend(q, k, v, self.scale)
        if dyn and "dc1" in dyn:  # #85: the correction's rows of the queries, over the keys near them
            w1, w2 = dc_gate(dyn["dc1"], dyn["dc2"], x)
            y = dc_masked(y, q, k, v, w1, w2, self.scale, ctx.near(DC_WINDOW))
        return self.output(y, x, v[:, :, -q.size(2) :], dyn), raw_v

    def attended_keys(self, k: torch.Tensor) -> torch.Tensor:
        """The keys (B, H, T, D) as attended: #49 shifts the stationary dims one token on its layers."""
        return offset_keys(k, seq_dim=2) if self.key_offset else k

    def project(
        self, x: torch.Tensor, other_v: torch.Tensor | None = None, start: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (B, H, T, Dqk), v (B, H, T, D) of positions start.. (paired: (B, H/2, 2T, ·)) and the
        unmixed v."""
        B, T, C = x.shape
        qk = self.n_head * self.qk_full
        lam = self.lambdas[0] if self.weights_mix else None  # #47/#48: λ0 scales the QKV weight
        q, k, v = self.c_attn.project(x, lam).split((qk, qk, C), dim=-1)
        q, k = q.view(B, T, self.n_head, self.qk_full), k.view(B, T, self.n_head, self.qk_full)
        if self.narrow_qk:  # #92
            q, k = rotating_half(q), rotating_half(k)
        v = v.view(B, T, self.n_head, self.head_dim)[..., : self.v_dim]
        raw_v = v
        if not self.weights_mix:
            v = self.lambdas[0] * v
        if other_v is not None:  # #92: a narrow V takes the leading dims of each head of the embedding
            other_v = other_v.view(B, T, self.n_head, self.head_dim)[..., : self.v_dim]
            if self.ve_gate is not None:  # #55
                other_v = self.ve_gate.gate(other_v, x)
            v = v + other_v if self.weights_mix else v + self.lambdas[1] * other_v
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = F.rms_norm(q, (self.qk_dim,)), F.rms_norm(k, (self.qk_dim,))
        if self.paired:  # #58: the record's rotation, then the interleave
            q, k = rotate_paired(self.rotary, q, start), rotate_paired(self.rotary, k, start)
            return (*(interleave(t) for t in (q, k, v)), raw_v)
        return self.rotary(q, start), self.rotary(k, start), v, raw_v

    def output(
        self, y: torch.Tensor, x: torch.Tensor, v: torch.Tensor | None = None, dyn=None
    ) -> torch.Tensor:
        """Attention result (B, H, T, D) of the normed input x (B, T, C) → the layer's output (B, T, C);
        v (B, H, T, D): the values of y's positions, which #82's XSA reads; `dyn` ({"xsa", "attn"}, each
        (B, T, H)): #85's per-token XSA α and output gate, in place of the layer's own."""
        y = deinterleave(y) if self.paired else y
        dyn = dyn or {}
        if "xsa" in dyn:
            y = xsa_per_token(y, v, dyn["xsa"])
        elif self.xsa is not None:
            y = self.xsa(y, v)
        B, _, T, _ = y.shape
        if "attn" in dyn:
            y = y * dyn["attn"].type_as(y).transpose(1, 2).unsqueeze(-1)
        elif self.gate is not None:
            y = self.gate(y, x)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.v_dim)
        if self.narrow_v:  # #92: O's leading columns of each head
            w = leading(self.c_proj.weight, self.n_head, self.v_dim)
            return F.linear(y, (self.lambdas[1] * w if self.weights_mix else w).type_as(y))
        if self.weights_mix:  # #48
            return F.linear(y, (self.lambdas[1] * self.c_proj.weight).type_as(y))
        return self.c_proj(y)
