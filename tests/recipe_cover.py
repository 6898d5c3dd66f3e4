"""A few bundled recipes that together use every model setting any bundled recipe uses.

A per-recipe test whose cost is one model graph (a fullgraph compile, a cached decode) proves no more on
a recipe whose every setting another chosen recipe already exercises. `recipe_cover` picks, by a greedy
set cover over (setting, value) pairs, a small set of recipes in which every value of every setting any
recipe uses appears at least once. Values are compared, not recipe names, so a new recipe (or a new
switch value in an old one) is picked up without editing a list. tests/unit/test_recipe_cover.py proves the
cover, and that each chosen recipe is needed.

What decides the graph, read from the code: the model is `GPT(cfg.model)`, so every model field counts;
the training step adds autocast (`train.dtype`) and the stage plan (`train.stages`: windows, YaRN). The
attention layout fields act together (the mask composes documents, window, granularity and pattern;
which layers attend and where value embeddings enter follow the layer pattern), so their combination
counts as one value: every distinct layout is covered, not just each field's values one by one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from speedrun.config import Config
from speedrun.recipes import recipe_names

Setting = tuple[str, str]  # (setting name, repr of its value)

#: Model fields whose values act together: one joint value per distinct combination.
LAYOUT_FIELDS = (
    "attention",
    "document_mask",
    "window",
    "window_granularity",
    "window_pattern",
    "window_block_list",
    "no_attention_layers",
    "value_embeds",
    "value_embed_tables",
    "windows",  # the gpt2026 family's per-layer lists
    "attention_layers",
    "mlp_layers",
)
#: Train fields that change what the step computes around the model.
GRAPH_TRAIN_FIELDS = ("dtype", "stages")


def graph_settings(cfg: Config) -> set[Setting]:
    """The (setting, value) pairs of a config that decide its model graph (see the module docstring)."""
    model = dataclasses.asdict(cfg.model)
    out = {(f"model.{k}", repr(v)) for k, v in model.items() if k not in LAYOUT_FIELDS}
    out.add(("model.layout", repr(tuple(model.get(k) for k in LAYOUT_FIELDS))))  # a family has some
    out |= {(f"train.{k}", repr(getattr(cfg.train, k))) for k in GRAPH_TRAIN_FIELDS}
    return out


def cover(settings: dict[str, set[Setting]]) -> list[str]:
    """Names whose settings together hold every pair any name holds: greedy (most new pairs first, ties
    to the earlier name), then pruned of any name the others make redundant. In `settings`' order."""
    needed = set().union(*settings.values())
    chosen: list[str] = []
    while needed:
        best = max(settings, key=lambda name: len(settings[name] & needed))  # first of the ties
        chosen.append(best)
        needed -= settings[best]
    for name in reversed(list(chosen)):
        others = [settings[n] for n in chosen if n != name]
        if settings[name] <= set().union(*others):
            chosen.remove(name)
    return [name for name in settings if name in chosen]


def recipe_cover(configure: Callable[[str], Config]) -> list[str]:
    """The cover of the bundled recipes, each as `configure(name)` builds it for the test at hand."""
    return cover({name: graph_settings(configure(name)) for name in recipe_names()})
