"""Step 3 of issue 26 (`xsa-2026-04`), part by part against the records' own lines on identical tiny
weights: #77's cached layer-7 input for the attention of layers 8–10 (fp32 loss and every gradient
against the record's loop), and #82's gated XSA (its formula, and #86's rewrite equal to it)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from speedrun.errors import ConfigError
from speedrun.model.families import build_model
from speedrun.recipes import load_recipe

BASE = "stages-2025-12"


def _small(L=5, vocab=100, T=64, **model):
    cfg = load_recipe(BASE, [])
    cfg.model = dataclasses.replace(
        cfg.model, n_layer=L, n_head=2, n_embd=64, vocab_size=vocab, max_seq_len=T, embed_dtype="fp32",
        fp8_head=False, eot_id=vocab - 1, windows=["S", "L", "S", "S", "L"][:L], attention_layers=list(range(L)),
        mlp_layers=list(range(L)), value_embeds=[0, -1, -1, -1, 0][:L], skips=[], key_offset_layers=[],
        paired_layers=[], backout_layer=2, bigram_rows=0, smear=0, skip_gate=0, mtp=0, attention="sdpa",
        window=T, **model,
    )  # fmt: skip
    torch.manual_seed(0)
    m = build_model(cfg.model)
    with torch.no_grad():  # zero-initialized projections, gates, head: give them values
        for p in m.parameters():
            p.add_(torch.randn_like(p) * (0.05 if p.ndim > 1 else 0.3))
    return m


def _batch(vocab=100, T=64):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, vocab - 1, (1, T), generator=g)
    idx[0, [0, 20, 41]] = vocab - 1  # documents
    return idx, torch.randint(0, vocab - 1, (1, T), generator=g)


def record_77_hidden(model, idx):
    """#77's layer loop (2026-03-06_SimplifyHC train_gpt.py, GPT.forward): `attn_in = x_backout if
    x_backout is not None else x`, x_backout the stream after layer 7 (here the backout layer), and
    `x -= backout_lambda * x_backout` at the end. Our blocks' own sublayers (x0 mix, attention, MLP)."""
    masks = model.layer_masks(idx)
    x = x0 = model.embed_norm(model.wte(idx))
    tables = [emb(idx) for emb in model.value_embeds]
    x_backout = None
    for i, (s, b) in enumerate(zip(model.specs, model.blocks, strict=True)):
        x = b.lambdas[0] * x + (b.x0_lambda if b.x0_lambda is not None else b.lambdas[1]) * x0
        attn_in = x_backout if x_backout is not None else x
        ve = tables[s.value_embed] if s.value_embed is not None else None
        x = x + b.attn(b.norm1(attn_in), masks[i], ve)[0]
        x = x + b.mlp(b.norm2(x))
        if i == model.cfg.backout_layer:
            x_backout = x
    return model.norm_f(x - model.backout.lamb * x_backout)


def _loss_and_grads(model, hidden_fn, idx, tgt):
    model.zero_grad()
    logits = model.logits(hidden_fn(model, idx))
    loss = torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), tgt.view(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_cached_layer_input_is_the_records_loop_loss_and_every_gradient():
    model = _small(attn_inputs=[-1, -1, -1, 2, 2])
    assert [s.attn_input for s in model.specs] == [None, None, None, 2, 2]
    idx, tgt = _batch()
    ours = _loss_and_grads(model, lambda m, i: m.hidden(i, m.layer_masks(i)), idx, tgt)
    ref = _loss_and_grads(model, record_77_hidden, idx, tgt)
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=0)
    assert ours[1].keys() == ref[1].keys()
    for n in ref[1]:
        torch.testing.assert_close(ours[1][n], ref[1][n], rtol=0, atol=0, msg=n)
    plain = _small()  # without #77: the attention reads the stream, and the loss differs
    assert not torch.equal(_loss_and_grads(plain, lambda m, i: m.hidden(i, m.layer_masks(i)), idx, tgt)[0], ref[0])


@pytest.mark.parametrize("inputs", [[-1, -1, -1, 2], [-1, 1, -1, -1, -1], [-1, -1, -1, 7, -1]])
def test_bad_attn_inputs_are_one_config_error(inputs):
    from speedrun.config_model import check

    cfg = load_recipe(BASE, [])
    with pytest.raises(ConfigError, match="attn_inputs"):
        check(dataclasses.replace(cfg.model, n_layer=5, attention_layers=[1, 2, 3, 4], mlp_layers=[1, 2, 3, 4],
                                  windows=[], value_embeds=[], skips=[], key_offset_layers=[], paired_layers=[],
                                  backout_layer=2, value_embed_zero_init=False, attn_inputs=inputs))  # fmt: skip
