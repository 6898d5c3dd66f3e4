"""The five 2025 recipes against lines of their record scripts (the code at the top of each record's log
under records/track_1_short/ in KellerJordan/modded-nanogpt) that the per-recipe tests do not cover:
the initial attention and value-embedding weights at full width, how often each validates, and the
scale of the gradients the optimizers see (the records back-propagate each rank's summed loss)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from speedrun.model.gpt import GPT
from speedrun.recipes import load_recipe
from speedrun.train.schedule import schedule_at
from speedrun.train.step import train_step

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
    model = GPT(dataclasses.replace(cfg.model, vocab_size=128, max_seq_len=1024, fp8_head=False))
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
