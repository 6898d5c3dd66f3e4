"""The xsa-2026-04 (#82) and record-2026-07 (#89) recipes against their record scripts (the code at the top
of records/track_1_short/2026-04-29_XSAGatedLayers/this_pr_v1-s1410/*.txt and
2026-07-17_FP8DownProjection/this_pr/*.txt): TrainingSchedule and get_muon_momentum at every step (LR,
momentum, batch, document cut, windows, MTP weights, untie step, grad_scale), cu_seqlens per stage,
the parameter count from the scripts' tensors, and eight optimizer steps against #82's NorMuonAndAdam.
The parts #70–#89 added are checked against their records' lines in fidelity/test_switches_banks_to_record.py,
fidelity/test_xsa_parts.py and fidelity/test_record_2026_07_parts.py; the whole model (forward loss and every
gradient),
init statistics, the training loop and compiling: fidelity/test_record_2026_model.py; 1 and 2 gloo processes:
e2e/test_recipe_matrix.py (every recipe)."""

from __future__ import annotations

import re
from itertools import accumulate

import pytest
import torch

from speedrun.data.bos_loader import record_max_docs
from speedrun.model.families import build_model
from speedrun.recipes import load_recipe
from speedrun.train.schedule import schedule_at
from tests.fidelity.checks import shrunk_with_optimizer
from tests.fidelity.refs import schedules

# (recipe, num_scheduled_iterations, num_extension_iterations) of each script's Hyperparameters
RECORDS = {"xsa-2026-04": (1410, 40), "record-2026-07": (1380, 10)}

# TRAINING_STAGES of #82 and #89 (the same lines): (duration, train_max_seq_len, batch_size, window_sizes,
# lr_mul, mtp_weights_start, mtp_weights_end)
STAGES = [
    (1 / 3, 896, 8 * 2048 * 8, (1, 3), 1.0, [1.0, 0.5, 0.25], [1.0, 0.5, 0.0]),
    (1 / 3, 2048, 16 * 2048 * 8, (3, 7), 1.52, [1.0, 0.5], [1.0, 0.0]),
    (1 / 3, 2048, 24 * 2048 * 8, (5, 11), 1.73, [1.0], [1.0]),
    (None, 2048, 24 * 2048 * 8, (6, 13), 1.0, [1.0], [1.0]),
]


class RecordSchedule:
    """The scripts' TrainingSchedule(TRAINING_STAGES, N, EXT, cooldown_frac=0.60) (split_embed_stage 2,
    ws_post_yarn_ext 20) with get_lr's floor 0.15 (#72); `stages`: the script's TRAINING_STAGES."""

    stages = STAGES
    lr_index, lr_floor, split_embed_stage = 4, 0.15, 2  # where a stage holds lr_mul; get_lr's floor

    def __init__(self, scheduled: int, extension: int, cooldown_frac: float = 0.60):
        self.scheduled, self.cooldown_frac = scheduled, cooldown_frac
        self.total_steps = scheduled + extension
        ends = [
            0,
            *[round(c * scheduled) for c in accumulate(s[0] for s in self.stages[:-1])],
            self.total_steps,
        ]
        assert ends[-2] == scheduled
        self.boundaries = list(zip(ends[:-1], ends[1:], strict=True))
        self.split_step = self.boundaries[self.split_embed_stage][0] | 1

    def lookup(self, step: int):
        for i, (start, end) in enumerate(self.boundaries):
            if step < end:
                return self.stages[i], (step - start) / (end - start)
        return self.stages[-1], 1.0

    def get_lr(self, step: int) -> float:
        stage, _ = self.lookup(step)
        lr = stage[self.lr_index]
        cd_start = int(self.scheduled * (1 - self.cooldown_frac))
        if step >= cd_start:
            t = min(1.0, (step - cd_start) / (self.scheduled - cd_start))
            lr = lr * (1 - t) + self.lr_floor * t
        return lr

    def mtp_weights(self, step: int) -> list[float]:
        stage, t = self.lookup(step)
        return [a + (b - a) * t for a, b in zip(stage[5], stage[6], strict=True)]


# get_muon_momentum: #42's lines, kept to #89
record_muon_momentum = schedules.muon_momentum


@pytest.mark.parametrize("recipe", RECORDS)
def test_the_schedule_at_every_step_is_the_records(recipe):
    cfg = load_recipe(recipe)
    rec = RecordSchedule(*RECORDS[recipe])
    assert cfg.train.steps == rec.total_steps
    for step in range(rec.total_steps):
        got, stage = schedule_at(step, cfg), rec.lookup(step)[0]
        v = got.stage
        assert got.lr == pytest.approx(rec.get_lr(step), rel=1e-12, abs=1e-15), step
        assert got.muon_momentum == pytest.approx(record_muon_momentum(step, rec.total_steps), rel=1e-12), (
            step
        )
        assert (v.batch_tokens, v.max_doc_len) == (stage[2], stage[1]), step
        assert (v.short_window, v.long_window) == stage[3], step
        assert v.mtp_weights == pytest.approx(rec.mtp_weights(step), rel=1e-12, abs=1e-15), step
        assert not got.frozen, step
        # grad_scale = 1 / grad_accum_steps on 8 ranks, each back-propagating its summed loss (#65's 2 gone)
        assert got.grad_scale == pytest.approx(stage[2] / 8, rel=1e-15), step
        assert v.prefix_weight is None, step  # neither script has #88's prefix loss
    final = schedule_at(rec.total_steps, cfg).stage  # apply_final_ws_ext: the long window 20
    assert (final.short_window, final.long_window) == (6, 20)
    # copy_lm_state_to_embed after step split_step (odd, an Adam step): our optimizer unties after it
    assert cfg.optim.tie_until == rec.split_step + 1 and cfg.optim.adam_every == 2


def test_the_boundaries_are_the_scripts():
    assert RecordSchedule(1410, 40).boundaries == [(0, 470), (470, 940), (940, 1410), (1410, 1450)]
    assert RecordSchedule(1380, 10).boundaries == [(0, 460), (460, 920), (920, 1380), (1380, 1390)]


@pytest.mark.parametrize("recipe", RECORDS)
def test_cu_seqlens_per_stage_are_train_max_num_docs(recipe):
    """#78's TRAIN_MAX_NUM_DOCS {16384: 64, 32768: 96, 49152: 128} for each stage's tokens per rank."""
    cfg = load_recipe(recipe)
    assert cfg.data.max_docs == 0
    per_rank = [s[2] // 8 for s in STAGES]
    assert [record_max_docs(t) for t in per_rank] == [64, 96, 128, 128]


def record_param_count(bigram_rows: int, bigram_dim: int, backout: bool, world: int = 1) -> int:
    """GPT.__init__'s tensors of #82 (init_attn/init_mlp/init_misc of #89, MUDD apart): banks padded to
    a multiple of the world size (qk 60, vo 20), the MLP bank's 12th (padding) layer, one λ pair per
    layer in `scalars` (layer 6's unused), per-sublayer resid/post lambdas, x0/bigram lambdas and an XSA
    gate per head on every layer."""
    V, d, L, H = 50304, 768, 11, 6
    pad = lambda n: -(-n // world) * world  # noqa: E731
    embeddings = 2 * V * d + 5 * V * d + bigram_rows * bigram_dim
    gates = 10 * H * 12 + 5 * H * 12 + 12 + 12  # attention, value-embedding, smear, skip
    banks = pad(60) * 256 * d + pad(20) * d * d + 12 * 2 * 4 * d * d
    lambdas = 2 * L + 2 * L + L + L + L * H  # post, resid, x0, bigram, xsa
    scalars = pad(2 * L + (3 if backout else 2))  # SA pairs; smear, (backout), skip; padding
    return embeddings + gates + banks + lambdas + scalars


#: what the records allocate and never read: the MLP bank's padding layer, and 33 λs: layer 6's SA pair
#: and its x0 λ (no attention there), 30 XSA gates of layers without XSA (layer 6's unread resid/post pair
#: of its missing attention we keep too: one (2,) pair per layer, as the records)
NOT_OURS = 2 * 3072 * 768 + 33


@pytest.mark.parametrize(
    "recipe, record, extra, ours",
    [
        ("xsa-2026-04", record_param_count(50304 * 5, 768, True), 0, 539_100_364),
        # + #81's MUDD (2·64·768 + 2·14·64 + 2·14 = 100,124); layer 10 takes its resid/post pairs (4), x0
        # λ (1) and value-embedding gate (6·12) from MUDD: the record allocates them unread
        ("record-2026-07", record_param_count(50304 * 15, 192, False) + 100_124, -4 - 1 - 72, 490_908_570),
    ],
)
def test_the_parameter_count_is_the_records_less_padding_and_the_residual_form(recipe, record, extra, ours):
    """`extra`: what else we hold beside the record's tensors less NOT_OURS."""
    cfg = load_recipe(recipe)
    with torch.device("meta"):
        model = build_model(cfg.model)
    assert sum(p.numel() for p in model.parameters()) == ours == record - NOT_OURS + extra


# ------------------------------------------------------------------ #82's NorMuonAndAdam (#89: the same)

#: #82's param_table Adam rows: label -> (adam_betas, lr_mul, wd_mul) (wd_mul's default 1.0)
RECORD_82_ADAM = {
    "scalars": ((0.9, 0.99), 5.0, 0.0),
    "smear_gate": ((0.9, 0.99), 0.01, 0.0),
    "skip_gate": ((0.9, 0.99), 0.05, 0.0),
    "attn_gate_bank": ((0.9, 0.99), 1.0, 1.0),
    "ve_gate_bank": ((0.9, 0.99), 1.0, 1.0),
    "lm_head": ((0.5, 0.95), 1.0, 150.0),
    "bigram_embed": ((0.75, 0.95), 75.0, 5.0),
    "post_lambdas": ((0.9, 0.95), 1.0, 0.0),
    "x0_lambdas": ((0.9, 0.95), 1.0, 0.0),
    "bigram_lambdas": ((0.9, 0.95), 1.0, 0.0),
    "resid_lambdas": ((0.9, 0.95), 5.0, 0.0),
    "xsa_alphas": ((0.9, 0.95), 1.0, 0.0),
    "value_embeds": ((0.75, 0.95), 75.0, 5.0),
    "embed": ((0.5, 0.95), 1.0, 150.0),
}
#: #81's rows (record-2026-07): the MUDD MLPs and their output bias
RECORD_81_ADAM = {"mudd": ((0.9, 0.99), 0.25, 1.0), "mudd_bias": ((0.9, 0.99), 0.25, 0.0)}


def record_82_label(name: str) -> str:
    """Our parameter name → #82's label for it (`param.label = name.replace('.weight', '')`)."""
    for end, label in [
        ("wte.weight", "embed"), ("lm_head.weight", "lm_head"), ("bigram.embed.weight", "bigram_embed"),
        ("bigram.lambdas", "bigram_lambdas"), ("smear.gate.weight", "smear_gate"),
        ("skip_gate.proj.weight", "skip_gate"), (".attn.gate.proj.weight", "attn_gate_bank"),
        (".attn.ve_gate.proj.weight", "ve_gate_bank"), (".x0_lambda", "x0_lambdas"),
        (".post_lambdas", "post_lambdas"), (".xsa.alpha", "xsa_alphas"),
    ]:  # fmt: skip
        if name.endswith(end):
            return label
    if re.fullmatch(r"blocks\.\d+\.lambdas", name):  # the sublayer form's resid pair
        return "resid_lambdas"
    if name.startswith("mudd."):  # #81: mudd_w1, mudd_w2 and mudd_b2
        return "mudd_bias" if name == "mudd.b2" else "mudd"
    return "value_embeds" if name.startswith("value_embeds.") else "scalars"


@pytest.mark.parametrize("recipe", RECORDS)
def test_eight_steps_equal_the_records_normuon_and_adam(recipe):
    """NorMuon (beta2 0.9, #78) every step on qk_bank's per-head-pair Q and K blocks (#80: (2·hd, d), no
    shape multiplier), vo_bank's V and O, c_fc and c_proj as (3072, 768) (shape x2, c_proj x2 more); Adam
    on odd steps with #82's param_table rows (its new λ rows: betas 0.9/0.95, resid x5), gradients kept
    over even steps; tie → untie. Shrunk (4 layers, 4 heads: two pairs), 10 steps, untie after step 3."""
    from speedrun.train.schedule import apply_schedule
    from tests.fidelity.test_banks_recipe import record_adam_, record_normuon_matrix_

    extra = ["model.embed_dtype=fp32", "model.fp8_head=false", "optim.muon_ns_dtype=fp32", "model.n_head=4"]
    extra += ["optim.tie_until=4", "model.bigram_rows=300", "model.block_dtype=fp32", "model.mlp_fp8=false"]
    cfg, model, opt, ours = shrunk_with_optimizer(recipe, extra)
    d, hd = cfg.model.n_embd, cfg.model.n_embd // cfg.model.n_head
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
        # get_lr of the shrunk plan (10 steps): the cool-down from int(10 · 0.4) = 4 to 0.15
        sched = 1.0 if step < 4 else (1 - (step - 4) / 6) + 0.15 * (step - 4) / 6
        momentum = 0.85 + step / 300 * (0.95 - 0.85)

        def normuon(w, g, key, lr_mul, lr=0.023 * sched, momentum=momentum):
            record_normuon_matrix_(w, g, state.setdefault(key, {}), lr, lr_mul, momentum, beta2=0.9)

        for name, w in rec.items():
            g = grads[name]
            if name.endswith("attn.c_attn.weight"):  # qk_bank: one (2·hd, d) matrix per head pair
                qk, v = w[: 2 * d], w[2 * d :]
                for j, (wm, gm) in enumerate(zip(qk.split(2 * hd), g[: 2 * d].split(2 * hd), strict=True)):
                    normuon(wm, gm, (name, j), 1.0)
                normuon(v, g[2 * d :], (name, "v"), 1.0)
            elif name.endswith("attn.c_proj.weight"):
                normuon(w, g, name, 1.0)
            elif name.endswith("mlp.c_fc.weight"):
                normuon(w, g, name, 2.0)
            elif name.endswith("mlp.c_proj.weight"):  # stored (3072, 768) in the record's bank
                wt = w.T.clone()
                normuon(wt, g.T, name, 4.0)
                w.copy_(wt.T)
            else:
                adam_grads[name] = adam_grads.get(name, 0) + g  # not cleared on even steps
        if step % 2 == 1:
            if tied:  # lm_head.grad += embed.grad.T; embed skipped, then copied from the head
                adam_grads["lm_head.weight"] = adam_grads["lm_head.weight"] + adam_grads.pop("wte.weight")
            for name, g in adam_grads.items():
                betas, lr_mul, wd_mul = (RECORD_82_ADAM | RECORD_81_ADAM)[record_82_label(name)]
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
        if (got - want).norm() > 5e-5 * want.norm() + 1e-8:  # fp32 Polar Express in another op order
            bad.append(f"{name}: {(got - want).norm() / want.norm():.2e}")
    assert not bad, bad
    labels = {record_82_label(n) for n in ours if "mlp.c_" not in n and "attn.c_" not in n}
    mudd = set(RECORD_81_ADAM) if cfg.model.mudd.sources else set()
    # every row is exercised (shrunk with MUDD, the one value-embedding layer with a gate is MUDD's own)
    assert labels | ({"ve_gate_bank"} if mudd else set()) == set(RECORD_82_ADAM) | mudd
