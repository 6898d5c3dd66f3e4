"""The banks-2026-01 recipe against record #65 (records/track_1_short/2026-01-30_VeFused, the code at the
top of each log): its TrainingSchedule and get_muon_momentum at every step (LR, momentum, batch,
windows, MTP weights, untie step, no scalar pause, grad_scale 2), its parameter count from its
tensors, eight optimizer steps against its NorMuonAndAdam (param_table, work order, tie) written here
from its code on a shrunk model in fp32. Its model: tests/fidelity/test_banks_model.py; the model's parts
(#54–#63) against their records: tests/fidelity/test_banks_switches.py."""

from __future__ import annotations

import math

import pytest
import torch

from speedrun.model.families import build_model
from speedrun.recipes import load_recipe
from speedrun.train.schedule import schedule_at
from tests.fidelity.checks import shrunk_with_optimizer
from tests.fidelity.refs import schedules
from tests.fidelity.test_banks_switches import RECORD_65_ADAM, record_65_label
from tests.fidelity.test_record_2026 import RecordSchedule

RECIPE = "banks-2026-01"
N, EXT = 1535, 40  # args.num_scheduled_iterations, num_extension_iterations

# #65's TRAINING_STAGES: (duration, batch_size, window_sizes, lr_mul, mtp_weights_start, mtp_weights_end)
STAGES_65 = [
    (1 / 3, 8 * 2048 * 8, (1, 3), 1.0, [1.0, 0.5, 0.25], [1.0, 0.5, 0.0]),
    (1 / 3, 16 * 2048 * 8, (3, 7), 1.52, [1.0, 0.5], [1.0, 0.0]),
    (1 / 3, 24 * 2048 * 8, (5, 11), 1.73, [1.0], [1.0]),
    (None, 24 * 2048 * 8, (6, 13), 1.0, [1.0], [1.0]),
]


class RecordSchedule65(RecordSchedule):
    """#65's TrainingSchedule (cooldown_frac 0.55, split_embed_stage 2, ws_post_yarn_ext 20): #82's class on
    #65's stages, whose lr_mul is their fourth entry, with get_lr's floor 0.1."""

    stages, lr_index, lr_floor = STAGES_65, 3, 0.1

    def __init__(self, scheduled: int = N, extension: int = EXT, cooldown_frac: float = 0.55):
        super().__init__(scheduled, extension, cooldown_frac)

    def mtp_weights(self, step: int) -> list[float]:
        stage, t = self.lookup(step)
        return [a + (b - a) * t for a, b in zip(stage[4], stage[5], strict=True)]


# get_muon_momentum: #42's lines, kept to #89
record_muon_momentum = schedules.muon_momentum


def test_the_schedule_at_every_step_is_the_records():
    cfg = load_recipe(RECIPE)
    rec = RecordSchedule65()
    assert cfg.train.steps == rec.total_steps == 1575
    assert rec.boundaries == [(0, 512), (512, 1023), (1023, 1535), (1535, 1575)]
    for step in range(rec.total_steps):
        got, stage = schedule_at(step, cfg), rec.lookup(step)[0]
        v = got.stage
        assert got.lr == pytest.approx(rec.get_lr(step), rel=1e-12, abs=1e-15), step
        assert got.muon_momentum == pytest.approx(record_muon_momentum(step, rec.total_steps), rel=1e-12), (
            step
        )
        assert (v.batch_tokens, (v.short_window, v.long_window)) == (stage[1], stage[2]), step
        assert v.mtp_weights == pytest.approx(rec.mtp_weights(step), rel=1e-12, abs=1e-15), step
        assert not got.frozen, step  # #65: the scalars are no longer paused at transitions
        # grad_scale = 2 / grad_accum_steps on 8 ranks, each back-propagating its summed loss
        assert got.grad_scale == pytest.approx(2 * stage[1] / 8, rel=1e-15), step
    final = schedule_at(rec.total_steps, cfg).stage  # apply_final_ws_ext: the long window 20
    assert (final.short_window, final.long_window) == (6, 20)
    # copy_lm_state_to_embed after step split_step (odd, an Adam step): our optimizer unties after it
    assert rec.split_step == 1023 and cfg.optim.tie_until == rec.split_step + 1
    assert cfg.optim.adam_every == 2


def record_65_param_count(vocab: int = 50304, d: int = 768, layers: int = 11, heads: int = 6) -> int:
    """#65's GPT.__init__ tensors (world size 1: no padding of the scalars or banks)."""
    embed = head = vocab * d
    value_embeds = 5 * vocab * d
    bigram = 50304 * 5 * d
    attn_bank = 10 * 4 * d * d  # no attention on layer 6
    mlp_bank = layers * 2 * 4 * d * d
    gates = 12 + 12 + 10 * heads * 12 + 5 * heads * 12  # smear, skip, attention and value-embedding gates
    scalars = (
        layers + 2 * layers + layers + 3
    )  # resid, SA (two per layer), bigram lambdas; smear, backout, skip
    return embed + head + value_embeds + bigram + attn_bank + mlp_bank + gates + layers + scalars


def test_the_parameter_count_is_the_records_without_layer_6s_attention_lambdas():
    """Ours has no λ pair for layer 6's attention, which #65 allocates (and never reads)."""
    cfg = load_recipe(RECIPE)
    with torch.device("meta"):
        model = build_model(cfg.model)
    ours = sum(p.numel() for p in model.parameters())
    assert ours == record_65_param_count() - 2 == 539_100_296


# ------------------------------------------------------------------ #65's NorMuonAndAdam, from its code


@torch.no_grad()
def record_normuon_matrix_(p, g, st, lr, lr_mul, momentum, wd=1.2, beta2=0.95):
    """#65's _normuon_update on one matrix (world 1, fp32: the mantissa holds zeros): eff_lr = lr_mul·lr
    (shape and per-matrix multipliers), eff_wd = wd·lr (the schedule's lr alone)."""
    from tests.fidelity.refs.newton_schulz import record_38_polar_express

    buf = st.setdefault("momentum_buffer", torch.zeros_like(g))
    g = g.float().clone()
    buf.lerp_(g, 1 - momentum)
    updated = g.lerp_(buf, momentum)
    v = record_38_polar_express(updated[None])
    rows, cols = g.shape
    red_dim = -1 if rows >= cols else -2
    sq = st.setdefault("second", torch.zeros((1, rows, 1) if red_dim == -1 else (1, 1, cols)))
    v_mean = v.square().mean(dim=red_dim, keepdim=True)
    size = v.size(red_dim)
    v_norm = v_mean.sum(dim=(-2, -1), keepdim=True).mul_(size).sqrt_()
    sq.lerp_(v_mean, 1 - beta2)
    step_size = sq.clamp_min(1e-10).rsqrt()
    v_norm_new = ((v_mean * size) * step_size.square()).sum(dim=(-2, -1), keepdim=True).sqrt_()
    v = (v * (step_size * (v_norm / v_norm_new.clamp_min_(1e-10))))[0]
    mask = (v * p) >= 0
    eff_lr, eff_wd = lr_mul * lr, wd * lr
    p.copy_(p - (p * mask * eff_wd * eff_lr) - (v * eff_lr))


@torch.no_grad()
def record_adam_(p, g, st, lr, betas, wd_mul, eps=1e-10, wd=0.005):
    """#65's _adam_update / _adam_update_step (lr already x lr_mul)."""
    beta1, beta2 = betas
    if not st:
        st["step"], st["exp_avg"], st["exp_avg_sq"] = 0, torch.zeros_like(p), torch.zeros_like(p)
    st["step"] += 1
    t = st["step"]
    st["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
    st["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
    update = (
        st["exp_avg"]
        .div(st["exp_avg_sq"].sqrt().add_(eps))
        .mul_(lr * ((1 - beta2**t) ** 0.5 / (1 - beta1**t)))
    )
    mask = (update * p) > 0
    update.addcmul_(p, mask, value=lr * lr * wd * wd_mul)
    p.add_(other=update, alpha=-1.0)


@pytest.mark.parametrize("beta2", [0.95, 0.9])  # #65's normuon_defaults; #78's (optim.normuon_beta2)
def test_eight_steps_equal_record_65s_normuon_and_adam(beta2):
    """NorMuon every step on Q, K, V, O as four square matrices (attn_bank.reshape: no shape multiplier),
    c_fc and c_proj as (3072, 768) (shape x2, c_proj x2 more); Adam on odd steps with the param_table's
    betas, LR and decay multipliers, the gradients kept over even steps; the embedding tied to the head
    until copy_lm_state_to_embed. Shrunk: 10 steps, untie after step 3, fp32."""
    from speedrun.train.schedule import apply_schedule

    extra = ["model.embed_dtype=fp32", "model.fp8_head=false", "optim.muon_ns_dtype=fp32"]
    extra += ["optim.tie_until=4", "model.bigram_rows=300", "model.block_dtype=fp32"]
    extra += [f"optim.normuon_beta2={beta2}"] * (beta2 != 0.95)
    cfg, model, opt, ours = shrunk_with_optimizer(RECIPE, extra)
    d = cfg.model.n_embd
    for p in ours.values():  # the zero-initialized parts move too, so every update is seen
        with torch.no_grad():
            p.add_(torch.randn_like(p) * 0.02)
    ours["wte.weight"].data.copy_(ours["lm_head.weight"].data)
    start = {n: p.detach().clone() for n, p in ours.items()}
    rec = {n: p.detach().clone() for n, p in ours.items()}
    state: dict = {}
    adam_grads: dict[str, torch.Tensor] = {}
    tied = True
    gen = torch.Generator().manual_seed(1)
    for step in range(8):
        apply_schedule(schedule_at(step, cfg), opt, model)
        for p in ours.values():
            p.grad = torch.randn(p.shape, generator=gen)
        grads = {n: p.grad.clone() for n, p in ours.items()}
        opt.step()
        opt.zero_grad()
        # the record's step_optimizers: lr = initial_lr · get_lr, do_adam on odd steps
        sched = 1.0 if step < 4 else (1 - (step - 4) / 6) + 0.1 * (step - 4) / 6
        momentum = 0.85 + step / 300 * (0.95 - 0.85)
        for name, w in rec.items():
            g = grads[name]
            if name.endswith("attn.c_attn.weight") or name.endswith("attn.c_proj.weight"):
                for j, (wm, gm) in enumerate(zip(w.split(d), g.split(d), strict=True)):
                    record_normuon_matrix_(
                        wm, gm, state.setdefault((name, j), {}), 0.023 * sched, 1.0, momentum, beta2=beta2
                    )
            elif name.endswith("mlp.c_fc.weight"):
                record_normuon_matrix_(
                    w, g, state.setdefault(name, {}), 0.023 * sched, 2.0, momentum, beta2=beta2
                )
            elif name.endswith("mlp.c_proj.weight"):  # stored (3072, 768) in the record's bank
                wt = w.T.clone()
                record_normuon_matrix_(
                    wt, g.T, state.setdefault(name, {}), 0.023 * sched, 4.0, momentum, beta2=beta2
                )
                w.copy_(wt.T)
            else:
                adam_grads[name] = adam_grads.get(name, 0) + g  # not cleared on even steps
        if step % 2 == 1:
            if tied:  # lm_head.grad += embed.grad.T; embed skipped, then copied from the head
                adam_grads["lm_head.weight"] = adam_grads["lm_head.weight"] + adam_grads.pop("wte.weight")
            for name, g in adam_grads.items():
                betas, lr_mul, wd_mul = RECORD_65_ADAM[record_65_label(name)]
                record_adam_(rec[name], g, state.setdefault(name, {}), 0.008 * sched * lr_mul, betas, wd_mul)
            adam_grads.clear()
            if tied:
                rec["wte.weight"].copy_(rec["lm_head.weight"])
            if step == 3:  # copy_lm_state_to_embed at the split step
                head = state["lm_head.weight"]
                state["wte.weight"] = {k: v.clone() if torch.is_tensor(v) else v for k, v in head.items()}
                tied = False
    assert not tied
    bad = []
    for name, p in ours.items():
        want, got = rec[name] - start[name], p.detach() - start[name]
        assert want.norm() > 0, name
        if (got - want).norm() > 1e-5 * want.norm() + 1e-8:
            bad.append(f"{name}: {(got - want).norm() / want.norm():.2e}")
    assert not bad, bad
    assert {record_65_label(n) for n in ours if "mlp.c_" not in n and "attn.c_" not in n} == set(
        RECORD_65_ADAM
    )
    assert math.isclose(cfg.optim.muon_lr, 0.023)


def test_the_recipes_softcap_is_65s_eval_line():
    """#65 evaluates `23 * torch.sigmoid((logits + 5) / 7.5)` on the bf16 head output (the function is
    checked bit for bit in fidelity/test_banks_switches.py; the dtype order in
    fidelity/test_softcap_dtype.py)."""
    m = load_recipe(RECIPE).model
    assert (2 * m.head.softcap, m.head.softcap_offset, m.head.softcap_divisor, m.head.softcap_in_bf16) == (
        23,
        5,
        7.5,
        True,
    )
