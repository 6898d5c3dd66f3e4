"""Step 3 of issue 26 (`xsa-2026-04`), part by part against the records' own lines on identical tiny
weights: #77's cached layer-7 input for the attention of layers 8–10 (fp32 loss and every gradient
against the record's loop), and #82's gated XSA (its formula, and #86's rewrite equal to it)."""

from __future__ import annotations

import re

import pytest
import torch

from speedrun.errors import ConfigError
from speedrun.model.contexts import Masked
from speedrun.model.families import build_model
from speedrun.recipes import load_recipe
from tests.decoding import assert_cached_decoding_is_the_forward
from tests.fidelity.checks import jitter_, short_documents
from tests.recipe_matrix import replace

BASE = "stages-2025-12"


def _small(L=5, vocab=100, T=64, **model):
    cfg = load_recipe(BASE, [])
    cfg.model = replace(
        cfg.model, n_layer=L, n_head=2, n_embd=64, vocab_size=vocab, max_seq_len=T, embed_dtype="fp32",
        fp8_head=False, eot_id=vocab - 1, windows=["S", "L", "S", "S", "L"][:L],
        attention_layers=list(range(L)), mlp_layers=list(range(L)), value_embeds=[0, -1, -1, -1, 0][:L],
        skips=[], key_offset_layers=[], paired_layers=[], backout_layer=2, bigram_rows=0, smear=0,
        skip_gate=0, mtp=0, attention="sdpa", window=T, **model,
    )  # fmt: skip
    torch.manual_seed(0)
    m = build_model(cfg.model)
    jitter_(m, 0.05)  # zero-initialized projections, gates, head: give them values
    return m


_batch = short_documents


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
        x = x + b.attn(b.norm1(attn_in), Masked(masks[i]), ve)[0]
        x = x + b.mlp(b.norm2(x))
        if i == model.cfg.stream.backout_layer:
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
    ours = _loss_and_grads(model, lambda m, i: m.hidden(i, m.layer_contexts(i)), idx, tgt)
    ref = _loss_and_grads(model, record_77_hidden, idx, tgt)
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=0)
    assert ours[1].keys() == ref[1].keys()
    for n in ref[1]:
        torch.testing.assert_close(ours[1][n], ref[1][n], rtol=0, atol=0, msg=n)
    plain = _small()  # without #77: the attention reads the stream, and the loss differs
    assert not torch.equal(
        _loss_and_grads(plain, lambda m, i: m.hidden(i, m.layer_contexts(i)), idx, tgt)[0], ref[0]
    )


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["model.attn_inputs=[9,-1]"], "model.attn_inputs [9, -1] (#77): one entry per layer (11)"),
        (["model.attn_inputs=[-1,-1,-1,-1,-1,-1,-1,-1,8,7,7]"], "an earlier present layer"),  # itself
        (["model.attn_inputs=[-1,-1,-1,-1,-1,-1,3,-1,7,7,7]"], "(on an attention layer)"),  # 6 has none
        (["model.attn_inputs=[-2,-1,-1,-1,-1,-1,-1,-1,7,7,7]"], "model.attn_inputs must be >= -1"),
        (
            ["model.xsa_layers=6"],
            "model.attn.xsa_layers [6] (#82) must be attention layers without paired heads",
        ),
        (["model.xsa_layers=11"], "model.attn.xsa_layers [11]: distinct layers 0..10"),
    ],
)
def test_a_bad_part_is_one_config_error_naming_it(overrides, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_recipe(BASE, overrides)


def test_the_parts_dry_run_on_the_full_recipe():
    """The record's layouts on #53's model: #82's α adds one scalar per head on six layers."""
    from speedrun.model.labels import labelled

    base = build_model(load_recipe(BASE, []).model)
    cfg = load_recipe(
        BASE, ["model.xsa_layers=1,3,4,7,8,10", "model.attn_inputs=[-1,-1,-1,-1,-1,-1,-1,-1,7,7,7]"]
    )
    model = build_model(cfg.model)
    assert [s.attn_input for s in model.specs] == [None] * 8 + [7] * 3 and model.specs[7].keep_output
    extra = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in base.parameters())
    assert extra == 6 * cfg.model.n_head
    assert all(lab is not None for _, _, lab in labelled(model))


def record_82_xsa(y, v, xsa_alpha):
    """#82's lines (2026-04-29_XSAGatedLayers train_gpt.py, CausalSelfAttention.forward), on its
    (B, T, H, D) layout."""
    vn = torch.nn.functional.normalize(v, dim=-1, eps=1e-4)
    proj = (y * vn).sum(-1, keepdim=True)
    alpha = torch.tanh(xsa_alpha).type_as(y).view(1, 1, y.size(2), 1)
    return y - alpha * proj * vn


def record_86_xsa(y, v, xsa_alpha):
    """#86's rewrite (HEAD train_gpt.py 1153-1157), α per head here (#85 on feeds it per token)."""
    dot = (y * v).sum(-1, keepdim=True)
    denom = v.square().sum(-1, keepdim=True).clamp_min(1e-8)
    alpha = torch.tanh(xsa_alpha).type_as(y).view(1, 1, y.size(2), 1)
    return y - alpha * (dot / denom) * v


def _yv(scale_v=1.0):
    g = torch.Generator().manual_seed(3)
    y, v = (torch.randn(2, 7, 3, 8, generator=g, dtype=torch.float64) for _ in range(2))
    v = v * scale_v
    v[0, 2, 1] = 0.0  # a zero value vector: the eps path
    return y.requires_grad_(), v.requires_grad_()


@pytest.mark.parametrize("scale_v", [1.0, 1e-5])
def test_xsa_is_82s_lines_and_86s_rewrite_equals_them_value_and_gradients(scale_v):
    from speedrun.model.gpt2026.xsa import GatedXSA
    from tests.model_refs import xsa_rewritten as rewritten

    xsa = GatedXSA(3).double()  # fp64: the forms' rounding apart, "same math" is then tight
    with torch.no_grad():
        xsa.alpha.copy_(torch.tensor([0.7, -1.3, 0.2]))
    outs = []
    for fn in (
        lambda y, v: xsa(y.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2),
        lambda y, v: record_82_xsa(y, v, xsa.alpha),
        lambda y, v: record_86_xsa(y, v, xsa.alpha),
        lambda y, v: rewritten(y.transpose(1, 2), v.transpose(1, 2), xsa.alpha).transpose(1, 2),
    ):
        y, v = _yv(scale_v)
        xsa.zero_grad()
        out = fn(y, v)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs.append((out.detach(), y.grad, v.grad, xsa.alpha.grad.clone()))
    for other in outs[1:]:
        for a, b in zip(outs[0], other, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=0, atol=0)  # the same op order: bit for bit


def record_82_hidden(model, idx):
    """Our layers, with the attention's tail as #82 runs it: y from the attention of the mixed v, then
    `record_82_xsa` on the layers that have α, then the gate and output projection."""
    from speedrun.model.attention import attend

    masks = model.layer_masks(idx)
    x = x0 = model.embed_norm(model.wte(idx))
    tables = [emb(idx) for emb in model.value_embeds]
    outputs = {}
    for i, (s, b) in enumerate(zip(model.specs, model.blocks, strict=True)):
        x = b.lambdas[0] * x + (b.x0_lambda if b.x0_lambda is not None else b.lambdas[1]) * x0
        h, a = b.norm1(x), b.attn
        q, k, v, _ = a.project(h, tables[s.value_embed] if s.value_embed is not None else None)
        y = attend(q, a.attended_keys(k), v, masks[i], a.scale)
        if s.xsa:
            y = record_82_xsa(y.transpose(1, 2), v.transpose(1, 2), a.xsa.alpha).transpose(1, 2)
        xsa, a.xsa = a.xsa, None
        try:
            x = x + a.output(y, h)
        finally:
            a.xsa = xsa
        x = x + b.mlp(b.norm2(x))
        outputs[i] = x
    return model.norm_f(x - model.backout.lamb * outputs[model.cfg.stream.backout_layer])


def test_gated_xsa_in_the_model_is_82s_loss_and_every_gradient():
    model = _small(xsa_layers=[1, 3, 4])
    assert [s.xsa for s in model.specs] == [False, True, False, True, True]
    assert all(
        float(b.attn.xsa.alpha.detach().abs().sum()) > 0 for b in model.blocks if b.attn.xsa is not None
    )
    idx, tgt = _batch()
    ours = _loss_and_grads(model, lambda m, i: m.hidden(i, m.layer_contexts(i)), idx, tgt)
    ref = _loss_and_grads(model, record_82_hidden, idx, tgt)
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=0)
    assert ours[1].keys() == ref[1].keys()
    assert sum("xsa.alpha" in n for n in ref[1]) == 3
    for n in ref[1]:  # α's gradient sums over (B, H, T) here, (B, T, H) in the record: another order
        tol = {"rtol": 1e-5, "atol": 1e-8} if "xsa.alpha" in n else {"rtol": 0, "atol": 0}
        torch.testing.assert_close(ours[1][n], ref[1][n], **tol, msg=n)


def test_gated_xsa_starts_as_a_no_op_and_decodes_as_the_forward():

    model = _small(xsa_layers=[1, 3])
    idx, _ = _batch()
    model.eval()
    with torch.no_grad():
        assert_cached_decoding_is_the_forward(model, idx, 40)
        for b in model.blocks:
            if b.attn.xsa is not None:
                b.attn.xsa.alpha.zero_()
        plain = _small().eval()
        missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
        assert not missing and all("xsa.alpha" in n for n in unexpected)
        torch.testing.assert_close(model(idx), plain(idx), rtol=0, atol=0)  # zero α: no XSA


def test_xsa_on_a_paired_layer_is_one_config_error():
    from speedrun.config.gpt2026 import check

    cfg = load_recipe(BASE, [])
    with pytest.raises(ConfigError, match="xsa_layers"):
        m = cfg.model
        layer = min(set(m.attention_layers) - set(m.attn.key_offset_layers))
        check(replace(m, paired_layers=[layer], xsa_layers=[layer]))
    check(replace(m, paired_layers=[layer], xsa_layers=[]))  # the same model without XSA is fine


def test_both_parts_under_varlen_attention_equal_the_masked_attention_loss_and_gradients():
    """The records' packed (cu_seqlens) path carries #77's input and #82's values as the dense path does."""
    from speedrun.train.evaluate import row_cu_seqlens

    dense = _small(xsa_layers=[1, 3, 4], attn_inputs=[-1, -1, -1, 2, 2])
    varlen = build_model(replace(dense.cfg, attention="varlen"))
    varlen.load_state_dict(dense.state_dict())
    idx, tgt = _batch()
    cu = row_cu_seqlens(idx, type("Cfg", (), {"model": varlen.cfg})())
    losses, grads = [], []
    for model, args in ((dense, ()), (varlen, (cu,))):
        model.zero_grad()
        loss = model(idx, tgt, *args)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    assert grads[0].keys() == grads[1].keys()
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-4, atol=1e-6, msg=n)
