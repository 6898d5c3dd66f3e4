"""#81's MUDD (dynamic dense connections from two earlier layers), #85's gate network and DC correction
(`[model.mudd]`), with the optimizer rows of their parameters. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from speedrun.errors import ConfigError

#: #81: MUDD's MLPs train at this share of the Adam LR (`embed_lr`, the records' 0.008), betas (0.9, 0.99)
LR_MUL = 0.25
#: #85: the gate network's MLPs at this share
GATE_LR_MUL = 0.1


@dataclass(frozen=True)
class MuddConfig:
    sources: list[int] = field(default_factory=list)  # #81: [h, s] (record [7, 3]); empty: no MUDD
    gate_layer: int = 0  # #85: the gate network's post MLP reads this layer's input (record 4); 0 none
    gate_attn_layers: list[int] = field(default_factory=list)  # #85: its attention gates ([3, 10])
    dc_layers: list[int] = field(default_factory=list)  # #85: DC correction, weights from the gate ([10])
    # what the post-loop mix adds to the last layer's output, by name (model/gpt2026/mudd.py FINAL_SOURCES);
    # empty: #81's five, c0, h, last, ve0, s
    final_sources: list[str] = field(default_factory=list)
    # #92: the post-loop mix per channel group: each coefficient plus a per-group delta (12 groups); 0 none
    mix_groups: int = 0

    FLAT: ClassVar[dict[str, str | None]] = {
        "sources": "mudd_sources",
        "gate_layer": "mudd_gate_layer",
        "gate_attn_layers": "mudd_gate_attn_layers",
        "final_sources": None,
        "mix_groups": None,
    }


#: the post-loop mix's sources by name: the stream entering layer 0, the outputs of the layers `sources`
#: names (h, s), the last layer's input, a value-embedding table N (veN), and the last layer's normed MLP
#: and attention inputs (#92)
SOURCE_NAMES = ("c0", "h", "s", "last", "mlp_in", "attn_in")
#: the most coefficients the last layer's MLP has rows for (#81's 14)
MAX_FINAL = 14


def label_rows(adam: Any, embed_lr: float, wd: float) -> dict[str, Any]:
    """The rows of MUDD's labels (#81's and #85's param_table): `adam(group, lr, betas, wd)` makes one."""
    betas = (0.9, 0.99)
    return {
        "mudd": adam("mudd", embed_lr * LR_MUL, betas, wd),
        "mudd_bias": adam("mudd_bias", embed_lr * LR_MUL, betas, 0.0),
        "mudd_gate": adam("mudd_gate", embed_lr * GATE_LR_MUL, betas, wd),
        "mudd_gate_bias": adam("mudd_gate_bias", embed_lr * GATE_LR_MUL, betas, 0.0),
    }


def final_names(p: MuddConfig) -> list[str]:
    """The post-loop mix's sources, by name (#81's five unless model.mudd.final_sources names them)."""
    return list(p.final_sources) or ["c0", "h", "last", "ve0", "s"]


def check(p: MuddConfig, m: Any) -> None:
    if p.sources:
        _check_mudd(p, m)
    if (p.final_sources or p.mix_groups) and not p.sources:
        raise ConfigError("model.mudd.final_sources / mix_groups (#92) need model.mudd.sources (#81's MUDD)")
    tables = {j for j in m.value_embeds if j >= 0}
    for name in p.final_sources:
        if name not in SOURCE_NAMES and not (
            name[:2] == "ve" and name[2:].isdigit() and int(name[2:]) in tables
        ):
            raise ConfigError(
                f"model.mudd.final_sources: {name!r} is none of {', '.join(SOURCE_NAMES)} or veN (a table)"
            )
    if len(p.final_sources) > MAX_FINAL or p.mix_groups < 0 or p.mix_groups and m.n_embd % p.mix_groups:
        raise ConfigError(
            f"model.mudd.final_sources: at most {MAX_FINAL}; model.mudd.mix_groups must divide model.n_embd"
        )
    if p.gate_layer or p.gate_attn_layers or p.dc_layers:
        _check_gate(p, m)


def _check_mudd(p: MuddConfig, m: Any) -> None:
    """#81's MUDD reads the composition the record gives it: one line naming what is missing."""
    L, last = m.n_layer, m.n_layer - 1
    present = set(m.attention_layers) | set(m.mlp_layers) | set(m.stream.x0_layers)  # #92: a resting site
    h, s = (p.sources + [-1, -1])[:2]
    tables = m.value_embeds or [-1] * L
    needs = (
        (len(p.sources) == 2 and h != s and {h, s} <= present and max(h, s) < L - 2,
         f"[h, s]: two distinct present layers below {L - 2} (record [7, 3]), got {p.sources}"),
        (m.stream.residual_form == "sublayer", "model.stream.residual_form='sublayer' (#77's residual form)"),
        (last in m.attention_layers and last in m.mlp_layers and last - 1 in present
         and last not in m.attn.paired_layers,
         "an unpaired attention and an MLP on the last layer, one before"),
        (tables[last] >= 0 and 0 in tables, "a value embedding on the last layer, and table 0"),
        (m.values.mix == "weights", "model.values.mix='weights' (v + the mix, #47/#48)"),
        (m.n_head % 2 == 0, "an even model.n_head (its value-embedding gate has one lane per half)"),
        (not m.stream.backout_layer, "model.stream.backout_layer=0 (#81 folds the backout into a MUDD bias)"),
    )  # fmt: skip
    for ok, what in needs:
        if not ok:
            raise ConfigError(f"model.mudd.sources (#81) needs {what}")


def _check_gate(p: MuddConfig, m: Any) -> None:
    """#85's gate network replaces the static gates it generates: one line naming what is missing."""
    g, L, st = p.gate_layer, m.n_layer, m.stream
    present = set(m.attention_layers) | set(m.mlp_layers) | set(st.x0_layers) | set(st.bigram_layers)
    attn = p.gate_attn_layers
    needs = (
        (bool(p.sources), "model.mudd.sources (#81's MUDD, whose MLP shape it shares)"),
        (0 < g < L - 1 and g in present, f"model.mudd.gate_layer: a present layer 1..{L - 2} (4), got {g}"),
        (set(attn) <= set(m.attention_layers) and len(set(attn)) == len(attn),
         f"model.mudd.gate_attn_layers {attn}: distinct attention layers"),
        (m.attn.gate == 0, "model.attn.gate=0 (it gives the attention gates, #28's are gone)"),
        (st.skip_gate == 0 and len(m.skips) <= 1 and all(dst >= g for _, dst in m.skips)
         and (not m.skips or st.skip_gate_form == "sigmoid"),
         "model.stream.skip_gate=0, at most one skip, into a layer >= mudd.gate_layer, a sigmoid "
         "stream.skip_gate_form"),
        (set(p.dc_layers) <= set(m.attention_layers) - set(m.attn.paired_layers)
         and min(p.dc_layers, default=g) >= g and len(set(p.dc_layers)) == len(p.dc_layers),
         f"model.mudd.dc_layers {p.dc_layers}: distinct unpaired attention layers >= model.mudd.gate_layer"),
    )  # fmt: skip
    for ok, what in needs:
        if not ok:
            raise ConfigError(f"model.mudd.gate_layer (#85) needs {what}")
