"""#46's CGI gain init (model.cgi_gain_alpha, model/gpt2024/cgi.py) against the record's
`headmean_antithetic_pair`
and its init loop (records/track_3_optimization/results/20260619_cwd_rowfloor_tailema/
train_gpt_cwd_SOTA.py), written here from its code: the same signs for the same seed and RNG state, and
the gains 1 ∓ α·s that a built model holds."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from speedrun.model.families import build_model
from speedrun.model.gpt2024.cgi import cgi_signs
from speedrun.recipes import load_recipe

ALPHA, PAIR_FROM, SHRINK = 0.125, 6, 0.50


def record_pair(shape, layer_idx, seed, head_dim):
    """#46's headmean_antithetic_pair (on the CPU)."""
    width = shape[-1]
    if width % head_dim != 0:
        s0 = torch.randint(0, 2, shape, dtype=torch.float32) * 2 - 1
        return s0, -s0
    gen = torch.Generator()
    gen.manual_seed(0xA9170000 + seed * 1009 + layer_idx * 9176)
    heads0, heads1 = [], []
    for _ in range(width // head_dim):
        h0 = (torch.randint(0, 2, (head_dim,), generator=gen, dtype=torch.int64) * 2 - 1).float()
        plus0 = int((h0 > 0).sum().item())
        plus0 = int(round(head_dim / 2 + SHRINK * (plus0 - head_dim / 2)))
        plus0 = max(0, min(head_dim, plus0))
        h0 = torch.cat([torch.ones(plus0), -torch.ones(head_dim - plus0)])
        h0 = h0[torch.randperm(head_dim, generator=gen)]
        plus1 = head_dim - plus0
        h1 = torch.cat([torch.ones(plus1), -torch.ones(head_dim - plus1)])
        h1 = h1[torch.randperm(head_dim, generator=gen)]
        heads0.append(h0)
        heads1.append(h1)
    return torch.cat(heads0).reshape(shape), torch.cat(heads1).reshape(shape)


def record_signs(n_layer, width, head_dim, seed):
    """#46's loop over the blocks (the signs it writes into norm1/norm2 as 1 ∓ α·s)."""
    out, pair_next = [], None
    for l_idx in range(n_layer):
        if l_idx >= PAIR_FROM and (l_idx - PAIR_FROM) % 2 == 1:
            s, pair_next = pair_next, None
        elif l_idx >= PAIR_FROM:
            s, pair_next = record_pair((width,), l_idx, seed, head_dim)
        else:
            s = torch.randint(0, 2, (width,), dtype=torch.float32) * 2 - 1
        out.append(s)
    return out


@pytest.mark.parametrize("seed", [0, 3])
def test_the_signs_are_the_records(seed):
    torch.manual_seed(11)
    ours = cgi_signs(12, 768, 128, seed)
    torch.manual_seed(11)
    ref = record_signs(12, 768, 128, seed)
    for layer, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert torch.equal(a, b), layer
    # antithetic and head-balanced from layer 6: each head's +1 count pulled halfway to 64, the pair's
    # counts adding to 128
    for first, second in ((ours[6], ours[7]), (ours[8], ours[9]), (ours[10], ours[11])):
        plus = first.view(6, 128).gt(0).sum(1)
        assert torch.equal(plus + second.view(6, 128).gt(0).sum(1), torch.full((6,), 128))
        assert (plus - 64).abs().max() <= 8  # a Binomial(128, ½) deviation, halved


def test_a_built_model_holds_one_minus_and_one_plus_alpha_s():
    cfg = load_recipe("track3-2026-06")
    m = dataclasses.replace(cfg.model, cgi_gain_alpha=ALPHA, vocab_size=64)
    torch.manual_seed(5)
    model = build_model(m)
    torch.manual_seed(5)
    reference = build_model(dataclasses.replace(m, cgi_gain_alpha=0.0))  # the same draws before the CGI
    signs = [(1.0 - b.norm1.gains) / ALPHA for b in model.blocks]
    for block, s in zip(model.blocks, signs, strict=True):
        assert set(s.round().tolist()) <= {-1.0, 1.0}
        torch.testing.assert_close(block.norm2.gains, 1.0 + ALPHA * s.round())
    assert not torch.equal(signs[6], signs[7])  # a pair: opposite counts per head, shuffled apart
    torch.manual_seed(5)  # the model's CGI draws come after the other weights' (layers 0-5: torch's RNG)
    build_model(dataclasses.replace(m, cgi_gain_alpha=0.0))
    want = cgi_signs(12, 768, 128, 5)
    for layer, (s, w) in enumerate(zip(signs, want, strict=True)):
        assert torch.equal(s.round(), w), layer
    # the other weights are untouched by the switch
    for (n, a), b in zip(model.named_parameters(), reference.parameters(), strict=True):
        if "norm1.gains" not in n and "norm2.gains" not in n:
            assert torch.equal(a, b), n
