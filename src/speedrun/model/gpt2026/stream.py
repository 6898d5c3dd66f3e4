"""What flows between gpt2026 layers in one forward (`Stream`) and how each layer's input is read from it:
the embeddings and the first bigram share going in (`enter`), a layer's skip, gates, value rows, bigram
term and attention input (`layer_input`, through the connection parts of stream_parts.py), MUDD's
recombination (named sources, #92's channel groups) and the backout coming out (`leave`).
The model's `hidden` is the loop over its blocks between these three."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from speedrun.model.gpt2026.block import Layer
from speedrun.model.gpt2026.specs import LayerSpec


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
    """Layer s's input: the stream and what the layer reads besides it, each connection part
    (stream_parts.py) in turn writing its named fields (and the skip and MUDD changing the stream)."""
    f = dict(x0=st.x0, ctx=st.contexts[s.index], other_v=None, bigram=None, attn_in=None, dyn=None, mu=None)
    f.update(x02=st.x02, keep=None)
    for part in model.connections:
        x = part(model, s, st, x, f)
    return Layer(x=x, **f)


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
