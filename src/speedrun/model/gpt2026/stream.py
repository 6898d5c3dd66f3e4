"""What flows between gpt2026 layers in one forward (`Stream`) and how each layer's input is read from it:
the embeddings and the first bigram share going in (`enter`), a layer's skip, gates, value rows, bigram
term and attention input (`layer_input`), MUDD's and the backout's recombination coming out (`leave`).
The model's `hidden` is the loop over its blocks between these three."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from speedrun.model.gpt2026 import connections
from speedrun.model.gpt2026.block import Layer
from speedrun.model.gpt2026.gates import skip_gate_of
from speedrun.model.gpt2026.specs import LayerSpec

#: #85's gate kinds a layer reads (its bigram share apart)
DYN = ("x0", "bigram", "xsa", "attn", "dc1", "dc2")


@dataclass(frozen=True)
class Stream:
    """What later layers read besides the residual stream, which stays a local of the loop (compiled
    graphs lose attribute writes on objects made inside them, so nothing here is reassigned): x0 (the
    normed embedding; #89's script: with layer 0's bigram share), c0 (the stream entering the first
    layer, #81), the second embedding (medium), the value-embedding rows, the unscaled bigram rows, #85's
    gates so far, the attention contexts; `outputs` keeps the layers' outputs later layers read and the
    last layer's input (#81, key "last")."""

    x0: Tensor
    c0: Tensor
    x02: Tensor | None
    tables: list[Tensor] | None
    bigram: Tensor | None
    gates: dict
    contexts: list
    outputs: dict = field(default_factory=dict)


def enter(
    model: torch.nn.Module, idx: Tensor, contexts: list, start: int, prev: Tensor | None
) -> tuple[Tensor, Stream]:
    """Embeddings (smeared, #34), normed; the bigram rows and #85's pre gate; #77's first bigram share."""
    x = model.wte(idx)
    if model.smear is not None:
        x = model.smear(x, model.wte(prev[:, -1:]) if prev is not None else None)
    x = x0 = model.embed_norm(x)
    x02 = model.embed_norm(model.embed2(idx)) if model.embed2 is not None else None
    tables = [emb(idx) for emb in model.value_embeds] if model.value_embeds is not None else None
    bigram = model.bigram(idx, prev, start) if model.bigram is not None else None
    gates = model.mudd_gate(x0, 0) if model.mudd_gate is not None else {}  # #85: the pre gate
    first = model.walk[0].index
    if model.bigram_first and bigram is not None and (not gates or ("bigram", first) in gates):  # #77
        x = x + bigram * (gates[("bigram", first)] if gates else model.bigram.lambdas[first])
        x0 = x if model.bigram_in_x0 else x0  # #89's script: x0 carries layer 0's share too
    return x, Stream(x0, x, x02, tables, bigram, dict(gates), contexts)


def layer_input(model: torch.nn.Module, s: LayerSpec, st: Stream, x: Tensor) -> Layer:
    """Layer s's input: the stream with its skip added, its gates (#85, the post gate computed at its
    layer), value rows, bigram term and attention input; the MUDD layer's recombined by MUDD (#81)."""
    if s.post_gate:  # #85: the post gate
        st.gates.update(model.mudd_gate(x, 1))
    gates = st.gates
    if s.skip_from is not None:
        scale = connections.skip_scale(model.skip_weights[s.skip_weight], s.skip_form)
        if model.skip_gate is not None:  # #55 (the medium record: one gate per skip)
            scale = scale * skip_gate_of(model.skip_gate, s.skip_weight)(st.x0)
        scale = scale * gates[("skip", -1)] if gates else scale
        x = x + scale * st.outputs[s.skip_from]
    other_v = st.tables[s.value_embed] if s.value_embed is not None else None
    dyn, b = None, st.bigram
    first = s.index == model.walk[0].index and model.bigram_first
    if gates:  # #85: this layer's gates, the bigram rows unscaled
        dyn = {k: gates[(k, s.index)] for k in DYN if (k, s.index) in gates}
    elif b is not None and not s.mudd:
        b = model.bigram.lambdas[s.index] * b
    b = None if first and not s.mudd else b
    attn_in = st.outputs[s.attn_input] if s.attn_input is not None else None  # #77
    ctx = st.contexts[s.index]
    if not s.mudd:
        return Layer(x, st.x0, ctx, other_v, b, attn_in, dyn, None, st.x02)
    st.outputs["last"], attn_in = x, attn_in if attn_in is not None else x  # #81: MUDD's coefficients of x
    x, other_v, mu = model.mudd.enter_last(x, st.c0, st.outputs[model.mudd.sources[0]], other_v)
    return Layer(x, st.c0, ctx, other_v, b, attn_in, dyn, mu, keep=st.outputs)


def final_source(model: torch.nn.Module, st: Stream, name: str) -> Tensor:
    """A post-loop MUDD source by its name (config/gpt2026/mudd.py SOURCE_NAMES, or veN: table N)."""
    if name.startswith("ve"):
        return st.tables[int(name[2:])]
    named = {"c0": st.c0, "h": model.mudd.sources[0], "s": model.mudd.sources[1]}
    got = named.get(name, name)  # "last", "mlp_in", "attn_in": kept by the last layer
    return got if isinstance(got, Tensor) else st.outputs[got]


def leave(model: torch.nn.Module, st: Stream, x: Tensor) -> Tensor:
    """The last layer's output x with #81's recombination (the backout in its bias) or #40's backout."""
    if model.mudd is not None:
        x = model.mudd.final(x, [final_source(model, st, n) for n in model.mudd.final_names])
    return model.backout(x, st.outputs) if model.backout is not None else x
