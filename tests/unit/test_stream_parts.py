"""The residual stream's connections as parts (model/gpt2026/stream_parts.py): a model lists only the
parts it reads, in the order they act; #92's injection sites, resting layer and named post-loop sources
are config, not branches; the gate network's lanes follow each record's layout."""

from __future__ import annotations

import pytest
import torch

from speedrun.errors import ConfigError
from speedrun.model.families import build_model
from speedrun.model.gpt2026.mudd import gate_layouts
from speedrun.model.gpt2026.specs import injection_sites
from speedrun.recipes import load_recipe


def _parts(recipe: str, *over: str) -> tuple[str, ...]:
    with torch.device("meta"):
        model = build_model(load_recipe(recipe, list(over)).model)
    return tuple(p.name for p in model.connections)


def test_each_model_lists_the_parts_it_reads_and_no_other():
    assert _parts("bos-align-2025-07") == ("skip", "values")  # #26: U-Net skips and value tables
    assert _parts("record-2026-07") == ("skip", "values", "bigram", "attn_input", "mudd")  # #89
    assert _parts("qk96-2026-08") == ("gates", "skip", "values", "bigram", "attn_input", "mudd")  # + #85
    assert _parts("anvil-2026-08") == ("gates", "skip", "values", "bigram", "attn_input", "mudd")


def test_the_85_lanes_pair_x0_and_bigram_per_layer_and_92_groups_them_by_kind():
    """#85 (HEAD through #91): (x0, bigram) per attention layer but the last; #92's init_mudd_gate:
    pre xsa[1, 3], attn[3], x0[0, 1, 2], bigram[0, 1] (23 lanes); post attn[10], x0[4, 5, 7],
    bigram[4, 5, 9], skip (13)."""
    pre, post = gate_layouts(load_recipe("qk96-2026-08").model)
    inject = [(k, i) for k, i, _ in pre if k in ("x0", "bigram")]
    assert inject == [("x0", 0), ("bigram", 0), ("x0", 1), ("bigram", 1), ("x0", 2), ("bigram", 2),
                      ("x0", 3), ("bigram", 3)]  # fmt: skip
    pre, post = gate_layouts(load_recipe("anvil-2026-08").model)
    lanes = lambda cols: [(k, i, w) for k, i, w in cols]  # noqa: E731
    assert lanes(pre) == [("xsa", 1, 6), ("xsa", 3, 6), ("attn", 3, 6), ("x0", 0, 1), ("x0", 1, 1),
                          ("x0", 2, 1), ("bigram", 0, 1), ("bigram", 1, 1)]  # fmt: skip
    assert lanes(post) == [("attn", 10, 6), ("x0", 4, 1), ("x0", 5, 1), ("x0", 7, 1), ("bigram", 4, 1),
                           ("bigram", 5, 1), ("bigram", 9, 1), ("skip", -1, 1)]  # fmt: skip


def test_the_sites_default_to_85s_and_make_a_resting_layer_present():
    m = load_recipe("qk96-2026-08").model
    assert injection_sites(m) == ([0, 1, 2, 3, 4, 5, 7, 8, 9], [0, 1, 2, 3, 4, 5, 7, 8, 9])
    assert injection_sites(load_recipe("record-2026-07").model) == ([], [])  # no gate network: no lanes
    with torch.device("meta"):
        model = build_model(load_recipe("anvil-2026-08").model)
    assert [s.index for s in model.walk] == list(range(11))  # layer 7 rests: present
    assert [s.index for s in model.specs if s.rests] == [7]
    assert model.blocks[7].post_lambdas is None and model.blocks[7].lambdas.shape == (2,)


@pytest.mark.parametrize(
    ("over", "says"),
    [
        (["model.stream.x0_layers=[0,1,2,4,5,7,10]"], "layers 0..9"),
        (["model.mudd.final_sources=c0,ve9"], "veN"),
        (["model.mudd.mix_groups=5"], "divide model.n_embd"),
        (["model.mlp.parallel_layers=[7]"], "among model.mlp_layers"),
    ],
)
def test_92s_keys_refuse_what_the_model_cannot_build(over, says):
    with pytest.raises(ConfigError, match=says):
        load_recipe("anvil-2026-08", over)
