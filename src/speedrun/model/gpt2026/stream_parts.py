"""The residual stream's connections into a layer, one part each (stream.layer_input runs them in order):

- `GateLanes` (#85): the post gate network at its layer, then the layer's gates from the pre or post MLP;
- `Skip` (#32/#45 U-Net skips, #55's gate, #85's gate lane): an earlier output added to the stream;
- `ValueRows` (#45/#63 on): the layer's value-embedding rows, mixed into v;
- `BigramInput` (#62/#77/#92): the bigram (or n-gram) rows, scaled by the layer's share or left to its gate;
- `CachedInput` (#77): an earlier layer's output that the attention reads instead of the stream;
- `MuddEntry` (#81): the last layer's input and v recombined by MUDD's coefficients.

Each part writes named fields of the layer's input (block.Layer) and may change the stream x; a part a
model does not use is not in its list (`connections_of`), so a new connection is a new part here, not a
branch in the loop. Parameters stay where the model declares them (their names are the checkpoints'):
a part reads them from the model when called."""

from __future__ import annotations

import torch
from torch import Tensor

from speedrun.model.gpt2026 import connections
from speedrun.model.gpt2026.gates import skip_gate_of
from speedrun.model.gpt2026.specs import LayerSpec

#: #85's gate kinds a layer reads (its bigram share apart)
DYN = ("x0", "bigram", "xsa", "attn", "dc1", "dc2")


class GateLanes:
    """#85: the post gate computed at its layer; the layer's own lanes as `dyn`."""

    name = "gates"

    def __call__(self, model, s: LayerSpec, st, x: Tensor, f: dict) -> Tensor:
        if s.post_gate:
            st.gates.update(model.mudd_gate(x, 1))
        f["dyn"] = {k: st.gates[(k, s.index)] for k in DYN if (k, s.index) in st.gates}
        return x


class Skip:
    """x += scale·h_src: the weight (or σ(w), #32), times #55's gate of x0 and #85's skip lane."""

    name = "skip"

    def __call__(self, model, s: LayerSpec, st, x: Tensor, f: dict) -> Tensor:
        if s.skip_from is None:
            return x
        scale = connections.skip_scale(model.skip_weights[s.skip_weight], s.skip_form)
        if model.skip_gate is not None:  # #55 (the medium record: one gate per skip)
            scale = scale * skip_gate_of(model.skip_gate, s.skip_weight)(st.x0)
        scale = scale * st.gates[("skip", -1)] if st.gates else scale
        return x + scale * st.outputs[s.skip_from]


class ValueRows:
    name = "values"

    def __call__(self, model, s: LayerSpec, st, x: Tensor, f: dict) -> Tensor:
        f["other_v"] = st.tables[s.value_embed] if s.value_embed is not None else None
        return x


class BigramInput:
    """The bigram rows: scaled by the layer's share, or unscaled under #85's gates and #81's mu; none on
    the first layer of #77's form (its share entered the stream before it)."""

    name = "bigram"

    def __call__(self, model, s: LayerSpec, st, x: Tensor, f: dict) -> Tensor:
        b = st.bigram
        if not st.gates and not s.mudd:
            b = model.bigram.lambdas[s.index] * b
        first = s.index == model.walk[0].index and model.bigram_first
        f["bigram"] = None if first and not s.mudd else b
        return x


class CachedInput:
    name = "attn_input"  # #77

    def __call__(self, model, s: LayerSpec, st, x: Tensor, f: dict) -> Tensor:
        f["attn_in"] = st.outputs[s.attn_input] if s.attn_input is not None else None
        return x


class MuddEntry:
    """#81: on the last layer, x and v recombined from c0, h and x; the layer's x0 is c0; its attention
    reads x (or its cached input); it leaves its normed inputs in `keep` (#92's post-loop mix)."""

    name = "mudd"

    def __call__(self, model, s: LayerSpec, st, x: Tensor, f: dict) -> Tensor:
        if not s.mudd:
            return x
        st.outputs["last"] = x  # MUDD's coefficients of x
        f["attn_in"] = f.get("attn_in") if f.get("attn_in") is not None else x
        x, f["other_v"], f["mu"] = model.mudd.enter_last(
            x, st.c0, st.outputs[model.mudd.sources[0]], f["other_v"]
        )
        f["x0"], f["x02"], f["keep"] = st.c0, None, st.outputs
        return x


def connections_of(model: torch.nn.Module) -> tuple:
    """The parts this model's layers read, in the order they act (the gates before the skip reads its
    lane; MUDD last, on the stream the others left)."""
    parts = [GateLanes()] if model.mudd_gate is not None else []
    parts += [Skip()] if model.skip_weights is not None else []
    parts += [ValueRows()]
    parts += [BigramInput()] if model.bigram is not None else []
    parts += [CachedInput()] if any(s.attn_input is not None for s in model.specs) else []
    parts += [MuddEntry()] if model.mudd is not None else []
    return tuple(parts)
