"""Per-layer specs of the gpt2026 family: the config's per-layer lists read once, one LayerSpec per layer.

The model builds its parts from these and its forward walks them; nothing downstream reads the config's
lists again. A layer with neither attention nor MLP (#35's layer 0) is not present: the forward skips it,
it has no x0 mix, and a skip from it (its weight kept, at its index) is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

from speedrun.config.gpt2026 import Gpt2026Config


@dataclass(frozen=True)
class LayerSpec:
    """What layer `index` has and where it reads and writes."""

    index: int
    attention: bool
    mlp: bool
    window: str = "L"  # "L" long or "S" short (varlen windows, tensor window of #26)
    value_embed: int | None = None  # the value-embedding table mixed into v (#45/#63 layouts)
    key_offset: bool = False  # #49
    paired: bool = False  # #58
    xsa: bool = False  # #82
    narrow_qk: bool = False  # #92: Q/K heads at half width (the rotating half), own rotary and scale
    narrow_v: bool = False  # #92: V and O heads at half width too
    skip_from: int | None = None  # the layer whose output this layer's input receives (#45 / U-Net)
    skip_weight: int | None = None  # that skip's weight index
    keep_output: bool = False  # a later skip, the backout (#40) or an attention input (#77) reads its output
    attn_input: int | None = None  # #77: the earlier layer whose output this layer's attention reads
    mudd: bool = False  # #81: the last layer, whose input MUDD recombines (and whose lambdas it gives)
    post_gate: bool = False  # #85: the MUDD gate network's post MLP reads this layer's input
    skip_form: str = "weight"  # how its skip weight scales (#32: sigmoid), model.stream.skip_gate_form
    x0_site: bool = False  # #85/#92: x0 is added to its stream through its gate lane
    bigram_site: bool = False  # #85/#92: the bigram input likewise
    parallel_mlp: bool = False  # #92: a second MLP beside its own

    @property
    def present(self) -> bool:
        """It has attention or an MLP, or (#92's layer 7) is an injection site that rests."""
        return self.attention or self.mlp or self.x0_site or self.bigram_site

    @property
    def rests(self) -> bool:
        """#92: present with neither attention nor MLP: only its resid lambdas and injections act."""
        return self.present and not (self.attention or self.mlp)


def injection_sites(cfg: Gpt2026Config) -> tuple[list[int], list[int]]:
    """(x0 sites, bigram sites) under #85's gate network: model.stream's lists, else every attention layer
    but the last for both (#85); none without the gate network."""
    if not cfg.mudd.gate_layer:
        return [], []
    if cfg.stream.x0_layers or cfg.stream.bigram_layers:
        return sorted(cfg.stream.x0_layers), sorted(cfg.stream.bigram_layers)
    inject = [i for i in sorted(cfg.attention_layers) if i != cfg.n_layer - 1]
    return inject, inject


def build_specs(cfg: Gpt2026Config) -> list[LayerSpec]:
    """One LayerSpec per layer from the config's lists (config checks guarantee their lengths/ranges)."""
    L = cfg.n_layer
    attn, mlp = set(cfg.attention_layers), set(cfg.mlp_layers)
    x0_sites, bigram_sites = map(set, injection_sites(cfg))
    present = [i in attn or i in mlp or i in x0_sites | bigram_sites for i in range(L)]
    skip_from: dict[int, tuple[int, int]] = {}
    for j, (src, dst) in enumerate(cfg.skips):
        if present[src]:
            skip_from[dst] = (src, j)
    kept = {src for src, _ in skip_from.values()} | (
        {cfg.stream.backout_layer} if cfg.stream.backout_layer else set()
    )
    attn_inputs = cfg.attn_inputs or [-1] * L
    kept |= {j for i, j in enumerate(attn_inputs) if j >= 0 and i in attn}
    kept |= set(cfg.mudd.sources)  # #81
    windows = cfg.windows or ["L"] * L
    value_embeds = cfg.value_embeds or [-1] * L
    return [
        LayerSpec(
            index=i,
            attention=i in attn,
            mlp=i in mlp,
            window=windows[i],
            value_embed=value_embeds[i] if value_embeds[i] >= 0 else None,
            key_offset=i in cfg.attn.key_offset_layers,
            paired=i in cfg.attn.paired_layers,
            xsa=i in cfg.attn.xsa_layers,
            narrow_qk=i in cfg.attn.narrow_layers,
            narrow_v=i in cfg.attn.narrow_v_layers,
            skip_from=skip_from.get(i, (None, None))[0],
            skip_weight=skip_from.get(i, (None, None))[1],
            keep_output=i in kept,
            attn_input=attn_inputs[i] if attn_inputs[i] >= 0 and i in attn else None,
            mudd=bool(cfg.mudd.sources) and i == L - 1,
            post_gate=cfg.mudd.gate_layer > 0 and i == cfg.mudd.gate_layer,
            skip_form=cfg.stream.skip_gate_form,
            x0_site=i in x0_sites,
            bigram_site=i in bigram_sites,
            parallel_mlp=i in cfg.mlp.parallel_layers,
        )
        for i in range(L)
    ]
