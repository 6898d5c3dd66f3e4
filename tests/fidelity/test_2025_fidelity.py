"""The five 2025 recipes against lines of their record scripts (the code at the top of each record's log
under records/track_1_short/ in KellerJordan/modded-nanogpt) that the per-recipe tests do not cover:
the initial attention and value-embedding weights at full width, how often each validates, and the
scale of the gradients the optimizers see (the records back-propagate each rank's summed loss)."""

from __future__ import annotations

import math

import pytest
import torch

from speedrun.model.families import build_model
from speedrun.recipes import load_recipe
from speedrun.train.schedule import apply_to_model, schedule_at
from speedrun.train.step import train_step
from tests.recipe_matrix import replace

DIM = 768  # every 2025 record's model_dim

# Per recipe, the record's init of the attention's Q/K/V (all uniform(-√3·std, √3·std)) and of its
# value embeddings (std, 0.0 = zeros), as each script writes them:
# #26 2025-07-12_BosAlign CausalSelfAttention: `std = 0.5 * (dim ** -0.5)`; nn.Embedding's default N(0, 1)
# #31 2025-09-10_Yarn, #38 2025-09-29_PolarExpress, #42 2025-10-27_FixMuonLR: the same two lines
# #53 2025-12-22_MultiTokenPrediction: `std = self.dim ** -0.5`; `nn.init.zeros_(embed.weight)` (#49 on)
RECORD_INIT = {
    "bos-align-2025-07": (0.5 * DIM**-0.5, 1.0),
    "yarn-2025-09": (0.5 * DIM**-0.5, 1.0),
    "polar-2025-09": (0.5 * DIM**-0.5, 1.0),
    "normuon-2025-10": (0.5 * DIM**-0.5, 1.0),
    "stages-2025-12": (DIM**-0.5, 0.0),
}
MLP_STD = 0.5 * DIM**-0.5  # every record's MLP c_fc: `std = 0.5 * (dim ** -0.5)`


@pytest.mark.parametrize("recipe", sorted(RECORD_INIT))
def test_attention_and_value_embedding_init_at_full_width_is_the_records(recipe):
    qkv_std, ve_std = RECORD_INIT[recipe]
    cfg = load_recipe(recipe)
    assert cfg.model.n_embd == DIM
    # full width and depth; a small vocabulary (no init depends on it) keeps the tables small
    torch.manual_seed(0)
    model = build_model(replace(cfg.model, vocab_size=128, max_seq_len=1024, fp8_head=False))
    attn = [b.attn for b in model.blocks if b.attn is not None]
    assert attn
    for i, a in enumerate(attn):
        w = a.c_attn.weight.detach().float()
        assert w.shape == (3 * DIM, DIM)
        assert w.abs().max() <= math.sqrt(3) * qkv_std, (recipe, i)
        assert w.std().item() == pytest.approx(qkv_std, rel=0.01), (recipe, i)
        assert not a.c_proj.weight.any(), (recipe, i)  # qkvo_w[3] / [3d:]: zero
    for b in model.blocks:
        if b.mlp is not None:
            assert b.mlp.c_fc.weight.detach().float().std().item() == pytest.approx(MLP_STD, rel=0.01)
    assert model.value_embeds is not None and len(model.value_embeds) == 3
    for emb in model.value_embeds:
        w = emb.weight.detach().float()
        if ve_std == 0.0:
            assert not w.any(), recipe
        else:
            assert w.std().item() == pytest.approx(ve_std, rel=0.02), recipe


# `val_loss_every` in each script's Hyperparameters: 125 in #26, #31 and #38; 250 in #42 and #53
RECORD_VAL_EVERY = {
    "bos-align-2025-07": 125,
    "yarn-2025-09": 125,
    "polar-2025-09": 125,
    "normuon-2025-10": 250,
    "stages-2025-12": 250,
}


@pytest.mark.parametrize("recipe", sorted(RECORD_VAL_EVERY))
def test_validation_interval_is_the_records(recipe):
    assert load_recipe(recipe).train.val_every == RECORD_VAL_EVERY[recipe]


# ------------------------------------------------------------------ the summed loss (#26 on)


@pytest.mark.parametrize("accumulation", [1, 2, 8])
def test_one_adam_step_is_the_records_on_its_eight_ranks_summed_losses_in_fp64(accumulation):
    """#26's training step: `model(...).backward()` of each rank's `F.cross_entropy(..., reduction='sum')`,
    the 8 ranks' gradients averaged (`reduce_scatter(..., op=ReduceOp.AVG)`), then DistAdam: eps added to
    √v before the bias correction, so eps meets gradients (tokens per step)/8 times those of our mean
    loss. Our step (any micro-batch split: the process count only averages like it) must give the
    same Adam update. The model and the record's arithmetic in fp64 (our Adam computes in fp32); Adam's
    eps is #38 on's 1e-8 here, where it shows most."""
    from speedrun.optim.build import build_optimizer
    from speedrun.train.schedule import apply_schedule
    from tests.fidelity.test_bos_align_optimizer import record_adam_step, record_params
    from tests.fidelity.test_bos_align_recipe import record_lr
    from tests.recipe_matrix import shrink

    recipe, rows, seq = "bos-align-2025-07", 8, 256
    extra = ["model.embed_dtype=fp32", "model.fp8_head=false", "optim.eps=1e-8"]
    extra.append(f"train.global_batch_tokens={rows * seq}")
    cfg = load_recipe(recipe, [*shrink(recipe), *extra])
    torch.manual_seed(0)
    model = build_model(cfg.model).double()
    with torch.no_grad():  # weights a step or so in, so no gradient is exactly zero
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    reference = build_model(cfg.model).double()
    reference.load_state_dict(model.state_dict())
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.model.vocab_size - 1, (rows, seq + 1), generator=gen)
    x, y = tokens[:, :-1], tokens[:, 1:]

    # the record: 8 ranks, one row each, summed losses, gradients averaged
    sched = schedule_at(0, cfg)
    apply_to_model(sched, reference)  # step 0's window
    for r in range(8):
        reference(x[r : r + 1], y[r : r + 1], reduction="sum").backward()
    _, adam, copies = record_params(reference)
    for name, p in reference.named_parameters():
        copies[name].grad = p.grad.view_as(copies[name]) / 8
    record_adam_step(adam, {}, 0.008 * record_lr(0, cfg.train.steps), betas=(0.8, 0.95), eps=1e-8)

    # ours: mean losses over `accumulation` micro-batches, the schedule's gradient scale
    assert sched.grad_scale == rows * seq / 8
    opt = build_optimizer(model, cfg)
    apply_schedule(sched, opt, model)
    micro = iter(zip(x.chunk(accumulation), y.chunk(accumulation), strict=True))
    train_step(model, opt, lambda: next(micro), accumulation, None, 0.0, sched.grad_scale)

    adam_names = [n for n, p in copies.items() if any(p is q for q in adam)]
    assert {"wte.weight", "lm_head.weight"} <= set(adam_names)
    for name in adam_names:
        want = copies[name].detach().view_as(start[name]) - start[name]
        got = dict(model.named_parameters())[name].detach() - start[name]
        # measured: <= 1.3e-6 (our Adam's math runs in fp32); with our mean loss's gradients 0.3 % to 84 %
        assert (got - want).norm() <= 5e-6 * want.norm(), name


@pytest.mark.parametrize(
    "override", ["model.qkv_init_gain=1.0", "model.value_embed_zero_init=true", "train.summed_loss_ranks=-1"]
)
def test_init_and_summed_loss_switches_that_cannot_act_are_refused(override):
    """The demo inits with torch's defaults and has no value embeddings; a negative rank count has no
    meaning."""
    from speedrun.errors import ConfigError

    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_recipe("demo", [override])
