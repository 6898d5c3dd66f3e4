"""The banks-2026-01 recipe against record #65 (records/track_1_short/2026-01-30_VeFused, the code at the
top of each log): its TrainingSchedule and get_muon_momentum at every step (LR, momentum, batch,
windows, MTP weights, untie step, no scalar pause, grad_scale 2), its parameter count from its
tensors, eight optimizer steps against its NorMuonAndAdam (param_table, work order, tie) written here
from its code on a shrunk model in fp32, its interleaved rotary, bf16 block storage (#57) and the fp32
forward loss and gradients of its model. The model's parts (#54–#63) are tested against their
records in tests/test_banks_switches.py."""

from __future__ import annotations

import dataclasses
import math
from itertools import accumulate

import pytest
import torch

from speedrun.model.families import build_model
from speedrun.recipes import load_recipe
from speedrun.train.schedule import apply_to_model, schedule_at
from tests.test_banks_switches import RECORD_65_ADAM, record_65_label

RECIPE = "banks-2026-01"
N, EXT = 1535, 40  # args.num_scheduled_iterations, num_extension_iterations

# #65's TRAINING_STAGES: (duration, batch_size, window_sizes, lr_mul, mtp_weights_start, mtp_weights_end)
STAGES_65 = [
    (1 / 3, 8 * 2048 * 8, (1, 3), 1.0, [1.0, 0.5, 0.25], [1.0, 0.5, 0.0]),
    (1 / 3, 16 * 2048 * 8, (3, 7), 1.52, [1.0, 0.5], [1.0, 0.0]),
    (1 / 3, 24 * 2048 * 8, (5, 11), 1.73, [1.0], [1.0]),
    (None, 24 * 2048 * 8, (6, 13), 1.0, [1.0], [1.0]),
]


class RecordSchedule65:
    """#65's TrainingSchedule (cooldown_frac 0.55, split_embed_stage 2, ws_post_yarn_ext 20)."""

    def __init__(self, scheduled: int = N, extension: int = EXT, cooldown_frac: float = 0.55):
        self.scheduled, self.cooldown_frac = scheduled, cooldown_frac
        self.total_steps = scheduled + extension
        cum = accumulate(s[0] for s in STAGES_65[:-1])
        ends = [0] + [round(c * scheduled) for c in cum] + [self.total_steps]
        assert ends[-2] == scheduled
        self.boundaries = list(zip(ends[:-1], ends[1:], strict=True))
        self.split_step = self.boundaries[2][0] | 1

    def lookup(self, step: int):
        for i, (start, end) in enumerate(self.boundaries):
            if step < end:
                return STAGES_65[i], (step - start) / (end - start)
        return STAGES_65[-1], 1.0

    def get_lr(self, step: int) -> float:
        stage, _ = self.lookup(step)
        lr = stage[3]
        cd_start = int(self.scheduled * (1 - self.cooldown_frac))
        if step >= cd_start:
            t = min(1.0, (step - cd_start) / (self.scheduled - cd_start))
            lr = lr * (1 - t) + 0.1 * t
        return lr

    def mtp_weights(self, step: int) -> list[float]:
        stage, t = self.lookup(step)
        return [a + (b - a) * t for a, b in zip(stage[4], stage[5], strict=True)]


def record_muon_momentum(step: int, total: int) -> float:
    """#65's get_muon_momentum (warm-up 300, cool-down 50, 0.85 ↔ 0.95)."""
    cd_start = total - 50
    if step < 300:
        return 0.85 + step / 300 * (0.95 - 0.85)
    if step > cd_start:
        return 0.95 - (step - cd_start) / 50 * (0.95 - 0.85)
    return 0.95


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
    from tests.test_polar_recipe import record_polar_express

    buf = st.setdefault("momentum_buffer", torch.zeros_like(g))
    g = g.float().clone()
    buf.lerp_(g, 1 - momentum)
    updated = g.lerp_(buf, momentum)
    v = record_polar_express(updated[None])
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
    from speedrun.train.optimizers import build_optimizer
    from speedrun.train.schedule import apply_schedule
    from tests.recipe_matrix import shrink

    extra = ["model.embed_dtype=fp32", "model.fp8_head=false", "optim.muon_ns_dtype=fp32"]
    extra += ["optim.tie_until=4", "model.bigram_rows=300", "model.block_dtype=fp32"]
    extra += [f"optim.normuon_beta2={beta2}"] * (beta2 != 0.95)
    cfg = load_recipe(RECIPE, [*shrink(RECIPE), *extra])
    d = cfg.model.n_embd
    torch.manual_seed(0)
    model = build_model(cfg.model)
    opt = build_optimizer(model, cfg)
    ours = dict(model.named_parameters())
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
    checked bit for bit in tests/test_banks_switches.py; the dtype order in tests/test_softcap_dtype.py)."""
    m = load_recipe(RECIPE).model
    assert (2 * m.logit_softcap, m.softcap_offset, m.softcap_divisor, m.softcap_in_bf16) == (23, 5, 7.5, True)


# ------------------------------------------------------------------ #65's interleaved rotary pairs


def record_65_rotary_tables(head_dim: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """#65's Yarn.reset (not paired; fp32 here, the record casts to bf16): interleaved pairs (2i, 2i+1)
    share a frequency, the upper half of the dims is stationary; factor2's odd entries negated."""
    angular_freq = (1 / 1024) ** torch.linspace(0, 1, steps=head_dim // 4, dtype=torch.float32)
    angular_freq = angular_freq.repeat_interleave(2)
    angular_freq = torch.cat([angular_freq, angular_freq.new_zeros(head_dim // 2)])
    theta = torch.outer(torch.arange(t, dtype=torch.float32), angular_freq)
    factor1, factor2 = theta.cos(), theta.sin()
    factor2[..., 1::2] *= -1
    return factor1, factor2


def record_65_rotary(x_bthd: torch.Tensor, factor1: torch.Tensor, factor2: torch.Tensor) -> torch.Tensor:
    """#65's Yarn.rotary."""
    f1, f2 = factor1[None, : x_bthd.size(-3), None, :], factor2[None, : x_bthd.size(-3), None, :]
    x_flip = x_bthd.view(*x_bthd.shape[:-1], x_bthd.shape[-1] // 2, 2).flip(-1).view(x_bthd.shape)
    return f1 * x_bthd + f2 * x_flip


def interleave(head_dim: int) -> torch.Tensor:
    """Our half-split dims in #65's order: its pair (2i, 2i+1) is our (i, i + D/2)."""
    half = torch.arange(head_dim // 2)
    return torch.stack([half, half + head_dim // 2], dim=-1).flatten()


def test_the_interleaved_rotary_with_the_upper_half_offset_is_ours_with_q_k_rows_permuted():
    """#65 rotates adjacent dims and shifts the keys' upper half (its stationary dims); ours rotates
    (i, i + D/2) and shifts dims D/4:D/2 and 3D/4:D. Permuting each head's Q/K rows maps one onto the
    other bit for bit (the same products and sums per element), so the scores are equal and the init
    law (i.i.d. uniform rows), QK-norm and NorMuon (row statistics, orthogonalization) are unchanged:
    #65's layout is a relabelling of ours, not a new function."""
    from speedrun.model.gpt2026.attention import offset_keys
    from speedrun.model.layers import Rotary

    B, T, H, D = 1, 64, 2, 32
    gen = torch.Generator().manual_seed(0)
    dim = H * D
    x = torch.randn(B, T, dim, generator=gen)
    w_q, w_k = (
        torch.randn(dim, dim, generator=gen) * dim**-0.5,
        torch.randn(dim, dim, generator=gen) * dim**-0.5,
    )
    perm = interleave(D)
    rows = torch.cat([h * D + perm for h in range(H)])  # the record's Q/K rows, head by head
    rot = Rotary(D, T, 10000.0, True, "fp32")
    q, k = (torch.nn.functional.rms_norm(F_linear(x, w).view(B, T, H, D), (D,)) for w in (w_q, w_k))
    q_ours, k_ours = rot(q.transpose(1, 2)), offset_keys(rot(k.transpose(1, 2)), seq_dim=2)
    f1, f2 = record_65_rotary_tables(D, T)
    # the rotation and the shift alone, on the same normalized q and k: bit for bit
    q_rec, k_rec = record_65_rotary(q[..., perm], f1, f2), record_65_rotary(k[..., perm], f1, f2)
    k_rec[:, 1:, :, D // 2 :] = k_rec[:, :-1, :, D // 2 :].clone()  # key_offset on the upper half
    torch.testing.assert_close(q_rec, q_ours.transpose(1, 2)[..., perm], rtol=0, atol=0)
    torch.testing.assert_close(k_rec, k_ours.transpose(1, 2)[..., perm], rtol=0, atol=0)
    # from x through #65's row order (QK-norm sums in another order: fp32 rounding)
    q_rec, k_rec = (
        record_65_rotary(torch.nn.functional.rms_norm(F_linear(x, w[rows]).view(B, T, H, D), (D,)), f1, f2)
        for w in (w_q, w_k)
    )
    k_rec[:, 1:, :, D // 2 :] = k_rec[:, :-1, :, D // 2 :].clone()
    scores_rec = torch.einsum("bthd,bshd->bhts", q_rec, k_rec)
    torch.testing.assert_close(scores_rec, q_ours @ k_ours.transpose(-1, -2), rtol=1e-5, atol=1e-5)


def F_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # noqa: N802
    return torch.nn.functional.linear(x, w)


# ------------------------------------------------------------------ #57's bf16 block storage


def test_bf16_blocks_step_as_fp32_blocks_through_the_mantissa_buffer():
    """model.block_dtype=bf16 (#57/#65: attn_bank and mlp_bank in bf16): after optimizer steps on the same
    gradients, each bf16 block matrix is the top half of the fp32 twin's (the buffer holds the rest, as
    #65's _cautious_wd_and_update_inplace), and every other parameter is bit for bit the twin's."""
    from speedrun.model.gpt2026.model import BLOCK_MATRICES
    from speedrun.model.labels import label_of
    from speedrun.train.optimizers import build_optimizer
    from speedrun.train.schedule import apply_schedule
    from tests.recipe_matrix import shrink

    extra = [
        "model.embed_dtype=fp32",
        "model.fp8_head=false",
        "optim.muon_ns_dtype=fp32",
        "optim.tie_until=4",
    ]
    models, opts = [], []
    for dtype in ("bf16", "fp32"):
        cfg = load_recipe(
            RECIPE, [*shrink(RECIPE), *extra, "model.bigram_rows=300", f"model.block_dtype={dtype}"]
        )
        torch.manual_seed(0)
        models.append(build_model(cfg.model))
    m16, m32 = models
    blocks = {n for n, p in m16.named_parameters() if label_of(p).name in BLOCK_MATRICES}
    assert blocks and {p.dtype for n, p in m16.named_parameters() if n in blocks} == {torch.bfloat16}
    assert {p.dtype for n, p in m16.named_parameters() if n not in blocks} == {torch.float32}
    with torch.no_grad():  # the twin starts from the bf16 values
        for p16, p32 in zip(m16.parameters(), m32.parameters(), strict=True):
            p32.copy_(p16.float())
    opts = [build_optimizer(m, cfg) for m in (m16, m32)]
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        for m, opt in zip((m16, m32), opts, strict=True):
            apply_schedule(schedule_at(step, cfg), opt, m)
        for p16, p32 in zip(m16.parameters(), m32.parameters(), strict=True):
            g = torch.randn(p16.shape, generator=gen).to(p16.dtype)
            p16.grad, p32.grad = g.clone(), g.float()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for (name, p16), p32 in zip(m16.named_parameters(), m32.parameters(), strict=True):
        if name in blocks:
            top = (p32.detach().view(torch.int32) >> 16).to(torch.int16)
            assert torch.equal(p16.detach().view(torch.int16), top), name
            assert not torch.equal(p16.detach().float(), p32.detach()), name  # the low bits live on
        else:
            assert torch.equal(p16.detach(), p32.detach()), name


def test_bf16_blocks_need_the_normuon_table():
    from speedrun.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model\.block_dtype=bf16 needs optim\.name=normuon"):
        load_recipe(RECIPE, ["model.block_dtype=bf16", "optim.name=muon"])


@pytest.mark.slow
def test_the_shrunk_recipe_trains_through_the_loop(text_data, tmp_path):
    """The training loop on the shrunk recipe: bf16 blocks through the mantissa buffer, the bigram
    table, gates in Adam, paired heads, grad_scale 2 x tokens/8, tie → untie."""
    import json

    from speedrun.train import loop
    from tests.recipe_matrix import shrink

    eot = json.loads((text_data / "meta.json").read_text())["eot_id"]
    plan = "tokens=256 doc=64 windows=1/1 frac=1/2 mtp=1,0.5,0.25>1,0.5,0; "
    plan += "tokens=512 windows=1/2 lr=1.5 frac=1/2; tokens=512 windows=1/2 ext=2 val=1/3 yarn=2"
    over = [*shrink(RECIPE), f"data.dir={text_data}", "data.tokenizer=bpe:512", f"model.eot_id={eot}",
            "model.vocab_size=512", "model.embed_dtype=fp32", "model.fp8_head=false",
            "model.bigram_rows=1000",
            "optim.muon_ns_dtype=fp32", "train.seq_len=128", "train.micro_batch_tokens=128",
            "train.global_batch_tokens=512", "model.max_seq_len=512", "train.val_seq_len=512",
            "train.val_tokens=2048", "train.steps=8", f"train.stages={plan}", "optim.tie_until=4",
            "train.log_every=1", "data.max_docs=0"]  # fmt: skip
    cfg = load_recipe(RECIPE, over)
    assert cfg.model.block_dtype == "bf16" and cfg.train.grad_scale_mul == 2.0
    loop.train(cfg, tmp_path / "run")
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train_loss"] for r in lines if "train_loss" in r]
    assert losses and all(math.isfinite(v) for v in losses)
    assert any("val_loss" in r and math.isfinite(r["val_loss"]) for r in lines)


# ------------------------------------------------------------------ #65's model, forward and gradients


@pytest.mark.parametrize("step", [100, 700, 1200, N + EXT])  # MTP 3, MTP 2 after YaRN 3 → 7, 11; validation
def test_forward_loss_and_gradients_match_the_65_model_in_fp32(step):
    """The recipe's model (fp32 blocks) against #55's forward with #58's, #62's and #63's lines
    (tests/test_banks_switches.record_55_forward: #65's forward apart from the one-parameter value-
    embedding layout) on #65's windows, YaRN history and MTP weights at `step`."""
    from tests.test_banks_switches import record_55_forward
    from tests.test_yarn_recipe import RecordYarn

    heads, dim, T, vocab = 4, 64, 1024, 120
    cfg = load_recipe(RECIPE, ["model.block_dtype=fp32"])
    cfg.model = dataclasses.replace(
        cfg.model, n_head=heads, n_embd=dim, vocab_size=vocab, max_seq_len=T, embed_dtype="fp32",
        fp8_head=False, eot_id=vocab - 1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg.model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.02 if p.ndim > 1 else 0.3))
            if "ve_gate" in n or "skip_gate" in n:
                p.copy_(torch.randn_like(p))
            if n == "bigram.embed.weight":
                p.normal_(std=0.5)
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(0, vocab - 1, (T + 1,), generator=gen)
    seq[[0, 1000]] = vocab - 1
    cu = torch.full((128,), T, dtype=torch.int32)
    cu[:2] = torch.tensor([0, 1000])
    x, y = seq[:-1], seq[1:]
    rec = RecordSchedule65()
    training = step < rec.total_steps
    model.train(training)
    apply_to_model(schedule_at(step, cfg), model)
    stage = rec.lookup(min(step, rec.total_steps - 1))[0]
    ws_short, ws_long = stage[2] if training else (6, 20)  # apply_final_ws_ext
    yarn, scale, seen = RecordYarn(dim // heads, 2 * T), 0.1, [STAGES_65[0][2][1]]
    for s in range(min(step, rec.total_steps - 1) + 1):
        if rec.lookup(s)[0][2][1] != seen[-1]:
            seen.append(rec.lookup(s)[0][2][1])
    for old, new in zip(seen[:-1], seen[1:], strict=True):
        yarn.apply_yarn(old, new)
        scale *= 0.2 * math.log(new / old) + 1
    weights = {n: p.detach().clone().requires_grad_(training) for n, p in model.named_parameters()}
    with torch.set_grad_enabled(training):
        loss = model(x[None], y[None], cu)
        mtp = rec.mtp_weights(step) if training else [1.0]
        ref = record_55_forward(
            weights, x, y, cu, (ws_short, ws_long), yarn, scale, mtp, heads, dim, training, (0, 2, 5, 9)
        )
    ref = ref / T if training else ref
    assert math.isclose(loss.item(), ref.item(), rel_tol=1e-6), (loss.item(), ref.item())
    if not training:
        return
    loss.backward()
    ref.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, weights[name].grad, rtol=1e-4, atol=1e-6, msg=name)
