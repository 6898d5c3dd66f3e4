"""Recipe `stages-2025-12` against record #53's script (records/track_1_short/2025-12-22_MultiTokenPrediction,
the code at the top of each log), its formulas written here: the schedules (get_lr at every step;
get_bs, get_ws, the MTP weights, momentum, the scalars' pause, the untie step at chosen steps), the
fp32 forward loss and gradients of its model (FA3 replaced by a dense document-causal window mask, as
tests/fidelity/test_yarn_recipe.py), its initial scalars, eight steps of its optimizers (NorMuon with cautious
weight decay, the main DistAdam with cautious decay, the scalars' own DistAdam paused at a transition,
the tied embedding untied), and a short run of the shrunk recipe through the training loop. Each new
switch on its own: tests/fidelity/test_stages_switches.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from speedrun.model.families import build_model
from speedrun.recipes import load_recipe
from speedrun.train.schedule import apply_to_model, schedule_at
from tests.fidelity.checks import (
    assert_loss_and_gradients_are_the_records,
    fp32_model,
    jitter_,
    two_documents,
)
from tests.fidelity.refs import schedules
from tests.fidelity.refs.head import record_mtp_loss
from tests.fidelity.refs.yarn import windows_passed, yarn_through
from tests.recipe_matrix import replace

RECIPE = "stages-2025-12"


def record_key_shift(k: torch.Tensor) -> torch.Tensor:
    """#53's CausalSelfAttention lines (k: B, T, H, D), compiled semantics (the source read first)."""
    hd, src, k = k.size(-1), k.clone(), k.clone()
    k[:, 1:, :, hd // 4 : hd // 2] = src[:, :-1, :, hd // 4 : hd // 2]
    k[:, 1:, :, hd // 4 + hd // 2 :] = src[:, :-1, :, hd // 4 + hd // 2 :]
    return k


# ------------------------------------------------------------------ #53's schedules, from its code

N, EXT = 1880, 40
BS, WS, WS_FINAL, WS_POST_YARN = (8 * 2048 * 8, 16 * 2048 * 8, 24 * 2048 * 8), (3, 7, 11), 13, 20
PLAN_53 = """\
tokens=131072 doc=2048 windows=1/3 lr=1 frac=1/3 mtp=1,0.5,0.25>1,0.5,0; \
tokens=262144 doc=2048 windows=3/7 lr=1.52 frac=1/3 mtp=1,0.5>1,0; \
tokens=393216 doc=2048 windows=5/11 lr=1.73 frac=1/3; \
tokens=393216 doc=2048 windows=6/13 ext=40 val=6/20 yarn=13"""


def record_lr(step: int) -> float:
    """#53's get_lr (cooldown_frac 0.55)."""
    if step > N:
        return 0.1
    lr_max, x = 1.0, step / N
    if x > 1 / 3:
        lr_max = 1.52
    if x > 2 / 3:
        lr_max = 1.73
    if x >= 1 - 0.55:
        w = (1 - x) / 0.55
        return lr_max * w + (1 - w) * 0.1
    return lr_max


def record_bs_ws(step: int) -> tuple[int, int, int]:
    """#53's get_bs and get_ws (short = long // 2)."""
    if step >= N:
        return BS[-1], WS_FINAL // 2, WS_FINAL
    i = int(3 * (step / N))
    return BS[i], WS[i] // 2, WS[i]


def record_mtp(step: int) -> list[float]:
    """#53's mtp_weights_schedule."""
    x = step / N
    if x < 1 / 3:
        return [1.0, 0.5, 0.25 * (1 - 3 * x)]
    if x < 2 / 3:
        return [1.0, 0.5 * (1 - (3 * x - 1))]
    return [1.0]


def record_momentum(step: int) -> float:
    """#53's get_muon_momentum (300 warm-up steps, 50 cool-down steps of all 1,920, 0.85 ↔ 0.95)."""
    return schedules.muon_momentum(step, N + EXT)


def record_frozen(step: int) -> bool:
    """#52's scalar pause: 40 steps from each step whose batch or window differs from the step before."""
    changes = [s for s in range(1, step + 1) if record_bs_ws(s) != record_bs_ws(s - 1)]
    return bool(changes) and step - changes[-1] < 40


@pytest.mark.parametrize(
    "step", [0, 1, 300, 626, 627, 666, 667, 845, 846, 1000, 1253, 1254, 1293, 1294, 1700, 1879, 1880, 1919]
)
def test_schedule_at_chosen_steps_is_the_records(step):
    cfg = load_recipe(RECIPE)
    got = schedule_at(step, cfg)
    v = got.stage
    assert got.lr == pytest.approx(record_lr(step), rel=1e-12, abs=1e-15), step
    assert got.muon_momentum == pytest.approx(record_momentum(step), rel=1e-12), step
    assert (v.batch_tokens, v.short_window, v.long_window) == record_bs_ws(step), step
    assert v.max_doc_len == 2048
    assert v.mtp_weights == pytest.approx(record_mtp(step), rel=1e-12, abs=1e-15), step
    assert got.frozen == record_frozen(step), step
    final = schedule_at(N + EXT, cfg).stage
    assert (final.short_window, final.long_window) == (WS_FINAL // 2, WS_POST_YARN)


def test_the_lr_at_every_step_is_the_records():
    cfg = load_recipe(RECIPE)
    got = [schedule_at(s, cfg).lr for s in range(N + EXT)]
    assert got == pytest.approx([record_lr(s) for s in range(N + EXT)], rel=1e-12, abs=1e-15)


def test_the_untie_step_and_batch_rows_are_the_records():
    """#53: split_step = ceil(2/3 · 1880); copy_lm_to_embed after step (split_step − 2) | 1, an Adam
    (odd) step, so `optim.tie_until` steps run tied; 8 rows of tokens/8 per step (8 ranks x 1)."""
    import math

    cfg = load_recipe(RECIPE)
    split_step = math.ceil(2 / 3 * N)
    assert cfg.optim.tie_until == ((split_step - 2) | 1) + 1 == split_step == 1254
    assert cfg.optim.adam_every == 2 and ((split_step - 2) | 1) % 2 == 1
    assert cfg.train.document_rows == 8
    for step in (0, 627, 1254):
        assert schedule_at(step, cfg).stage.batch_tokens // 8 == record_bs_ws(step)[0] // 8


# ------------------------------------------------------------------ #53's model, from its code

BLOCK = 128


def record_53_forward(
    w, input_seq, target_seq, seqlens, ws_short, ws_long, yarn, scale, mtp, heads, dim, training
):
    """#53's GPT.forward (fp32: no FP8), the summed (MTP) loss in training; its resid lambdas are our
    blocks.i.lambdas, its x0_lambdas our blocks.i.x0_lambda, its sa_lambdas our attn.lambdas."""
    from tests.fidelity.test_polar_recipe import record_rotary
    from tests.fidelity.test_yarn_recipe import fa3_reference, norm, record_qkvo

    L, hd, T = 11, dim // heads, len(input_seq)
    cos, sin = yarn.cos.bfloat16().float(), yarn.sin.bfloat16().float()
    skip_connections, skip_in, skip_out, backout_layer = [], [3], [6], 7
    short_bm, long_bm = ws_short * BLOCK, ws_long * BLOCK
    bm_sizes = [
        short_bm,
        short_bm,
        short_bm,
        long_bm,
        short_bm,
        short_bm,
        None,
        short_bm,
        short_bm,
        short_bm,
        long_bm,
    ]
    key_shift = [b == long_bm for b in bm_sizes]
    x = F.embedding(input_seq, w["wte.weight"])  # tied: the head's rows; split: the embedding's
    ve = [F.embedding(input_seq, w[f"value_embeds.{i}.weight"]) for i in range(3)]
    ve = [ve[1], ve[2]] + [None] * (L - 5) + [ve[0], ve[1], ve[2]]
    smear_gate = w["smear.gate.weight"]
    gate_out = w["smear.lamb"] * torch.sigmoid(F.linear(x[1:, : smear_gate.size(-1)], smear_gate))
    x = torch.cat([x[:1], x[1:] + gate_out * x[:-1]])
    x = x0 = norm(x[None])
    x_backout = None
    for i in range(L):
        if i in skip_out:
            x = x + torch.sigmoid(w["skip_weights"][0]) * skip_connections.pop()
        resid, x0_lambda = w[f"blocks.{i}.lambdas"][0], w[f"blocks.{i}.x0_lambda"][0]
        x = (resid + x0_lambda) * x if i == 0 else resid * x + x0_lambda * x0
        if bm_sizes[i] is not None:
            h = norm(x)
            sa = w[f"blocks.{i}.attn.lambdas"]
            qkvo_w = record_qkvo(w, i, dim)
            q, k, v = (
                F.linear(h, sa[0] * qkvo_w[:3].flatten(end_dim=1)).view(1, T, 3 * heads, hd).chunk(3, dim=-2)
            )
            q, k = norm(q), norm(k)
            q, k = record_rotary(q, cos, sin), record_rotary(k, cos, sin)
            if key_shift[i]:
                k = record_key_shift(k)
            if ve[i] is not None:
                v = v + ve[i].view_as(v)
            y = fa3_reference(q[0], k[0], v[0], seqlens, bm_sizes[i], scale).view(1, T, heads, hd)
            gate = w[f"blocks.{i}.attn.gate.proj.weight"]
            y = y * torch.sigmoid(F.linear(h[..., : gate.size(-1)], gate)).view(1, T, heads, 1)
            x = x + F.linear(y.contiguous().view(1, T, dim), sa[1] * qkvo_w[3])
        h = F.linear(norm(x), w[f"blocks.{i}.mlp.c_fc.weight"])
        x = x + F.linear(F.relu(h).square(), w[f"blocks.{i}.mlp.c_proj.weight"])
        if i in skip_in:
            skip_connections.append(x)
        if i == backout_layer:
            x_backout = x
    x = x - w["backout.lamb"] * x_backout
    logits = 30 * torch.sigmoid(F.linear(norm(x), w["lm_head.weight"]) / 7.5)[0]
    if training and len(mtp) > 1:
        return record_mtp_loss(logits, target_seq, torch.tensor(mtp))
    return F.cross_entropy(logits, target_seq, reduction="sum" if training else "mean")


@pytest.mark.parametrize("step", [100, 700, N + EXT])  # MTP 3 (windows 1/3), MTP 2 (YaRN 3 → 7), validation
def test_forward_loss_and_gradients_match_the_53_model_in_fp32(step):

    from tests.fidelity.test_yarn_recipe import RecordYarn

    heads, dim, T, vocab = 2, 64, 1024, 120
    cfg, model = fp32_model(RECIPE, n_head=heads, n_embd=dim, vocab_size=vocab, max_seq_len=T)
    jitter_(model, 0.02)
    x, y, cu = two_documents(vocab, T)
    training = step < N + EXT
    model.train(training)
    apply_to_model(schedule_at(step, cfg), model)
    _, ws_short, ws_long = record_bs_ws(step)
    ws_long = WS_POST_YARN if not training else ws_long
    yarn = RecordYarn(dim // heads, T)
    seen = windows_passed(WS[0], lambda s: record_bs_ws(s)[2], min(step, N + EXT - 1))
    scale = yarn_through(yarn, seen)
    weights = {n: p.detach().clone().requires_grad_(training) for n, p in model.named_parameters()}
    with torch.set_grad_enabled(training):
        loss = model(x[None], y[None], cu)
        ref = record_53_forward(
            weights, x, y, cu, ws_short, ws_long, yarn, scale, record_mtp(step), heads, dim, training
        )
    assert_loss_and_gradients_are_the_records(model, loss, ref, weights, T, training)


def test_initial_scalars_are_the_53_models():
    """#53's GPT.__init__: resid lambdas 1.1 (#45), x0 lambdas 0, sa lambdas (0.5, 1.0), skip λ −1.5, smear
    λ 0, backout λ 0.5; value embeddings on layers 0, 1 (tables 1, 2) and 8, 9, 10 (tables 0, 1, 2)."""
    cfg = load_recipe(RECIPE)
    model = build_model(replace(cfg.model, n_head=2, n_embd=64, vocab_size=120, max_seq_len=256))
    for i, block in enumerate(model.blocks):
        assert (block.lambdas.tolist(), block.x0_lambda.tolist()) == (pytest.approx([1.1]), [0.0]), i
        assert block.attn is None if i == 6 else block.attn.lambdas.tolist() == [0.5, 1.0], i
    skip_sources = [s.skip_from for s in model.specs]
    assert model.skip_weights.tolist() == [-1.5] and skip_sources == [None] * 6 + [3] + [None] * 4
    assert (model.smear.lamb.item(), model.backout.lamb.item()) == (0.0, 0.5)
    assert [s.value_embed for s in model.specs] == [1, 2] + [None] * 6 + [0, 1, 2]


# ------------------------------------------------------------------ #53's optimizers, from its code


def record_cautious_wd_and_update_(p, v, wd, lr):
    """#53's cautious_wd_and_update_inplace."""
    mask = (v * p) >= 0
    p.copy_(p - (p * mask * wd * lr) - (v * lr))


def record_normuon_variance_(v, buf, beta2, red_dim):
    """#53's apply_normuon_variance_reduction (fp32)."""
    v_mean = v.float().square().mean(dim=red_dim, keepdim=True)
    red_dim_size = v.size(red_dim)
    v_norm = v_mean.sum(dim=(-2, -1), keepdim=True).mul_(red_dim_size).sqrt_()
    buf.lerp_(v_mean, 1 - beta2)
    step_size = buf.clamp_min(1e-10).rsqrt()
    scaled_sq_sum = (v_mean * red_dim_size) * step_size.square()
    v_norm_new = scaled_sq_sum.sum(dim=(-2, -1), keepdim=True).sqrt_()
    return v * (step_size * (v_norm / v_norm_new.clamp_min_(1e-10)))


@torch.no_grad()
def record_normuon_step(params, state, lr, momentum, wd=1.2, beta2=0.95):
    """#53's NorMuon.step for world_size 1, per parameter (its groups stack same-label parameters; the
    statistics stay per parameter), polar_express in fp32."""
    from tests.fidelity.refs.newton_schulz import record_38_polar_express

    for p in params:
        st = state.setdefault(id(p), {})
        grad = p.grad[None].clone()
        buf = st.setdefault("momentum_buffer", torch.zeros_like(grad))
        buf.lerp_(grad, 1 - momentum)
        updated = grad.lerp_(buf, momentum)
        if p.label == "attn":
            updated = updated.view(4 * 1, grad.shape[1] // 4, grad.shape[2])
        is_gate = p.label == "attn_gate"
        rows, cols = p.shape
        if "second_momentum_buffer" not in st:
            like = updated[..., :, :1] if is_gate or rows >= cols else updated[..., :1, :]
            st["second_momentum_buffer"] = torch.zeros_like(like)
        v = record_38_polar_express(updated)
        red_dim = -1 if (is_gate or rows >= cols) else -2
        v = record_normuon_variance_(v, st["second_momentum_buffer"], beta2, red_dim).view(1, rows, cols)
        eff_lr = lr * max(1.0, rows / cols) ** 0.5 * getattr(p, "lr_mul", 1.0)
        record_cautious_wd_and_update_(p, v[0], wd * lr * getattr(p, "wd_mul", 1.0), eff_lr)


@torch.no_grad()
def record_dist_adam_step(params, state, lr, betas, eps=1e-8, wd=0.005):
    """#53's DistAdam.step for world_size 1: lr·lr_mul, cautious decay lr·wd·wd_mul·lr."""
    beta1, beta2 = betas
    for p in params:
        if p.grad is None:
            continue
        st = state.setdefault(id(p), {})
        if not st:
            st["step"], st["exp_avg"], st["exp_avg_sq"] = 0, torch.zeros_like(p), torch.zeros_like(p)
        plr = lr * p.lr_mul
        st["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
        st["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        st["step"] += 1
        t = st["step"]
        bias1, bias2 = 1 - beta1**t, 1 - beta2**t
        update = st["exp_avg"].div(st["exp_avg_sq"].sqrt().add_(eps)).mul_(plr * (bias2**0.5 / bias1))
        mask = (update * p) > 0
        update.addcmul_(p, mask, value=plr * wd * p.wd_mul * plr)
        p.add_(other=update, alpha=-1.0)


def test_eight_steps_equal_record_53s_optimizers():
    """NorMuon every step (lr 0.023, cautious wd 1.2, gates' statistics per head, the MLP's (3072, 768)
    layout: x2 shape LR on both, c_proj lr_mul 2); on odd steps the main DistAdam (betas 0.65/0.95, wd
    0.005, smear gate lr x0.01, x0 lambdas x5) and the scalars' DistAdam (0.9/0.99, x5), paused (its
    gradients dropped) from a transition for `transition_steps`; the embedding tied to the head until the
    untie step, then continuing from the head's weights and Adam state (copy_lm_to_embed). Shrunk: 10
    steps, the second stage from step 5, untie at 4, pause 2 steps; fp32."""
    from speedrun.optim.build import build_optimizer
    from speedrun.train.schedule import apply_schedule
    from tests.recipe_matrix import shrink

    extra = ["model.embed_dtype=fp32", "model.fp8_head=false", "optim.muon_ns_dtype=fp32"]
    extra += ["optim.tie_until=4", "optim.scalar_freeze_steps=2"]
    cfg = load_recipe(RECIPE, [*shrink(RECIPE), *extra])
    dim = cfg.model.n_embd
    torch.manual_seed(0)
    model = build_model(cfg.model)
    opt = build_optimizer(model, cfg)  # the embedding starts as a copy of the head
    ours = dict(model.named_parameters())
    torch.testing.assert_close(ours["wte.weight"], ours["lm_head.weight"], rtol=0, atol=0)
    rec, muon, adam, scalars = {}, [], [], []
    for name, p in ours.items():
        if name.endswith("attn.c_proj.weight"):
            continue
        if name.endswith("attn.c_attn.weight"):
            name = name.replace("c_attn", "qkvo")
            w, label = torch.cat([p.detach(), ours[name.replace("qkvo", "c_proj")].detach()]), "attn"
        elif name.endswith("mlp.c_proj.weight"):
            w, label = p.detach().T, "mlp"  # the record stores it (4d, d)
        else:
            w = p.detach()
            label = "mlp" if "mlp." in name else "attn_gate" if "attn.gate" in name else "adam"
        r = rec[name] = torch.nn.Parameter(w.clone())
        r.label, r.lr_mul, r.wd_mul = label, 1.0, 1.0
        if label != "adam":
            r.lr_mul = 2.0 if name.endswith("mlp.c_proj.weight") else 1.0
            muon.append(r)
        elif name.startswith("value_embeds."):
            r.lr_mul = 75.0
            adam.append(r)
        elif name in ("wte.weight", "lm_head.weight"):
            adam.append(r)
        elif name == "smear.gate.weight":
            r.lr_mul, r.wd_mul = 0.01, 0.0
            adam.append(r)
        elif name.endswith(".x0_lambda"):
            r.lr_mul, r.wd_mul = 5.0, 0.0
            adam.append(r)
        else:
            r.lr_mul, r.wd_mul = 5.0, 0.0
            scalars.append(r)
    assert len(scalars) >= 4 and any(n.endswith(".x0_lambda") for n in rec)
    start = {n: p.detach().clone() for n, p in ours.items()}
    muon_state, adam_state, scalar_state = {}, {}, {}
    tied, transition_left = True, 0
    gen = torch.Generator().manual_seed(1)
    assert cfg.train.steps == 10
    for step in range(8):
        apply_schedule(schedule_at(step, cfg), opt, model)
        for p in ours.values():
            p.grad = torch.randn(p.shape, generator=gen)
        for name, w in rec.items():
            if "qkvo" in name:
                g = torch.cat(
                    [ours[name.replace("qkvo", "c_attn")].grad, ours[name.replace("qkvo", "c_proj")].grad]
                )
            elif name.endswith("mlp.c_proj.weight"):
                g = ours[name].grad.T.clone()
            else:
                g = ours[name].grad.clone()
            if tied and name == "wte.weight":  # F.embedding(input, lm_head.weight): the head gets it
                w = rec["lm_head.weight"]
            w.grad = g if w.grad is None else w.grad + g  # Adam's gradients are not cleared on even steps
        opt.step()
        opt.zero_grad()
        # the record's step_optimizers
        x = step / 10
        lr = 1.0 if x < 1 - 0.55 else (1 - x) / 0.55 + (1 - (1 - x) / 0.55) * 0.1
        if step == 5:  # the second stage's first step: a transition
            transition_left = 2
        in_transition = transition_left > 0
        transition_left -= in_transition
        record_normuon_step(muon, muon_state, 0.023 * lr, 0.85 + step / 300 * (0.95 - 0.85))
        for p in muon:
            p.grad = None
        if step % 2 == 1:
            record_dist_adam_step(adam, adam_state, 0.008 * lr, (0.65, 0.95))
            if not in_transition:
                record_dist_adam_step(scalars, scalar_state, 0.008 * lr, (0.9, 0.99))
            for p in adam + scalars:
                p.grad = None
        if in_transition:
            for p in scalars:
                p.grad = None
        if tied:
            rec["wte.weight"].data.copy_(rec["lm_head.weight"].data)  # one matrix while tied
        if step == (4 - 2) | 1:  # copy_lm_to_embed after the last tied Adam step
            head, embed = rec["lm_head.weight"], rec["wte.weight"]
            adam_state[id(embed)] = {
                k: v.clone() if torch.is_tensor(v) else v for k, v in adam_state[id(head)].items()
            }
            embed.data.copy_(head.data)
            tied = False
    bad = []
    for name, p in ours.items():
        if "attn.c_" in name:
            q = rec[name.replace("c_attn", "qkvo").replace("c_proj", "qkvo")].detach()
            want = (q[: 3 * dim] if "c_attn" in name else q[3 * dim :]) - start[name]
        elif name.endswith("mlp.c_proj.weight"):
            want = rec[name].detach().T - start[name]
        else:
            want = rec[name].detach() - start[name]
        got = p.detach() - start[name]
        assert want.norm() > 0, name
        if (got - want).norm() > 1e-5 * want.norm() + 1e-8:
            bad.append(f"{name}: {(got - want).norm() / want.norm():.2e}")
    assert not bad, bad


@pytest.mark.slow
def test_the_shrunk_recipe_trains_through_the_loop_with_its_switches(text_data, tmp_path):
    """The training loop on the shrunk recipe: stages with MTP weights, the scalars' pause, tie → untie."""
    import json

    from speedrun.train import loop
    from tests.recipe_matrix import shrink

    eot = json.loads((text_data / "meta.json").read_text())["eot_id"]
    plan = (
        "tokens=256 doc=64 windows=1/1 frac=1/2 mtp=1,0.5,0.25>1,0.5,0; "
        "tokens=512 windows=1/2 lr=1.5 frac=1/2 mtp=1,0.5>1,0; tokens=512 windows=1/2 ext=2 val=1/3 yarn=2"
    )
    over = [*shrink(RECIPE), f"data.dir={text_data}", "data.tokenizer=bpe:512", f"model.eot_id={eot}",
            "model.vocab_size=512", "model.embed_dtype=fp32", "model.fp8_head=false",
            "optim.muon_ns_dtype=fp32",
            "train.seq_len=128", "train.micro_batch_tokens=128", "train.global_batch_tokens=512",
            "model.max_seq_len=512", "train.val_seq_len=512", "train.val_tokens=2048", "train.steps=8",
            f"train.stages={plan}", "optim.tie_until=4", "optim.scalar_freeze_steps=2", "train.log_every=1",
            "data.max_docs=0"]  # fmt: skip
    cfg = load_recipe(RECIPE, over)
    seen = []
    real = loop.train_step

    def recording_step(model, *args):
        inner = getattr(model, "module", model)
        seen.append(inner.mtp_weights.tolist())
        return real(model, *args)

    loop.train_step = recording_step
    try:
        loop.train(cfg, tmp_path / "run")
    finally:
        loop.train_step = real
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) for r in lines if "loss" in r)
    assert seen[0] == pytest.approx([1.0, 0.5, 0.25]) and seen[-1] == pytest.approx([1.0, 0.0, 0.0])
