"""Building blocks of the GPT without attention logic: linear layers, norms, rotary, MLP.
`CastedLinear` (2024-11-08 "CastBf16") keeps fp32 weights and casts them to the activation dtype in
forward, so one module serves autocast, bf16 activations and fp32."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from speedrun import ops
from speedrun.model.labels import label, label_linear


class CastedLinear(nn.Linear):
    """nn.Linear whose weight (and bias) are cast to the input's dtype in forward (names and shapes are
    nn.Linear's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, self.cast_weight(x), bias)

    def cast_weight(self, x: torch.Tensor) -> torch.Tensor:
        """The (out, in) weight in x's dtype, as forward multiplies it."""
        return self.weight.to(x.dtype)


class TransposedLinear(CastedLinear):
    """A CastedLinear whose weight is stored transposed, (in, out), as #27's MLP up-projection: the same map,
    but Muon's shape rule √max(1, rows/cols) gives it the base LR instead of twice it."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.weight = nn.Parameter(self.weight.detach().T.contiguous())

    def cast_weight(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.T.to(x.dtype)


def embedding(rows: int, dim: int, name: str) -> nn.Embedding:
    """A table of `rows` rows labelled `name` ("embed", the medium record's "embed2", "value_embed")."""
    emb = nn.Embedding(rows, dim)
    label(emb.weight, name)
    return emb


def scaled_uniform_(weight: torch.Tensor, fan_in: int, gain: float = 0.5) -> torch.Tensor:
    """Uniform init with std `gain / sqrt(fan_in)` (Sub3Min: 0.5 is a bit better than torch's 1/sqrt(3))."""
    bound = math.sqrt(3.0) * gain / math.sqrt(fan_in)
    with torch.no_grad():
        return weight.uniform_(-bound, bound)


class Norm(nn.Module):
    """LayerNorm (GPT-2), parameter-free RMSNorm, or RMSNorm with gains (``rmsnorm-gain``, track 3; with
    ``fp32`` #46's fp32 normalization times fp32 gains). `eps` 0 is F.rms_norm's default (the seed and 10-10:
    1e-6); `fp32` normalizes in fp32 and casts back (2024-10)."""

    def __init__(self, dim: int, kind: str, eps: float = 0.0, fp32: bool = False):
        super().__init__()
        self.kind = kind
        self.ln = nn.LayerNorm(dim) if kind == "layernorm" else None
        for p in self.ln.parameters() if self.ln is not None else ():
            label(p, "scalar")
        self.gains = label(nn.Parameter(torch.ones(dim)), "scalar") if kind == "rmsnorm-gain" else None
        self.eps = eps if eps > 0 else None
        self.fp32 = fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ln is not None:
            return self.ln(x)
        if self.fp32:  # with gains: #46's `(norm(x.float()) * self.gains).type_as(x)`
            y = F.rms_norm(x.float(), (x.size(-1),), eps=self.eps)
            return (y * self.gains if self.gains is not None else y).type_as(x)
        gains = self.gains.type_as(x) if self.gains is not None else None
        return F.rms_norm(x, (x.size(-1),), weight=gains, eps=self.eps)


def rotary_frequencies(head_dim: int, base: float, half_truncated: bool) -> torch.Tensor:
    """head_dim/2 angular frequencies: base^(-2i/head_dim) (RoFormer), or half_truncated (Sub3Min) head_dim/4
    geometric from 1 to 1/1024 and head_dim/4 zeros (those pairs carry position-free content)."""
    if not half_truncated:
        return 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    quarter = head_dim // 4
    freqs = (1.0 / 1024) ** torch.linspace(0, 1, steps=quarter, dtype=torch.float32)
    return torch.cat([freqs, freqs.new_zeros(head_dim // 2 - quarter)])


ROPE_PRECISIONS = ("auto", "fp32", "bf16", "bf16-angles")


def rotary_tables(
    head_dim: int, max_seq_len: int, base: float, half_truncated: bool, precision: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables (max_seq_len, head_dim/2) as a record computes them: bf16 (10-14 … 11-24) rounds
    fp32 cos/sin; bf16-angles (12-04/12-08) rounds the inverse frequencies, so angles and cos/sin are bf16
    too; else fp32."""
    if precision == "bf16-angles":
        inv = ((1 / base) ** (torch.arange(0, head_dim, 2) / head_dim)).to(torch.bfloat16)
        angles = torch.outer(torch.arange(max_seq_len).to(torch.bfloat16), inv)
        return angles.cos(), angles.sin()
    angles = torch.outer(
        torch.arange(max_seq_len, dtype=torch.float32), rotary_frequencies(head_dim, base, half_truncated)
    )
    if precision == "bf16":
        return angles.cos().bfloat16(), angles.sin().bfloat16()
    return angles.cos(), angles.sin()


class Rotary(nn.Module):
    """Rotary position embedding on (B, H, T, D). "auto": full rotates in the activation dtype (2024-11),
    half-truncated in fp32 (Sub3Min); "fp32": fp32 tables and rotation (10-10); "bf16", "bf16-angles":
    bf16 tables (rotary_tables), rotation in the activation dtype."""

    def __init__(
        self,
        head_dim: int,
        max_seq_len: int,
        base: float,
        half_truncated: bool = False,
        precision: str = "auto",
        turning_half: bool = False,
    ):
        """`turning_half` (#92's narrow heads, half_truncated): only the frequencies that turn, a table for
        heads of head_dim/2 that rotate all their dims."""
        super().__init__()
        assert precision in ROPE_PRECISIONS, precision
        assert half_truncated or not turning_half
        self.fp32 = precision == "fp32" or (precision == "auto" and half_truncated)
        cos, sin = rotary_tables(head_dim, max_seq_len, base, half_truncated, precision)
        if turning_half:
            cos, sin = cos[:, : head_dim // 4], sin[:, : head_dim // 4]
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Rotate x (B, H, T, D) as positions start..start+T (start > 0: cached decoding)."""
        T = x.size(-2)
        assert start + T <= self.cos.size(0), "config.validate keeps sequences within model.max_seq_len"
        dtype = torch.float32 if self.fp32 else x.dtype
        cos, sin = self.cos[start : start + T].to(dtype), self.sin[start : start + T].to(dtype)
        x1, x2 = x.to(dtype).chunk(2, dim=-1)
        return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1).to(x.dtype)


class MLP(nn.Module):
    """Up-projection, ReLU² or GELU (tanh form as GPT-2/llm.c, or exact erf as the 2024-10 records);
    `fc_transposed` stores the up-projection as (dim, hidden) (#27, TransposedLinear)."""

    def __init__(
        self, dim: int, hidden: int, bias: bool, relu2: bool, gelu: str = "tanh", fc_transposed: bool = False
    ):
        super().__init__()
        self.c_fc = label_linear(
            (TransposedLinear if fc_transposed else CastedLinear)(dim, hidden, bias), "mlp_in"
        )
        self.c_proj = label_linear(CastedLinear(hidden, dim, bias=bias), "mlp_out")
        self.relu2 = relu2
        self.gelu_approximate = "tanh" if gelu == "tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.relu2 and self.c_fc.bias is None:  # one op, which a fused kernel may replace (speedrun.perf)
            return self.c_proj(relu2_linear(x, self.c_fc.cast_weight(x)))
        h = self.c_fc(x)
        h = F.relu(h).square() if self.relu2 else F.gelu(h, approximate=self.gelu_approximate)
        return self.c_proj(h)


@ops.plain_op("relu2_linear")
def relu2_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """ReLU²(x Wᵀ) for the (out, in) weight W in x's dtype: the MLP's up-projection and activation."""
    return F.relu(F.linear(x, weight)).square()


def softcap(
    logits: torch.Tensor, cap: float, form: str, divisor: float = 0.0, offset: float = 0.0
) -> torch.Tensor:
    """Bound the logits smoothly, dividing as the records do (z/7.5, not z·(2/15), which rounds differently).
    tanh: cap·tanh(z/cap) (2024-11). sigmoid: 2·cap·sigmoid(2z/cap), cap·tanh + a constant (Sub3Min:
    30·sigmoid(z/7.5)); `divisor` replaces cap/2 (2025-05 … 07), `offset` shifts z (#54:
    23·sigmoid((z+5)/7.5)). algebraic (track 3): ``15 * z * (z.square() + 15**2).rsqrt()``."""
    if form == "algebraic":
        return cap * logits * (logits.square() + cap**2).rsqrt()
    if form == "sigmoid":
        z = logits + offset if offset else logits  # no add when 0: older records' op order exactly
        return 2 * cap * torch.sigmoid(z / (divisor or cap / 2))
    return cap * torch.tanh(logits / cap)
