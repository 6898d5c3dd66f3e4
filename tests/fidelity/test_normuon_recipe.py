"""Recipe `normuon-2025-10` against record #42's script (records/track_1_short/2025-10-27_FixMuonLR, the
code at the top of each log), its formulas written here: the schedules (LR, momentum, windows, YaRN) at
chosen steps, the fp32 forward loss and gradients of its model with #40's backout (FA3 replaced by a
dense document-causal window mask, as tests/fidelity/test_yarn_recipe.py), six steps of its optimizer (NorMuon
with #41's column statistics and #42's learning rates, DistAdam every other step on the gradients of
two, #39), and each new part (backout, NorMuon's column statistics) against its formula."""

from __future__ import annotations

import re

import pytest
import torch

from speedrun.errors import ConfigError
from speedrun.model.families import build_model
from speedrun.model.gpt2026.yarn import yarn_after
from speedrun.recipes import load_recipe
from speedrun.train.schedule import apply_to_model, schedule_at
from tests.fidelity.checks import assert_loss_and_gradients_are_the_records, shrunk_with_optimizer
from tests.fidelity.refs import schedules
from tests.fidelity.refs.newton_schulz import record_38_polar_express
from tests.fidelity.refs.yarn import yarn_through
from tests.fidelity.test_polar_recipe import model_and_batch, record_forward
from tests.fidelity.test_yarn_recipe import RecordYarn
from tests.recipe_matrix import replace

RECIPE = "normuon-2025-10"
N, EXT, BLOCK = 2245, 40, 128  # num_scheduled_iterations, num_extension_iterations, block_size
WS_SCHEDULE, WS_FINAL, WS_POST_YARN = (3, 7, 11), 13, 20


def record_lr(step: int) -> float:
    """#42's get_lr."""
    return schedules.lr_half_cooldown(step, N)


def record_ws(step: int) -> tuple[int, int]:
    """#42's get_ws, and the training loop's ws_long = ws_validate_post_yarn_ext at the last step."""
    if step == N + EXT:
        return WS_FINAL // 2, WS_POST_YARN
    if step >= N:
        return WS_FINAL // 2, WS_FINAL
    ws = WS_SCHEDULE[int(len(WS_SCHEDULE) * (step / N))]
    return ws // 2, ws


def record_momentum(step: int) -> float:
    """#42's get_muon_momentum (300 warm-up steps, 50 cool-down steps, 0.85 ↔ 0.95)."""
    return schedules.muon_momentum(step, N + EXT)


def record_yarn_windows(step: int) -> list[int]:
    """The long windows #42's loop has passed to yarn.apply by `step` (not the final validation's 20)."""
    seen = [WS_SCHEDULE[0]]
    for s in range(min(step, N + EXT - 1) + 1):
        if record_ws(s)[1] != seen[-1]:
            seen.append(record_ws(s)[1])
    return seen


@pytest.mark.parametrize("step", [0, 299, 748, 749, 1122, 1123, 1496, 1497, 2236, 2244, 2245, 2284, 2285])
def test_schedule_at_chosen_steps_is_the_records(step):
    cfg = load_recipe(RECIPE)
    assert cfg.train.steps == N + EXT
    got = schedule_at(step, cfg)
    assert got.lr == pytest.approx(record_lr(min(step, N + EXT - 1)), rel=1e-12, abs=1e-15), step
    assert got.muon_momentum == pytest.approx(record_momentum(step), rel=1e-12), step
    v = got.stage
    assert (v.short_window, v.long_window) == record_ws(step), step
    assert (v.batch_tokens, v.max_doc_len) == (2048 * 16 * 8, 128 * 16), step
    rec = RecordYarn(128, 4)
    windows, scale = record_yarn_windows(step), 0.1
    scale = yarn_through(rec, windows, scale)
    freqs, got_scale = yarn_after([b * BLOCK for b in got.yarn], 128, cfg.model.attn.scale)
    torch.testing.assert_close(freqs, rec.angular_freq, rtol=1e-6, atol=0, msg=str(step))
    assert got_scale == pytest.approx(scale, rel=1e-12), step


def test_batch_and_cu_seqlens_are_the_records():
    """#39: 16 sequences of 2,048 per rank and step, 8 ranks; cu_seqlens sized next_multiple_of_n(
    32768 // 300, n=128)."""
    t, d = load_recipe(RECIPE).train, load_recipe(RECIPE).data
    assert (t.global_batch_tokens, t.document_rows, t.micro_batch_tokens) == (2048 * 16 * 8, 8, 2048 * 16)
    assert d.max_docs == -(-(2048 * 16 // 300) // 128) * 128 == 128


# ------------------------------------------------------------------ record #42's model, from its code


@pytest.mark.parametrize("step", [749, N + EXT])  # windows 3/7 (YaRN 3 → 7) in training; 6/20 (YaRN 13)
def test_forward_loss_and_gradients_match_the_records_model_in_fp32(step):
    L, heads, dim = 12, 2, 64
    cfg, model, x, y, cu = model_and_batch(L, heads, dim, recipe=RECIPE)
    T = len(x)
    training = step < N + EXT
    model.train(training)
    apply_to_model(schedule_at(step, cfg), model)
    yarn = RecordYarn(dim // heads, T)
    windows, scale = record_yarn_windows(step), 0.1
    scale = yarn_through(yarn, windows, scale)
    weights = {n: p.detach().clone().requires_grad_(training) for n, p in model.named_parameters()}
    with torch.set_grad_enabled(training):
        loss = model(x[None], y[None], cu)
        ref = record_forward(  # #42's: #38's with #40's backout of layer 8
            weights, x, y, cu, *record_ws(step), yarn, scale, L, heads, dim, training, backout_layer=8
        )
    assert_loss_and_gradients_are_the_records(model, loss, ref, weights, T, training)
    if training:
        assert model.backout.lamb.grad.abs().sum() > 0


def test_backout_is_its_formula():
    """#40: x − λ·h_k with λ from 0.5; the model with λ = 0 is the model without backout."""
    from speedrun.model.gpt2026.connections import Backout

    gen = torch.Generator().manual_seed(3)
    x, h = torch.randn(2, 5, 8, generator=gen), torch.randn(2, 5, 8, generator=gen)
    backout = Backout(8)
    torch.testing.assert_close(backout(x, {8: h}), x - 0.5 * h)
    cfg, model, idx, _, _ = model_and_batch(L=12, recipe=RECIPE)
    idx = idx[:64]
    plain = build_model(replace(cfg.model, backout_layer=0))
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("backout.")})
    with torch.no_grad():
        model.backout.lamb.zero_()
        torch.testing.assert_close(model(idx[None]), plain(idx[None]), rtol=0, atol=0)
        model.backout.lamb.fill_(0.5)
        assert not torch.equal(model(idx[None]), plain(idx[None]))


# ------------------------------------------------------------------ record #42's optimizer, from its code


def record_normuon_(v: torch.Tensor, buf: torch.Tensor, param_shape, beta2: float = 0.95) -> torch.Tensor:
    """#42's NorMuon lines after polar_express: the axis from the stored parameter's shape."""
    v_norm = v.norm(dim=(-2, -1), keepdim=True)
    v_mean = v.square().mean(dim=-1 if param_shape[-2] >= param_shape[-1] else -2, keepdim=True)
    buf.lerp_(v_mean, 1 - beta2)
    v = v * buf.clamp_min(1e-10).rsqrt()
    return v * (v_norm / v.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-10))


def test_normuon_keeps_column_statistics_of_square_blocks_as_42():
    """#41/#42: (768, 768) attention blocks of a (768, 3072) parameter get one statistic per column."""
    from speedrun.optim.normuon import normuon_normalize_, second_moment_shape

    assert load_recipe(RECIPE).optim.normuon_square_stats == "cols"
    gen = torch.Generator().manual_seed(7)
    buf, want_buf = torch.zeros(second_moment_shape((4, 16, 16), "cols")), torch.zeros(4, 1, 16)
    assert buf.shape == want_buf.shape
    for _ in range(2):
        v = torch.randn(4, 16, 16, generator=gen) * torch.rand(1, 1, 16, generator=gen)
        want = record_normuon_(v, want_buf, (16, 64))
        torch.testing.assert_close(normuon_normalize_(v.clone(), buf, 0.95, "cols"), want)
        torch.testing.assert_close(buf, want_buf)


@torch.no_grad()
def record_normuon_step(params, state, lr, momentum):
    """#42's NorMuon.step for world_size 1 (weight decay 0), its polar_express in fp32."""
    for p in params:
        st = state.setdefault(id(p), {})
        grad = p.grad[None].clone()  # the chunk of one parameter
        buf = st.setdefault("momentum_buffer", torch.zeros_like(grad))
        buf.lerp_(grad, 1 - momentum)
        updated = grad.lerp_(buf, momentum)
        if p.label == "attn":  # [hdim, dim*4] -> [4, hdim, dim]
            updated = updated.view(4, grad.shape[1], grad.shape[2] // 4)
        rows, cols = p.shape
        if "second_momentum_buffer" not in st:
            like = updated[..., :, :1] if rows >= cols else updated[..., :1, :]
            st["second_momentum_buffer"] = torch.zeros_like(like)
        v = record_normuon_(record_38_polar_express(updated), st["second_momentum_buffer"], p.shape)
        eff_lr = lr * max(1.0, rows / cols) ** 0.5 * getattr(p, "lr_mul", 1.0)
        p.add_(-eff_lr * v.view(p.shape))


def test_six_steps_equal_record_42s_optimizers():
    """NorMuon (lr 0.03, c_fc x2, beta2 0.95; gates among its matrices) every step; DistAdam (lr 0.008 x
    lr_mul, betas 0.65/0.95, eps 1e-8) on odd steps on the gradients of two steps (#39), fp32."""
    from speedrun.train.schedule import apply_schedule
    from tests.fidelity.test_bos_align_optimizer import record_adam_step

    extra = ["model.embed_dtype=fp32", "model.fp8_head=false", "optim.muon_ns_dtype=fp32"]
    cfg, model, opt, ours = shrunk_with_optimizer(RECIPE, extra)
    dim = cfg.model.n_embd
    rec = {}  # the record's parameters: qkvo_w per layer as (d, 4d), c_fc and c_proj as (d, 4d)
    for name, p in ours.items():
        if name.endswith("attn.c_proj.weight"):
            continue
        if name.endswith("attn.c_attn.weight"):
            name = name.replace("c_attn", "qkvo")
            proj = ours[name.replace("qkvo", "c_proj")].detach()
            w = torch.cat([p.detach().view(3, dim, dim), proj[None]]).reshape(dim, 4 * dim)
        else:
            w = p.detach()
        assert not name.endswith("mlp.c_fc.weight") or w.shape == (dim, 4 * dim)  # #27: stored (d, 4d)
        rec[name] = torch.nn.Parameter(w.clone())
        rec[name].label = "attn" if "qkvo" in name else "other"
        is_muon = (name.startswith("blocks.") or "gate" in name) and w.ndim >= 2
        if is_muon:
            rec[name].lr_mul = 2.0 if name.endswith("mlp.c_fc.weight") else 1.0
        else:
            rec[name].lr_mul = (
                75.0 if name.startswith(("wte.", "value_embeds.")) else 1.0 if "lm_head" in name else 5.0
            )
    muon = [p for n, p in rec.items() if p.ndim >= 2 and (n.startswith("blocks.") or "gate" in n)]
    adam = [p for p in rec.values() if all(p is not q for q in muon)]
    assert "backout.lamb" in rec and any(p is rec["backout.lamb"] for p in adam)
    start = {n: p.detach().clone() for n, p in ours.items()}
    muon_state, adam_state = {}, {}
    gen = torch.Generator().manual_seed(1)
    assert cfg.train.steps == 10  # shrunk: LR 1 for steps 0-4, the cool-down from step 5
    for step in range(6):
        apply_schedule(schedule_at(step, cfg), opt, model)
        for p in ours.values():
            p.grad = torch.randn(p.shape, generator=gen)
        for name, w in rec.items():
            if "qkvo" in name:
                qkv, o = ours[name.replace("qkvo", "c_attn")].grad, ours[name.replace("qkvo", "c_proj")].grad
                g = torch.cat([qkv.view(3, dim, dim), o[None]]).reshape(dim, 4 * dim)
            else:
                g = ours[name].grad.clone()
            w.grad = g if w.grad is None else w.grad + g  # Adam's gradients are not cleared on even steps
        opt.step()
        opt.zero_grad()
        x = min(0.9999, step / cfg.train.steps)
        lr = 1.0 if x < 0.5 else (1 - x) / 0.5 + (1 - (1 - x) / 0.5) * 0.1
        record_normuon_step(muon, muon_state, 0.03 * lr, 0.85 + step / 300 * (0.95 - 0.85))
        for p in muon:
            p.grad = None
        if step % 2 == 1:
            record_adam_step(adam, adam_state, 0.008 * lr, betas=(0.65, 0.95), eps=1e-8)
            for p in adam:
                p.grad = None
    for name, p in ours.items():
        if "attn.c_" in name:
            q = rec[name.replace("c_attn", "qkvo").replace("c_proj", "qkvo")].detach().view(4, dim, dim)
            want = (q[:3].reshape(-1, dim) if "c_attn" in name else q[3]) - start[name]
        else:
            want = rec[name].detach() - start[name]
        got = p.detach() - start[name]
        assert want.norm() > 0, name
        assert (got - want).norm() <= 1e-5 * want.norm() + 1e-8, name


NOT_NORMUON = ["optim.name=muon", "optim.adam_every=1", "optim.mlp_fc_lr_mul=3"]


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["model.backout_layer=12"], "model.stream.backout_layer (12) must be below model.n_layer (12)"),
        (
            ["train.stages=", "model.yarn=false", "train.cooldown_start=fraction"],
            "train.cooldown_start=fraction has no effect while train.stages=''",
        ),
        (NOT_NORMUON, "optim.mlp_fc_lr_mul=3.0 has no effect while optim.name=muon"),
        (["optim.mlp_fc_lr_mul=0"], "optim.mlp_proj_lr_mul and mlp_fc_lr_mul > 0"),
        (["optim.normuon_square_stats=col"], "optim.normuon_square_stats"),
    ],
)
def test_a_bad_new_switch_is_one_config_error_naming_it(overrides, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_recipe(RECIPE, overrides)
