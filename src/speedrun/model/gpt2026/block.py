"""A gpt2026 layer and its residual form, one class per form, chosen per layer when the model is built
(`block_for`): nothing is rewired after construction and the forward reads no switch.

- `X0Block` (#45/#52, "x0-first"): x ← λ0·x + λ1·x0 (+ the bigram term), then x += attn, x += mlp;
- `PairBlock` (the medium record): the x0 weights are a pair, for x0 and the second embedding;
- `SublayerBlock` (#77, "sublayer"): x ← r·x + p·attn + x0·λ (+ bigram), then x ← r·x + p·mlp;
- `GatedBlock` (#85): the sublayer form whose x0/bigram shares come per token from the gate network;
- `MuddBlock` (#81): the last layer, whose every coefficient comes from MUDD (no lambdas of its own).

A block's forward takes one `Layer`: the stream and what the layer reads besides its parameters."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from speedrun.config.gpt2026 import Gpt2026Config, layer_scale
from speedrun.config.gpt2026.mlp import hidden_width
from speedrun.model.contexts import Context
from speedrun.model.gpt2026 import connections, gates
from speedrun.model.gpt2026.attention import Attention
from speedrun.model.gpt2026.mlp import mlp
from speedrun.model.gpt2026.specs import LayerSpec
from speedrun.model.labels import label
from speedrun.model.layers import Norm, Rotary


@dataclass
class Layer:
    """One layer's input: the stream `x`, the x0 shortcut, its attention context, the value-embedding rows
    mixed into v, its bigram term (scaled; the unscaled rows under #85's and #81's coefficients), an
    earlier layer's output its attention reads instead of x (#77), #85's gates of the layer (`dyn`), #81's
    coefficients (`mu`) and the medium record's second embedding, normed (`x02`)."""

    x: Tensor
    x0: Tensor
    ctx: Context
    other_v: Tensor | None = None
    bigram: Tensor | None = None
    attn_in: Tensor | None = None
    dyn: dict | None = None
    mu: list | None = None
    x02: Tensor | None = None
    keep: dict | None = None  # #92: where the MUDD layer leaves its normed inputs for the post-loop mix


class Block(nn.Module):
    """Norms, attention and MLP where the spec has them; the residual form is the subclass's."""

    def __init__(self, spec: LayerSpec, cfg: Gpt2026Config, rotary: Rotary):
        super().__init__()
        d = cfg.n_embd
        self.norm1 = Norm(d, "rmsnorm") if spec.attention else None
        # #82's α is a "scalar", trained with the lambdas in #77's form; #85's gate network gives it instead
        xsa = "lambda" if cfg.stream.residual_form == "sublayer" else "scalar"
        self.attn = (
            Attention(
                spec, d, cfg.n_head, rotary, layer_scale(cfg, spec.narrow_qk), cfg.attn,
                cfg.values.mix == "weights", value_gate(spec, cfg), None if cfg.mudd.gate_layer else xsa,
            )
            if spec.attention
            else None
        )  # fmt: skip
        self.norm2 = Norm(d, "rmsnorm") if spec.mlp else None
        hidden = hidden_width(cfg)
        self.mlp = mlp(d, hidden, cfg.mlp.fc_transposed, cfg.mlp.fp8) if spec.mlp else None
        # #92: a second MLP on the same normed input, scaled by the same post lambda
        self.mlp2 = mlp(d, hidden, cfg.mlp.fc_transposed, cfg.mlp.fp8) if spec.parallel_mlp else None
        self.site, self.rests = spec.x0_site or spec.bigram_site, spec.rests
        self.lambdas = self.x0_lambda = self.post_lambdas = None

    def attend(self, st: Layer, x: Tensor) -> Tensor:
        """The attention's output of the normed stream x (or of `attn_in`, #77)."""
        h = self.norm1(st.attn_in if st.attn_in is not None else x)
        return self.attn(h, st.ctx, st.other_v, st.dyn)[0]


def value_gate(spec: LayerSpec, cfg: Gpt2026Config) -> nn.Module | None:
    """#55's value-embedding gate of a layer with a value embedding (#70: paired layers keep x[:12]; #89's
    script: they read cat(x[:6], ve[:6]) too); #81's MUDD layer has MUDD's instead."""
    if not (cfg.values.gate and spec.value_embed is not None and spec.attention and not spec.mudd):
        return None
    ve_dims = 0 if spec.paired and not cfg.values.paired_ve_dims else cfg.values.ve_dims
    return gates.ValueEmbedGate(cfg.values.gate, cfg.n_head, ve_dims)


class X0Block(Block):
    """#45/#52: x ← λ0·x + λ1·x0 (+ bigram), x += attn(norm(x)), x += mlp(norm(x))."""

    def __init__(self, spec: LayerSpec, cfg: Gpt2026Config, rotary: Rotary):
        super().__init__(spec, cfg, rotary)
        self.lambdas, self.x0_lambda = connections.x0_lambdas(
            cfg.stream.resid_lambda_init, cfg.stream.x0_lambda_apart, cfg.stream.embed2
        )

    def mix(self, st: Layer) -> Tensor:
        x0_weight = self.x0_lambda if self.x0_lambda is not None else self.lambdas[1]
        return self.lambdas[0] * st.x + x0_weight * st.x0

    def forward(self, st: Layer) -> Tensor:
        x = self.mix(st)
        if st.bigram is not None:
            x = x + st.bigram
        if self.attn is not None:
            x = x + self.attend(st, x)
        return x + self.mlp(self.norm2(x)) if self.mlp is not None else x


class PairBlock(X0Block):
    """The medium record: x0 weights (x0's, the second embedding's) as a pair."""

    def mix(self, st: Layer) -> Tensor:
        return self.lambdas[0] * st.x + self.x0_lambda[0] * st.x0 + self.x0_lambda[1] * st.x02


class SublayerBlock(Block):
    """#77: the attention reads the stream (or attn_in) before x0 and the bigram are added;
    x ← r0·x + p0·attn + x0·λ (+ bigram), then x ← r1·x + p1·mlp(norm(x))."""

    def __init__(self, spec: LayerSpec, cfg: Gpt2026Config, rotary: Rotary):
        super().__init__(spec, cfg, rotary)
        self.lambdas, self.post_lambdas = connections.sublayer_lambdas(cfg.stream.resid_lambda_init)
        if spec.rests:  # #92's layer 7: no sublayer output to scale
            self.post_lambdas = None
        if spec.attention and not cfg.mudd.gate_layer:  # #85: the x0 share comes from the gate network
            self.x0_lambda = label(nn.Parameter(torch.zeros(1)), "lambda")

    def after_attention(self, st: Layer, y: Tensor) -> Tensor:
        inject = st.x0 * self.x0_lambda[0]  # 0-dim: a bf16 stream stays bf16
        inject = inject + st.bigram if st.bigram is not None else inject
        return self.lambdas[0] * st.x + self.post_lambdas[0] * y + inject

    def forward(self, st: Layer) -> Tensor:
        if self.attn is not None:
            x = self.after_attention(st, self.attend(st, st.x))
        elif self.site:  # #92: an injection site without attention keeps its resid lambda (GatedBlock)
            x = self.inject(st, self.lambdas[0] * st.x)
        else:
            x = st.x
        if self.mlp is not None:
            h = self.norm2(x)
            x = self.lambdas[1] * x + self.post_lambdas[1] * self.mlp(h)
            if self.mlp2 is not None:  # #92: the parallel MLP
                x = x + self.post_lambdas[1] * self.mlp2(h)
        elif self.rests:  # #92's layer 7
            x = self.lambdas[1] * x
        return x


class GatedBlock(SublayerBlock):
    """#85: the sublayer form with per-token x0 and bigram shares from the gate network, in HEAD's order;
    #92: only on the layers that are their sites (model.stream.x0_layers / bigram_layers)."""

    def inject(self, st: Layer, x: Tensor) -> Tensor:
        x = x + st.x0 * st.dyn["x0"] if "x0" in st.dyn else x
        return x + st.bigram * st.dyn["bigram"] if st.bigram is not None and "bigram" in st.dyn else x

    def after_attention(self, st: Layer, y: Tensor) -> Tensor:
        return self.inject(st, self.lambdas[0] * st.x + self.post_lambdas[0] * y)


class MuddBlock(SublayerBlock):
    """#81: the last layer, every coefficient from MUDD's `mu` (its lambdas are MUDD's: none here); its
    value gate is MUDD's too."""

    def __init__(self, spec: LayerSpec, cfg: Gpt2026Config, rotary: Rotary):
        Block.__init__(self, spec, cfg, rotary)

    def after_attention(self, st: Layer, y: Tensor) -> Tensor:
        mu = st.mu
        x = mu[8] * st.x + mu[9] * y + mu[10] * st.x0
        return x + mu[11] * st.bigram if st.bigram is not None else x

    def attend(self, st: Layer, x: Tensor) -> Tensor:
        h = self.norm1(st.attn_in if st.attn_in is not None else x)
        st.keep["attn_in"] = h  # #92's post-loop mix reads it
        return self.attn(h, st.ctx, st.other_v, st.dyn)[0]

    def forward(self, st: Layer) -> Tensor:
        x = self.after_attention(st, self.attend(st, st.x))
        h = self.norm2(x)
        st.keep["mlp_in"] = h  # #92's post-loop mix reads it
        return st.mu[12] * x + st.mu[13] * self.mlp(h)


def block_for(spec: LayerSpec, cfg: Gpt2026Config, rotary: Rotary) -> Block:
    """The layer's block in its residual form (an absent layer: a bare Block, never called)."""
    if not spec.present:
        return Block(spec, cfg, rotary)
    if cfg.stream.residual_form != "sublayer":
        return (PairBlock if cfg.stream.embed2 else X0Block)(spec, cfg, rotary)
    if spec.mudd:
        return MuddBlock(spec, cfg, rotary)
    return (GatedBlock if cfg.mudd.gate_layer else SublayerBlock)(spec, cfg, rotary)
