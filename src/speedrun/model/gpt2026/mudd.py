"""MUDD: multiway dynamic dense connections on the last layer and before the final norm (record #81,
2026-04-22, PR #259 v3, `records/track_1_short/2026-04-22_MuddFormer`; arXiv 2502.12170), as the
repository's train_gpt.py runs it from #81 through #89 (`init_mudd`, `forward_mudd` and the lines of
`GPT.forward` that read `mu`).

Two small GELU MLPs read the residual stream and give per-token coefficients, `mu = (W2·gelu(W1·x) + b)·0.1`
(W1 (64, d) kaiming-uniform, W2 zero, so at step 0 every coefficient is its bias times 0.1):

- at the start of the last layer, from its input x (the output of the layer before, "h9"), 14 coefficients:
  V gets `mu0·c0 + mu1·h + mu2·x` added (with the value embedding scaled by `mu6`/`mu7`, one per half of the
  heads, instead of the layer's sigmoid gate); the stream becomes `(1 + mu5)·x + mu3·c0 + mu4·h`; the
  attention sublayer is `x ← mu8·x + mu9·attn + mu10·c0 + mu11·bigram`, the MLP's `x ← mu12·x + mu13·mlp`
  (the per-sublayer lambdas of #77 made per token; biases start them at the record's static values);
- before the final norm, from the last layer's output, 5 coefficients:
  `x ← x + mu0·c0 + mu1·h + mu2·x9 + mu3·ve0 + mu4·s`, with mu1's bias at −0.5: #40's backout (x − 0.5·h).

c0 is the stream entering layer 0 (after #77's first bigram share), h and s the outputs of the layers
`model.mudd_sources = [h, s]` names (record [7, 3]), x9 the last layer's input, ve0 value-embedding table 0.
Trained by Adam at 0.25× the Adam LR, betas (0.9, 0.99); the biases without weight decay.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from speedrun.model.labels import label

HIDDEN = 64  # the MLPs' width
SCALE = 0.1  # `_mudd_scale`: coefficients = (W2·gelu(W1·x) + b)·SCALE
LAYER_COEFS, FINAL_COEFS = 14, 5


def kaiming_rows_(w1: torch.Tensor) -> None:
    """Each of the stacked W1 (2, HIDDEN, dim) as nn.Linear's default init (kaiming-uniform, a = √5)."""
    for j in range(w1.size(0)):
        nn.init.kaiming_uniform_(w1.data[j], a=math.sqrt(5))


def two_layer(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, n: int) -> torch.Tensor:
    """x (B, T, C) → W2[:n]·gelu(W1·x) + b2[:n] (B, T, n), in x's dtype: the shape of every MUDD MLP."""
    h = F.gelu(F.linear(x, w1.type_as(x)))
    return F.linear(h, w2[:n].type_as(x)) + b2[:n].type_as(x)


def bias_init(resid_init: float) -> torch.Tensor:
    """The record's b (2, 14) in the pre-scaled domain: the last layer's VE gate lanes at 2, its resid
    lambdas at √resid_init (#77's per-sublayer √1.1), its post lambdas at 1, its bigram share at 0.05, its
    x0 share at 0; before the final norm, the backout −0.5 on h."""
    b = torch.zeros(2, LAYER_COEFS)
    b[0, 6] = b[0, 7] = 2.0 / SCALE
    b[0, 8] = b[0, 12] = resid_init**0.5 / SCALE
    b[0, 9] = b[0, 13] = 1.0 / SCALE
    b[0, 11] = 0.05 / SCALE
    b[1, 1] = -0.5 / SCALE
    return b


class Mudd(nn.Module):
    """The two coefficient MLPs, stacked as the record's `mudd_w1`, `mudd_w2`, `mudd_b2`."""

    def __init__(
        self, dim: int, n_head: int, resid_init: float, sources: list[int],
        final: tuple[str, ...] = ("c0", "h", "last", "ve0", "s"), groups: int = 0,
    ):  # fmt: skip
        super().__init__()
        self.n_head = n_head
        self.w1 = label(nn.Parameter(torch.empty(2, HIDDEN, dim)), "mudd")
        self.w2 = label(nn.Parameter(torch.zeros(2, LAYER_COEFS, HIDDEN)), "mudd")
        self.b2 = label(nn.Parameter(bias_init(resid_init)), "mudd_bias")
        self.resid_init = resid_init
        self.sources = tuple(sources)  # [h, s]: the layers whose outputs it recombines (model.mudd.sources)
        self.final_names = tuple(final)  # what the post-loop mix adds, by name (config/gpt2026/mudd.py)
        self.groups = groups
        # #92: per channel group, each post-loop coefficient's delta read off the same hidden (from zero)
        self.w2g = label(nn.Parameter(torch.zeros(LAYER_COEFS, groups, HIDDEN)), "mudd") if groups else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """W1 as nn.Linear's default (kaiming-uniform, a = √5), W2 zero, b the record's values."""
        kaiming_rows_(self.w1)
        nn.init.zeros_(self.w2)
        if self.w2g is not None:
            nn.init.zeros_(self.w2g)
        with torch.no_grad():
            self.b2.copy_(bias_init(self.resid_init))

    def coefs(self, x: torch.Tensor, which: int, n: int) -> list[torch.Tensor]:
        """x (B, T, C) → n coefficients (B, T, 1) of MLP `which` (0 the last layer's, 1 the final)."""
        mu = two_layer(x, self.w1[which], self.w2[which], self.b2[which], n) * SCALE
        return list(mu.split(1, dim=-1))

    def enter_last(
        self, x: torch.Tensor, c0: torch.Tensor, h: torch.Tensor, ve: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """At the start of the last layer (x its input): (the stream recombined, what V gets added
        (B, T, C): the value embedding ve scaled per half of the heads plus the MUDD mix, the 14 mu)."""
        mu = self.coefs(x, 0, LAYER_COEFS)
        B, T, C = x.shape
        H = self.n_head
        v_mix = mu[0] * c0 + mu[1] * h + mu[2] * x
        gate = torch.cat([mu[6], mu[7]], dim=-1).repeat_interleave(H // 2, dim=-1).unsqueeze(-1)
        extra = gate * ve.view(B, T, H, C // H).type_as(x) + v_mix.view(B, T, H, C // H)
        return (1 + mu[5]) * x + mu[3] * c0 + mu[4] * h, extra.view(B, T, C), mu

    def final(self, x: torch.Tensor, sources: list[torch.Tensor]) -> torch.Tensor:
        """Before the final norm: x plus one coefficient per source (#81: [c0, h, x9, ve0, s]); #92: per
        channel group, each coefficient plus its group's delta."""
        if self.groups:
            return self.final_grouped(x, sources)
        mu = self.coefs(x, 1, len(sources))
        for m, src in zip(mu, sources, strict=True):
            x = x + m * src.type_as(x)
        return x

    def final_grouped(self, x: torch.Tensor, sources: list[torch.Tensor]) -> torch.Tensor:
        """#92's mix: the C channels in G groups; source k gets (mu_k + delta_{k,g})·SCALE per group g, the
        deltas W2g·h off the same GELU hidden h as the coefficients."""
        n, G = len(sources), self.groups
        h = F.gelu(F.linear(x, self.w1[1].type_as(x)))
        mu = (F.linear(h, self.w2[1, :n].type_as(x)) + self.b2[1, :n].type_as(x)) * SCALE
        deltas = torch.einsum("btd,kgd->btkg", h, self.w2g[:n].type_as(x)) * SCALE
        mixed = x.unflatten(-1, (G, -1))
        for k, src in enumerate(sources):
            coef = (mu[..., k : k + 1] + deltas[..., k, :]).unsqueeze(-1)
            mixed = mixed + coef * src.type_as(x).unflatten(-1, (G, -1))
        return mixed.flatten(-2)


# The MUDD gate network (record #85, 2026-05-27, PR #315 v3, records/track_1_short/2026-05-27-MuddGatedAndDC;
# `init_mudd_gate`, `forward_mudd_gate`, `unpack_*_mudd_gate` of train_gpt.py from #85 through #89): two more
# GELU MLPs of the same shape give per-token gates that replace learned static ones, g = (W2·gelu(W1·x) + b)·σ
# with σ a learned scalar from 0.1. The "pre" gate reads the normed embedding x0, the "post" gate the stream
# entering layer `model.mudd_gate_layer` (record 4); each layer's gates come from the one before or at it:
#
# - XSA α (#82) per head of every XSA layer: y ← y − tanh(g)·(y·v/‖v‖²)·v (#86's form), no static α;
# - the attention-output gate per head of `model.mudd_gate_attn_layers` (record [3, 10]): y ← g·y, no
#   sigmoid (#28's gates are gone), from 0.25;
# - x0 and bigram shares of every attention layer but the MUDD layer (#77's x0_lambdas and
#   bigram_lambdas), x0 from 0, bigram from 0.05 (layer 0's bigram share enters the stream before it);
# - the skip's gate (post only): x += sigmoid(w)·g·h_src, from 0.5 (#55's skip gate is gone);
# - the DC correction's w1, w2 per head of `model.dc_layers` (post only; record [10]; dc.py), w1 from 1.
#
# Columns, as the record's: XSA layers (heads each), attention-gate layers (heads each), (x0, bigram) per
# layer, the skip, then (w1, w2) per DC layer (heads each).

GATE_BIAS = {"attn": 0.25, "bigram": 0.05, "skip": 0.5, "dc1": 1.0}  # the rest from 0


def gate_columns(
    n_head: int, xsa: list[int], attn: list[int], inject: list[int], skip: bool, dc: list[int],
    sites: tuple[list[int], list[int]] | None = None,
) -> list[tuple[str, int, int]]:  # fmt: skip
    """(kind, layer, width) per column group of one gate MLP, in the record's order: #85's (x0, bigram)
    pair per layer of `inject`, or #92's x0 lanes of its sites, then their bigram lanes (`sites`)."""
    cols = [("xsa", i, n_head) for i in xsa] + [("attn", i, n_head) for i in attn]
    if sites is None:
        cols += [(k, i, 1) for i in inject for k in ("x0", "bigram")]
    else:
        cols += [("x0", i, 1) for i in sites[0]] + [("bigram", i, 1) for i in sites[1]]
    cols += [("skip", -1, 1)] if skip else []
    return cols + [(k, i, n_head) for i in dc for k in ("dc1", "dc2")]


class MuddGate(nn.Module):
    """The pre (0) and post (1) gate MLPs, stacked as the record's mudd_gate_w1/w2/b2, _mudd_gate_scale."""

    def __init__(self, dim: int, layouts: tuple[list, list]):
        super().__init__()
        self.layouts = layouts
        self.widths = tuple(sum(w for _, _, w in cols) for cols in layouts)
        rows = max(self.widths)
        self.w1 = label(nn.Parameter(torch.empty(2, HIDDEN, dim)), "mudd_gate")
        self.w2 = label(nn.Parameter(torch.zeros(2, rows, HIDDEN)), "mudd_gate")
        self.b2 = label(nn.Parameter(torch.zeros(2, rows)), "mudd_gate_bias")
        self.scale = label(nn.Parameter(torch.full((1,), SCALE)), "mudd_gate_bias")  # the record's is 0-dim
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """W1 kaiming-uniform (a = √5), W2 zero, σ 0.1, b the record's starting gates divided by 0.1."""
        kaiming_rows_(self.w1)
        nn.init.zeros_(self.w2)
        with torch.no_grad():
            self.scale.fill_(SCALE)
            self.b2.zero_()
            for j, cols in enumerate(self.layouts):
                at = 0
                for kind, _, width in cols:
                    if kind in GATE_BIAS:
                        self.b2[j, at : at + width] = GATE_BIAS[kind] / SCALE
                    at += width

    def forward(self, x: torch.Tensor, which: int) -> dict[tuple[str, int], torch.Tensor]:
        """x (B, T, C) → {(kind, layer): gate (B, T, width)} of MLP `which` (layer −1 for the skip)."""
        g = two_layer(x, self.w1[which], self.w2[which], self.b2[which], self.widths[which])
        g = g * self.scale.type_as(x)
        out, at = {}, 0
        for kind, layer, width in self.layouts[which]:
            out[(kind, layer)] = g[..., at : at + width]
            at += width
        return out


def xsa_per_token(y: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """#85/#86: y, v (B, H, T, D), α (B, T, H) from the gate network → y − tanh(α)·(y·v/max(‖v‖², 1e-8))·v."""
    dot = (y * v).sum(-1, keepdim=True)
    denom = v.square().sum(-1, keepdim=True).clamp_min(1e-8)
    a = torch.tanh(alpha).type_as(y).transpose(1, 2).unsqueeze(-1)
    return y - a * (dot / denom) * v


def gate_layouts(cfg) -> tuple[list, list]:
    """The pre and post column groups of a Gpt2026Config with `mudd_gate_layer` g: each layer's gates
    in the MLP before it (pre: layers < g), the skip in the post one."""
    g, last = cfg.mudd.gate_layer, cfg.n_layer - 1
    xsa, attn = sorted(cfg.attn.xsa_layers), sorted(cfg.mudd.gate_attn_layers)
    inject = [i for i in sorted(cfg.attention_layers) if i != last]
    explicit = cfg.stream.x0_layers or cfg.stream.bigram_layers  # #92: its lanes grouped by kind
    sites = (sorted(cfg.stream.x0_layers), sorted(cfg.stream.bigram_layers))
    side = lambda group, pre: [i for i in group if (i < g) == pre]  # noqa: E731
    return tuple(
        gate_columns(
            cfg.n_head, side(xsa, pre), side(attn, pre), side(inject, pre),
            skip=not pre and bool(cfg.skips), dc=[] if pre else sorted(cfg.mudd.dc_layers),
            sites=(side(sites[0], pre), side(sites[1], pre)) if explicit else None,
        )
        for pre in (True, False)
    )  # fmt: skip
