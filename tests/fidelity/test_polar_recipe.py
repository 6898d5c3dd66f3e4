"""Recipe `polar-2025-09` against record #38's script (records/track_1_short/2025-09-29_PolarExpress, the
code at the top of each log), its formulas written here: the schedules (LR, momentum, windows, YaRN) at
chosen steps, the fp32 forward loss and gradients of its model (FA3 replaced by a dense document-causal
window mask of FA3's semantics, as tests/fidelity/test_yarn_recipe.py), its Polar Express, and each new part
(#32 gated skips, #34 smear, #35 the absent layer 0) against its formula."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from speedrun.errors import ConfigError
from speedrun.model.families import build_model
from speedrun.model.gpt2026.yarn import yarn_after
from speedrun.optim.orthogonalize import polar_express
from speedrun.recipes import load_recipe
from speedrun.train.schedule import apply_to_model, schedule_at
from tests.fidelity.checks import (
    assert_loss_and_gradients_are_the_records,
    fp32_model,
    jitter_,
    shrunk_with_optimizer,
    two_documents,
)
from tests.fidelity.refs import schedules
from tests.fidelity.refs.newton_schulz import record_38_polar_express
from tests.fidelity.refs.yarn import yarn_through
from tests.fidelity.test_yarn_recipe import RecordYarn, fa3_reference, norm, record_qkvo

RECIPE = "polar-2025-09"
N, EXT, BLOCK = 1630, 40, 128  # num_iterations, iteration_extension, block_size
WS_SCHEDULE, WS_VALIDATE, WS_LONG_VALIDATE = (3, 7, 11), 13, 20


def record_lr(step: int) -> float:
    """#38's get_lr."""
    return schedules.lr_half_cooldown(step, N)


def record_ws(step: int) -> tuple[int, int]:
    """#38's get_ws, and the training loop's ws_long = ws_long_validate at the last step."""
    if step == N + EXT:
        return WS_VALIDATE // 2, WS_LONG_VALIDATE
    x = min(step / (1 + N), 0.9999)
    ws = WS_SCHEDULE[int(len(WS_SCHEDULE) * x)]
    return ws // 2, ws


def record_yarn_windows(step: int) -> list[int]:
    """The long windows #38's loop has passed to yarn.apply by `step` (13 at the last step, not 20)."""
    seen = [WS_SCHEDULE[0]]
    for s in range(step + 1):
        ws = WS_VALIDATE if s == N + EXT else record_ws(s)[1]
        if ws != seen[-1]:
            seen.append(ws)
    return seen


@pytest.mark.parametrize("step", [0, 543, 544, 815, 1087, 1088, 1500, 1629, 1630, 1669, 1670])
def test_schedule_at_chosen_steps_is_the_records(step):
    cfg = load_recipe(RECIPE)
    assert cfg.train.steps == N + EXT
    got = schedule_at(step, cfg)
    if step < N:
        assert got.lr == pytest.approx(record_lr(step), rel=1e-12, abs=1e-15), step
    elif step < N + EXT:  # the extension: the floor 0.1, the record 0.10018 (a gap the recipe names)
        assert got.lr == pytest.approx(0.1, rel=1e-12) and record_lr(step) == pytest.approx(0.10018)
    frac = min(step / 300, 1)
    assert got.muon_momentum == pytest.approx((1 - frac) * 0.85 + frac * 0.95, rel=1e-15), step
    v = got.stage
    assert (v.short_window, v.long_window) == record_ws(step), step
    assert (v.batch_tokens, v.max_doc_len) == (2048 * 24 * 8, 128 * 16), step
    rec = RecordYarn(128, 4)
    windows = record_yarn_windows(step)
    scale = 0.1
    scale = yarn_through(rec, windows, scale)
    freqs, got_scale = yarn_after([b * BLOCK for b in got.yarn], 128, cfg.model.attn.scale)
    torch.testing.assert_close(freqs, rec.angular_freq, rtol=1e-6, atol=0, msg=str(step))
    assert got_scale == pytest.approx(scale, rel=1e-12), step


# ------------------------------------------------------------------ record #38's model, from its code


def record_rotary(x_BTHD, cos, sin):
    """#38's rotary: no fp32 cast (its tables and activations are bf16)."""
    cos, sin = cos[None, : x_BTHD.size(-3), None, :], sin[None, : x_BTHD.size(-3), None, :]
    x1, x2 = x_BTHD.chunk(2, dim=-1)
    return torch.cat((x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos), 3)


def record_forward(
    w, input_seq, target_seq, seqlens, ws_short, ws_long, yarn, scale, L, heads, dim, training,
    backout_layer=None,
):  # fmt: skip
    """#38's GPT.forward (fp32: no FP8, its eval-mode matmul), the summed loss in training. With
    `backout_layer`, #42's: #40's backout subtracts λ times that layer's output before the head (the record
    subtracts in place); the rest of #42's forward is #38's line for line."""
    hd, T = dim // heads, len(input_seq)
    cos, sin = yarn.cos.bfloat16().float(), yarn.sin.bfloat16().float()  # #32: its tables are bf16
    ve = [F.embedding(input_seq, w[f"value_embeds.{i}.weight"]) for i in range(3)]
    ve = [None, ve[1], ve[2]] + [None] * (L - 6) + [ve[0], ve[1], ve[2]]
    short_bm, long_bm = ws_short * BLOCK, ws_long * BLOCK
    bm_sizes = [None, short_bm, short_bm, short_bm, long_bm, short_bm, short_bm, None, short_bm,
                short_bm, short_bm, long_bm]  # fmt: skip
    x = F.embedding(input_seq, w["wte.weight"])
    smear_gate = w["smear.gate.weight"]
    gate_out = w["smear.lamb"] * torch.sigmoid(F.linear(x[1:, : smear_gate.size(-1)], smear_gate))
    x = torch.cat([x[:1], x[1:] + gate_out * x[:-1]])
    x = x0 = norm(x[None])
    skips, n = [], L // 2
    for i in range(1, L):  # skip layer zero
        if i >= n and i < 11:
            x = x + torch.sigmoid(w["skip_weights"][i - n]) * skips.pop()
        lam = w[f"blocks.{i}.lambdas"]
        x = lam[0] * x + lam[1] * x0
        if bm_sizes[i] is not None:
            h = norm(x)
            qkvo_w = record_qkvo(w, i, dim)
            q, k, v = F.linear(h, qkvo_w[:3].flatten(end_dim=1)).view(1, T, 3 * heads, hd).chunk(3, dim=-2)
            q, k = norm(q), norm(k)
            q, k = record_rotary(q, cos, sin), record_rotary(k, cos, sin)
            sa = w[f"blocks.{i}.attn.lambdas"]
            v = sa[0] * v + sa[1] * ve[i].view_as(v) if ve[i] is not None else sa[0] * v
            y = fa3_reference(q[0], k[0], v[0], seqlens, bm_sizes[i], scale).view(1, T, heads, hd)
            gate = w[f"blocks.{i}.attn.gate.proj.weight"]
            y = y * torch.sigmoid(F.linear(h[..., : gate.size(-1)], gate)).view(1, T, heads, 1)
            x = x + F.linear(y.contiguous().view(1, T, dim), qkvo_w[3])
        h = F.linear(norm(x), w[f"blocks.{i}.mlp.c_fc.weight"].T)
        x = x + F.linear(F.relu(h).square(), w[f"blocks.{i}.mlp.c_proj.weight"])
        if i < n:
            skips.append(x)
        if i == backout_layer:
            x_backout = x
    if backout_layer is not None:
        x = x - w["backout.lamb"] * x_backout
    logits = 30 * torch.sigmoid(F.linear(norm(x), w["lm_head.weight"]) / 7.5)
    return F.cross_entropy(
        logits.view(-1, logits.size(-1)), target_seq, reduction="sum" if training else "mean"
    )


def model_and_batch(L=12, heads=2, dim=64, vocab=120, T=1024, recipe=RECIPE):
    """The recipe's model shrunk (weights jittered: the record zero-inits some), a 1,000-token document
    and a short one, and their cu_seqlens padded as the record pads them."""
    cfg, model = fp32_model(recipe, n_layer=L, n_head=heads, n_embd=dim, vocab_size=vocab, max_seq_len=T)
    jitter_(model, 0.02)  # the record zero-inits projections, gates, smear and the head: give them values
    x, y, cu = two_documents(vocab, T)
    return cfg, model, x, y, cu


@pytest.mark.parametrize("step", [544, N + EXT])  # windows 3/7 (YaRN 3 → 7) in training; 6/20 (YaRN 13)
def test_forward_loss_and_gradients_match_the_records_model_in_fp32(step):
    L, heads, dim = 12, 2, 64
    cfg, model, x, y, cu = model_and_batch(L, heads, dim)
    T = len(x)
    training = step < N + EXT
    model.train(training)
    apply_to_model(schedule_at(step, cfg), model)
    yarn = RecordYarn(dim // heads, T)
    windows, scale = record_yarn_windows(step), 0.1
    scale = yarn_through(yarn, windows, scale)
    rotary = model.blocks[1].attn.rotary  # #32: the YaRN tables rounded to bf16, as the record's buffers
    assert rotary.cos.dtype == torch.bfloat16
    torch.testing.assert_close(rotary.cos, yarn.cos.bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(rotary.sin, yarn.sin.bfloat16(), rtol=0, atol=0)
    weights = {n: p.detach().clone().requires_grad_(training) for n, p in model.named_parameters()}
    assert not any(n.startswith("blocks.0.") for n in weights)  # #35: layer 0 is absent
    with torch.set_grad_enabled(training):
        loss = model(x[None], y[None], cu)
        ref = record_forward(weights, x, y, cu, *record_ws(step), yarn, scale, L, heads, dim, training)
    assert_loss_and_gradients_are_the_records(model, loss, ref, weights, T, training)
    if training:
        assert model.smear.gate.weight.grad.abs().sum() > 0 and model.skip_weights.grad[5] == 0


def test_smear_is_its_formula_and_decodes_with_the_previous_token():
    """#34: x[t] + λ·σ(W·x[t, :k])·x[t-1] for t >= 1, the first token untouched; the tail of a sequence
    smeared with its previous token given equals the tail of the whole sequence smeared."""
    from speedrun.model.gpt2026.embeddings import Smear

    gen = torch.Generator().manual_seed(4)
    smear = Smear(3)
    x = torch.randn(2, 6, 8, generator=gen)
    torch.testing.assert_close(smear(x), x)  # λ = 0 and W = 0 at the start
    with torch.no_grad():
        smear.gate.weight.normal_(generator=gen)
        smear.lamb.fill_(0.7)
    want = x.clone()
    for t in range(1, 6):
        want[:, t] += 0.7 * torch.sigmoid(x[:, t, :3] @ smear.gate.weight[0])[:, None] * x[:, t - 1]
    torch.testing.assert_close(smear(x), want)
    torch.testing.assert_close(smear(x[:, 4:], prev=x[:, 3:4]), want[:, 4:])


def test_skip_sources_leave_out_the_absent_layer():
    """#32/#35: decoder layer 11-i receives encoder layer i, except from the absent layer 0; the yarn
    rung (layer 0 with attention) keeps all six skips with plain weights."""
    from speedrun.model.gpt2026.connections import skip_weights
    from speedrun.model.gpt2026.specs import build_specs

    def skip_sources(cfg):
        return [s.skip_from for s in build_specs(cfg)]

    def initial_weights(cfg):
        return skip_weights(len(cfg.skips), cfg.stream.skip_gate_form).detach()

    cfg = load_recipe(RECIPE).model
    assert skip_sources(cfg) == [None] * 6 + [5, 4, 3, 2, 1, None]
    assert torch.equal(initial_weights(cfg), torch.full((6,), -1.5))
    base = load_recipe("yarn-2025-09").model
    assert skip_sources(base) == [None] * 6 + [5, 4, 3, 2, 1, 0]
    assert torch.equal(initial_weights(base), torch.ones(6))


# ------------------------------------------------------------------ record #38's Polar Express


@pytest.mark.parametrize("shape", [(4, 24, 96), (96, 24), (1, 12)])
def test_polar_express_is_the_records(shape):
    """The recipe's orthogonalizer is #38's: coefficients, normalization and op order (fp32 here)."""
    assert load_recipe(RECIPE).optim.muon_backend == "polar_express"
    G = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(
        polar_express(G, dtype=torch.float32), record_38_polar_express(G), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize(
    "override, words",
    [
        ("model.smear=769", "model.embed.smear (769) must not exceed model.n_embd (768)"),
        ("model.skips=[[0, 12]]", "model.skips [[0, 12]]: [src, dst] pairs, 0 <= src < dst < 12"),
        (
            "train.stages=tokens=8 windows=1/3 frac=1; tokens=8 windows=1/3 ext=0 val=2/20 yarn=21",
            "yarn=21 (the window YaRN rescales to at most) must not exceed",
        ),
        ("train.stages=tokens=8 windows=1/3 frac=1; tokens=8 windows=1/3 ext=0 val=7/5", "val=7/5 must be"),
    ],
)
def test_a_bad_new_switch_is_one_config_error_naming_it(override, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_recipe(RECIPE, [override])


def test_training_cross_entropy_is_in_bf16_and_validation_in_fp32():
    """#37: in training the loss is F.cross_entropy of the bf16 softcapped logits, `30 * sigmoid(z / 7.5)`
    of the bf16 head output; in eval the same logits cast to fp32 first (#38's GPT.forward)."""
    from tests.recipe_matrix import shrunk

    cfg = shrunk(RECIPE, "model.embed_dtype=fp32", n_layer=2)
    torch.manual_seed(0)
    model = build_model(cfg.model).bfloat16()
    with torch.no_grad():
        model.lm_head.weight.normal_(std=1.0)  # logits of a few tens: bf16 rounding shows in the loss
    gen = torch.Generator().manual_seed(6)
    idx = torch.randint(0, cfg.model.eot_id, (1, 64), generator=gen)
    targets = torch.randint(0, cfg.model.eot_id, (1, 64), generator=gen)
    with torch.no_grad():
        h = model.hidden(idx, model.layer_contexts(idx))
        logits = 30 * torch.sigmoid(F.linear(h, model.lm_head.weight) / 7.5)
        assert logits.dtype == torch.bfloat16
        want_train = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        want_eval = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        assert not torch.equal(want_train.float(), want_eval)  # the two really differ here
        assert torch.equal(model.train()(idx, targets), want_train)
        assert torch.equal(model.eval()(idx, targets), want_eval)


@torch.no_grad()
def record_muon_step(params, state, lr, momentum):
    """#38's Muon.step for world_size 1 (weight decay 0), its polar_express in fp32."""
    for p in params:
        grad = p.grad
        eff_lr = lr * max(1, p.size(-2) / p.size(-1)) ** 0.5
        buf = state.setdefault(id(p), torch.zeros_like(grad))
        buf.lerp_(grad, 1 - momentum)
        p.add_(other=record_38_polar_express(grad.lerp(buf, momentum)), alpha=-eff_lr)


def test_three_steps_equal_record_38s_optimizer():
    """Muon (lr 0.06, Polar Express; the attention gates and the smear gate among its matrices, #38's
    gate_params) and DistAdam (lr 0.008 x lr_mul, eps 1e-8), fp32, against #38's code."""
    from speedrun.train.schedule import apply_schedule
    from tests.fidelity.test_bos_align_optimizer import record_adam_step
    from tests.fidelity.test_yarn_recipe import record_layout

    extra = ["model.embed_dtype=fp32", "model.fp8_head=false", "optim.muon_ns_dtype=fp32"]
    cfg, model, opt, ours = shrunk_with_optimizer(RECIPE, extra)
    dim, n = cfg.model.n_embd, cfg.train.steps
    rec = {}  # the record's parameters: qkvo_w per layer as (4, d, d)
    for name, p in ours.items():
        if name.endswith("attn.c_proj.weight"):
            continue
        if name.endswith("attn.c_attn.weight"):
            name = name.replace("c_attn", "qkvo")
            w = torch.cat([p.detach().view(3, dim, dim), ours[name.replace("qkvo", "c_proj")].detach()[None]])
        else:
            w = record_layout(name, p.detach(), dim)
        rec[name] = torch.nn.Parameter(w.clone())
        rec[name].lr_mul = (
            75.0 if name.startswith(("wte.", "value_embeds.")) else 1.0 if "lm_head" in name else 5.0
        )
    is_muon = {n: (n.startswith("blocks.") or "gate" in n) and p.ndim >= 2 for n, p in rec.items()}
    muon = [p for n, p in rec.items() if is_muon[n]]
    adam = [p for n, p in rec.items() if not is_muon[n]]
    assert "smear.gate.weight" in rec and is_muon["smear.gate.weight"]
    start = {n: p.detach().clone() for n, p in ours.items()}
    muon_state, adam_state = {}, {}
    gen = torch.Generator().manual_seed(1)
    for step in (0, 5, 8):  # LR 1 then in the cool-down; momentum warming up
        apply_schedule(schedule_at(step, cfg), opt, model)
        for p in ours.values():
            p.grad = torch.randn(p.shape, generator=gen)
        for name, w in rec.items():
            if "qkvo" in name:
                qkv, o = ours[name.replace("qkvo", "c_attn")].grad, ours[name.replace("qkvo", "c_proj")].grad
                w.grad = torch.cat([qkv.view(3, dim, dim), o[None]])
            else:
                w.grad = record_layout(name, ours[name].grad, dim).clone()
        opt.step()
        opt.zero_grad()
        x = min(0.9999, step / n)
        lr = 1.0 if x < 0.5 else (1 - x) / 0.5 + (1 - (1 - x) / 0.5) * 0.1
        frac = min(step / 300, 1)
        record_adam_step(adam, adam_state, 0.008 * lr, eps=1e-8)
        record_muon_step(muon, muon_state, 0.06 * lr, (1 - frac) * 0.85 + frac * 0.95)
    for name, p in ours.items():
        if "attn.c_" in name:
            q = rec[name.replace("c_attn", "qkvo").replace("c_proj", "qkvo")].detach()
            want = (q[:3].reshape(-1, dim) if "c_attn" in name else q[3]) - start[name]
        else:
            r = rec[name].detach()
            want = (r if r.shape == p.shape else r.T) - start[name]
        got = p.detach() - start[name]
        # fp32 op-order noise, largest where Polar Express's big first coefficients meet a tiny matrix
        # (smear's (1, 12) gate: measured 6.2e-6) or one element (smear's λ: 5.6e-9 off 1.9e-3)
        assert (got - want).norm() <= 1e-5 * want.norm() + 1e-8, name
