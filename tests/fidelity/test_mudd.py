"""#81's MUDD connections (model/gpt2026/mudd.py) and #77's per-sublayer residual form they act in, against
the record's own lines transcribed here (train_gpt.py of modded-nanogpt 8ee5feda, the repository after #82
merged; unchanged through #89: `init_mudd`, `forward_mudd` and `GPT.forward`'s loop), on identical tiny
weights: fp32 loss and every gradient, the init, and that a wrong source is caught."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from speedrun.errors import ConfigError
from speedrun.model.contexts import Masked
from speedrun.model.families import build_model
from speedrun.model.gpt2026 import connections
from speedrun.recipes import load_recipe
from tests.decoding import assert_cached_decoding_is_the_forward
from tests.fidelity.checks import jitter_, short_documents
from tests.recipe_matrix import replace

BASE = "banks-2026-01"
L, H_SRC, S_SRC = 6, 3, 1  # the record's 11 layers, sources [7, 3], shrunk: layer 2 is its layer 6


def _cfg(mudd=True, **model):
    """Shrunk like the record: no attention on layer 2 (the record's 6), the skip 1 → 2 (its 3 → 6), the
    last two layers attending to layer 3's output (its 7 for 8–10), value embeddings on 1, 4, 5."""
    cfg = load_recipe(BASE, [])
    fields = dict(
        n_layer=L, n_head=2, n_embd=64, vocab_size=100, max_seq_len=64, embed_dtype="fp32", fp8_head=False,
        block_dtype="fp32",
        eot_id=99, windows=["S", "S", "S", "L", "S", "L"], attention_layers=[0, 1, 3, 4, 5],
        mlp_layers=list(range(L)), value_embeds=[-1, 0, -1, -1, 1, 2], skips=[[S_SRC, 2]],
        key_offset_layers=[3, 5], paired_layers=[0], bigram_rows=64, attention="sdpa", window=64, mtp=0,
        attn_inputs=[-1, -1, -1, -1, H_SRC, H_SRC], backout_layer=0, residual_form="sublayer",
        x0_lambda_apart=False,
        mudd_sources=[H_SRC, S_SRC] if mudd else [],
    )  # fmt: skip
    return replace(cfg.model, **(fields | model))


def _model(mudd=True, seed=0, **model):
    torch.manual_seed(seed)
    m = build_model(_cfg(mudd, **model))
    jitter_(m, 0.05)  # zero-initialized W2, projections, gates, head: give them values
    return m


_batch = short_documents


# --- the record, transcribed ------------------------------------------------------------------------------


def record_init_mudd(dim: int):
    """`GPT.init_mudd` (2 MLPs, width 64, 14 coefficients, `_mudd_scale` 0.1): (w1, w2, b2)."""
    scale = 0.1
    w1 = torch.empty(2, 64, dim)
    for j in range(2):
        torch.nn.init.kaiming_uniform_(w1[j], a=math.sqrt(5))
    w2 = torch.zeros(2, 14, 64)
    bs = torch.zeros(2, 14)
    bs[0, 6] = 2.0 / scale
    bs[0, 7] = 2.0 / scale
    bs[0, 8] = 1.1**0.5 / scale
    bs[0, 9] = 1.0 / scale
    bs[0, 10] = 0.0
    bs[0, 11] = 0.05 / scale
    bs[0, 12] = 1.1**0.5 / scale
    bs[0, 13] = 1.0 / scale
    bs[1, 1] = -0.5 / scale
    return w1, w2, bs


def record_forward_mudd(mudd, x, id, num_coef):
    """`GPT.forward_mudd`."""
    x = F.gelu(F.linear(x, mudd.w1[id]))
    x = (F.linear(x, mudd.w2[id, :num_coef]) + mudd.b2[id, :num_coef]) * 0.1
    return x.split(1, dim=-1)


def record_attention_82(b, h, mask, other_v):
    """Our attention, with #82's XSA lines (test_xsa_parts.record_82_xsa) on the layers that have α."""
    from speedrun.model.attention import attend
    from tests.fidelity.test_xsa_parts import record_82_xsa

    a = b.attn
    if a.xsa is None:
        return a(h, Masked(mask), other_v)[0]
    q, k, v, _ = a.project(h, other_v)
    y = attend(q, a.attended_keys(k), v, mask, a.scale)
    y = record_82_xsa(y.transpose(1, 2), v.transpose(1, 2), a.xsa.alpha).transpose(1, 2)
    xsa, a.xsa = a.xsa, None
    try:
        return a.output(y, h)
    finally:
        a.xsa = xsa


def record_hidden(model, idx, h_src=H_SRC, s_src=S_SRC, attn_src=H_SRC, skip_src=S_SRC):
    """`GPT.forward`'s loop up to the final norm, with our layers' parts (attention, MLP, norms, smear,
    bigram rows, skip gate) and their lambdas; what it composes is the record's: the first bigram share
    into the stream, `cache[0]`, x0/bigram injected after the attention, per-sublayer lambdas, layer 6's
    skip, the cached layer-7 attention input, and the MUDD lines (layer 10 and post-loop)."""
    cfg, blocks, n = model.cfg, model.blocks, model.cfg.n_layer
    masks = model.layer_masks(idx)
    x = model.smear(model.wte(idx))
    x = x0 = model.embed_norm(x)
    x0_bigram = model.bigram(idx)
    bigram_lambdas = model.bigram.lambdas
    tables = [emb(idx) for emb in model.value_embeds]
    ve = [tables[j] if j >= 0 else None for j in cfg.value_embeds]
    x = x + x0_bigram * bigram_lambdas[0]
    x0_inject = [x0 * blocks[0].x0_lambda] + [
        x0 * blocks[i].x0_lambda + x0_bigram * bigram_lambdas[i] if blocks[i].x0_lambda is not None else None
        for i in range(1, n)
    ]
    skip_w = model.skip_weights[0]
    skip_gate_out = connections.skip_scale(skip_w, cfg.stream.skip_gate_form) * model.skip_gate(x0)
    cache = {0: x}
    B, T, C = x.shape
    Hd = cfg.n_head
    for i in range(n):
        b = blocks[i]
        mu = None
        if b.attn is None:  # the record's layer 6
            x = x + skip_gate_out * cache[skip_src]
        else:
            attn_in_normed = b.norm1(cache.get(attn_src, x))
            if i == n - 1:
                cache[n - 2] = x
                mu = record_forward_mudd(model.mudd, x, id=0, num_coef=14)
                v_mudd = (mu[0] * cache[0] + mu[1] * cache[h_src] + mu[2] * x).view(B, T, Hd, C // Hd)
                x = (1 + mu[5]) * x + mu[3] * cache[0] + mu[4] * cache[h_src]
                ve_gate = torch.cat([mu[6], mu[7]], dim=-1).repeat_interleave(Hd // 2, dim=-1).unsqueeze(-1)
                ve_view = ve[i].view(B, T, Hd, C // Hd)
                aux_v = (ve_gate * ve_view + v_mudd).view(B, T, -1)
                assert b.attn.ve_gate is None  # v + aux_v, as the record's attention
                attn_out = record_attention_82(b, attn_in_normed, masks[i], aux_v)
            else:
                attn_out = record_attention_82(b, attn_in_normed, masks[i], ve[i])
            if mu is not None:
                x = mu[8] * x + mu[9] * attn_out + mu[10] * cache[0] + mu[11] * x0_bigram
            else:
                x = b.lambdas[0] * x + b.post_lambdas[0] * attn_out + x0_inject[i]
        if mu is not None:
            x = mu[12] * x + mu[13] * b.mlp(b.norm2(x))
        else:
            x = b.lambdas[1] * x + b.post_lambdas[1] * b.mlp(b.norm2(x))
        if i in (s_src, h_src, attn_src, skip_src):
            cache[i] = x
    mu = record_forward_mudd(model.mudd, x, id=1, num_coef=5)
    ve_bank0 = ve[1].to(dtype=x.dtype)
    x = (
        x
        + mu[0] * cache[0]
        + mu[1] * cache[h_src]
        + mu[2] * cache[n - 2]
        + mu[3] * ve_bank0
        + mu[4] * cache[s_src]
    )
    return model.norm_f(x)


def record_hidden_sublayer(model, idx):
    """The same loop without MUDD (#77 alone, the backout left out): layer 10 with its own lambdas."""
    cfg, blocks = model.cfg, model.blocks
    masks = model.layer_masks(idx)
    x = x0 = model.embed_norm(model.smear(model.wte(idx)))
    x0_bigram, lam = model.bigram(idx), model.bigram.lambdas
    tables = [emb(idx) for emb in model.value_embeds]
    x = x + x0_bigram * lam[0]
    cache = {0: x}
    for i, b in enumerate(blocks):
        if b.attn is None:
            skip = connections.skip_scale(model.skip_weights[0], cfg.stream.skip_gate_form) * model.skip_gate(
                x0
            )
            x = x + skip * cache[S_SRC]
        else:
            inject = x0 * b.x0_lambda + (x0_bigram * lam[i] if i else 0)
            j = cfg.value_embeds[i]
            y = b.attn(b.norm1(cache.get(H_SRC, x)), Masked(masks[i]), tables[j] if j >= 0 else None)[0]
            x = b.lambdas[0] * x + b.post_lambdas[0] * y + inject
        x = b.lambdas[1] * x + b.post_lambdas[1] * b.mlp(b.norm2(x))
        cache[i] = x
    return model.norm_f(x)


def _loss_and_grads(model, hidden_fn, idx, tgt):
    model.zero_grad()
    logits = model.logits(hidden_fn(model, idx))
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), tgt.view(-1))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _close(got, want, tol, name):
    """max |got − want| ≤ tol · max |want|: autograd sums a tensor read at several places (c0, x0) in
    the order of its uses, which the two loops do not share, so gradients agree to fp32 rounding."""
    assert float((got - want).abs().max()) <= tol * float(want.abs().max()) + 1e-12, name


def _ours(model, idx):
    return model.hidden(idx, model.layer_contexts(idx))


# --- tests ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("xsa", [[], [1, 3, 4, 5]], ids=["mudd", "mudd+xsa"])
def test_mudd_is_the_records_loop_loss_and_every_gradient(xsa):
    """With #82's XSA as xsa-2026-04 has it (on the MUDD layer too: α reads v with MUDD's mix in it)."""
    model = _model(xsa_layers=xsa)
    assert [s.mudd for s in model.specs] == [False] * (L - 1) + [True]
    assert float(model.mudd.w2.detach().abs().sum()) > 0  # coefficients vary per token
    idx, tgt = _batch()
    ours = _loss_and_grads(model, _ours, idx, tgt)
    ref = _loss_and_grads(model, record_hidden, idx, tgt)
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=0)
    assert ours[1].keys() == ref[1].keys()
    assert {"mudd.w1", "mudd.w2", "mudd.b2"} <= ours[1].keys()
    for n in ref[1]:
        _close(ours[1][n], ref[1][n], 1e-5, n)


@pytest.mark.parametrize("h, s", [(S_SRC, S_SRC), (H_SRC, H_SRC), (H_SRC, 2), (2, S_SRC)])
def test_a_wrong_source_layer_is_caught_by_the_reference(h, s):
    """The comparison above fails when MUDD reads another layer's output (it can fail)."""
    model = _model()
    idx, tgt = _batch()
    ours = _loss_and_grads(model, _ours, idx, tgt)[0]
    wrong = _loss_and_grads(model, lambda m, i: record_hidden(m, i, h, s), idx, tgt)[0]
    assert abs(float(ours - wrong)) > 1e-6


def test_sublayer_form_without_mudd_is_the_records_loop():
    model = _model(mudd=False)
    assert model.mudd is None and model.blocks[-1].post_lambdas is not None
    assert model.blocks[-1].attn.ve_gate is not None  # without MUDD the last layer keeps its sigmoid gate
    idx, tgt = _batch()
    ours = _loss_and_grads(model, _ours, idx, tgt)
    ref = _loss_and_grads(model, record_hidden_sublayer, idx, tgt)
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=0)
    assert ours[1].keys() == ref[1].keys()
    for n in ref[1]:
        _close(ours[1][n], ref[1][n], 1e-5, n)


def test_init_is_the_records():
    """W1 as the record's kaiming-uniform (same bound and, from the same seed, the same draws), W2 zero,
    the biases the record's; #77's lambdas from √1.1 and 1, x0 weights 0; at init the last layer's
    coefficients are the static values they replace, whatever the input."""
    torch.manual_seed(5)
    model = build_model(_cfg())
    torch.manual_seed(7)
    w1, w2, b2 = record_init_mudd(64)
    torch.manual_seed(7)
    model.mudd.reset_parameters()
    torch.testing.assert_close(model.mudd.w1.data, w1, rtol=0, atol=0)
    torch.testing.assert_close(model.mudd.w2.data, w2, rtol=0, atol=0)
    torch.testing.assert_close(model.mudd.b2.data, b2, rtol=0, atol=0)
    bound = 1 / math.sqrt(64)
    assert float(model.mudd.w1.data.abs().max()) <= bound
    assert abs(float(model.mudd.w1.data.std()) - bound / math.sqrt(3)) < 0.05 * bound
    torch.testing.assert_close(model.bigram.lambdas.data, torch.full((L,), 0.05))  # #77's init
    for b in model.blocks[:-1]:
        torch.testing.assert_close(b.lambdas.data, torch.full((2,), 1.1**0.5))
        torch.testing.assert_close(b.post_lambdas.data, torch.ones(2))
        assert b.x0_lambda is None or float(b.x0_lambda.data.abs().sum()) == 0
    last = model.blocks[-1]
    assert last.lambdas is None and last.post_lambdas is None and last.x0_lambda is None
    mu = model.mudd.coefs(torch.randn(1, 5, 64), 0, 14)
    want = [0, 0, 0, 0, 0, 0, 2, 2, 1.1**0.5, 1, 0, 0.05, 1.1**0.5, 1]
    for m, w in zip(mu, want, strict=True):
        torch.testing.assert_close(m, torch.full_like(m, w), rtol=1e-6, atol=1e-7)


def test_labels_train_mudd_in_its_own_adam_rows():
    from speedrun.config.gpt2026.mudd import LR_MUL as MUDD_LR_MUL
    from speedrun.config.labels import label_table
    from speedrun.optim.rules import adam_groups, param_rules

    cfg = load_recipe(BASE, [])
    model = build_model(_cfg())
    rules = label_table(cfg.optim, 32)
    entries = {e.name: e for e in param_rules(model, rules)}
    assert entries["mudd.w1"].rule.group == entries["mudd.w2"].rule.group == "mudd"
    assert entries["mudd.b2"].rule.group == "mudd_bias"
    groups = adam_groups(rules, {e.rule.group for e in entries.values()})
    o = cfg.optim
    assert groups["mudd"].lr == groups["mudd_bias"].lr == o.embed_lr * MUDD_LR_MUL == 0.002
    assert tuple(groups["mudd"].betas) == tuple(groups["mudd_bias"].betas) == (0.9, 0.99)
    assert groups["mudd"].weight_decay == o.adam_weight_decay and groups["mudd_bias"].weight_decay == 0.0
    # #77's rows (the record's param_table): resid_lambdas lr x5, post/x0/bigram lambdas and XSA α x1,
    # all betas (0.9, 0.95) without decay
    model = build_model(_cfg(xsa_layers=[1, 3]))
    entries = {e.name: e for e in param_rules(model, rules)}
    assert {entries[n].rule.group for n in ("blocks.0.lambdas", "blocks.4.lambdas")} == {"resid_lambda"}
    lambdas = ("blocks.0.post_lambdas", "blocks.1.x0_lambda", "bigram.lambdas", "blocks.3.attn.xsa.alpha")
    assert {entries[n].rule.group for n in lambdas} == {"lambda"}
    groups = adam_groups(rules, {"resid_lambda", "lambda"})
    assert (groups["resid_lambda"].lr, groups["lambda"].lr) == (5 * 0.008, 0.008) == (o.scalar_lr, o.embed_lr)
    assert tuple(groups["resid_lambda"].betas) == tuple(groups["lambda"].betas) == (0.9, 0.95)
    assert groups["resid_lambda"].weight_decay == groups["lambda"].weight_decay == 0.0


def test_mudd_trains_a_step_through_the_run_optimizer():
    from speedrun.optim.build import build_optimizer

    # the sublayer form labels x0's weights `lambda`: banks-2026-01's stated x0 row is taken back
    cfg = replace(load_recipe(BASE, ["optim.labels.x0={}"]), model=_cfg())
    model = _model()
    opt = build_optimizer(model, cfg)
    idx, tgt = _batch()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("mudd")}
    for _ in range(2):  # the record's Adam steps on odd steps only
        model(idx, tgt).backward()
        opt.step()
        opt.zero_grad()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters() if n in before)


def test_cached_decoding_equals_the_forward():

    model = _model().eval()
    idx, _ = _batch()
    assert_cached_decoding_is_the_forward(model, idx, 40)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["model.mudd_sources=[7]"], "[h, s]: two distinct present layers below 9"),
        (["model.mudd_sources=[7,9]"], "[h, s]: two distinct present layers below 9"),
        (["model.mudd_sources=[7,3]"], "residual_form='sublayer'"),
        (
            ["model.residual_form=sublayer", "model.x0_lambda_apart=false", "model.mudd_sources=[7,3]"],
            "backout_layer=0",
        ),
    ],
)
def test_a_bad_mudd_setting_is_one_config_error_naming_it(overrides, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_recipe(BASE, overrides)


OVER = [
    "model.residual_form=sublayer",
    "model.x0_lambda_apart=false",
    "model.backout_layer=0",
    f"model.attn_inputs=[{'-1,' * 8}7,7,7]",
]


def _count(overrides: list[str]) -> int:
    with torch.device("meta"):  # shapes only: the full-size model without its memory
        return sum(p.numel() for p in build_model(load_recipe(BASE, overrides).model).parameters())


def test_mudd_on_the_full_recipe_adds_the_records_parameter_count():
    """MUDD: 2·64·768 + 2·14·64 + 2·14 = 100,124 weights; the last layer loses its own 2 + 2 + 1 lambdas
    and its value-embedding gate (6·12), which the record keeps but no longer reads."""
    base = _count(OVER)
    mudd = _count([*OVER, "model.mudd_sources=[7,3]"])
    assert mudd - base == 2 * 64 * 768 + 2 * 14 * 64 + 2 * 14 - 5 - 6 * 12
