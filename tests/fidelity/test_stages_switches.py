"""The switches `stages-2025-12` adds, one by one: #49's key offset (only on the long layers, cached
decoding still equal to the forward), #53's MTP loss against its formula and in the model (training
only), the stage plan's rounding rule and MTP weights written into the model, and one ConfigError for
each bad new switch. The recipe against #53's code is tests/fidelity/test_stages_recipe.py."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from speedrun.config.stages import parse_stages
from speedrun.errors import ConfigError
from speedrun.model.gpt2026.attention import offset_keys
from speedrun.model.gpt2026.head import mtp_loss, write_weights
from speedrun.recipes import load_recipe
from speedrun.train.schedule import apply_to_model, schedule_at
from speedrun.train.stages import stage_values
from tests.decoding import assert_cached_decoding_is_the_forward
from tests.fidelity.checks import fp32_model, jitter_
from tests.fidelity.test_stages_recipe import (
    BS,
    EXT,
    PLAN_53,
    N,
    record_bs_ws,
    record_key_shift,
    record_mtp,
    record_mtp_loss,
)

BASE = "normuon-2025-10"


def test_key_offset_is_the_records_shift():
    k = torch.randn(1, 9, 2, 16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(offset_keys(k, seq_dim=1), record_key_shift(k), rtol=0, atol=0)
    # (B, H, T, D) as the attention reads it
    torch.testing.assert_close(
        offset_keys(k.transpose(1, 2), seq_dim=2), record_key_shift(k).transpose(1, 2), rtol=0, atol=0
    )


def _small(overrides=(), L=4, T=64, vocab=100, **model):
    cfg, model = fp32_model(
        BASE, list(overrides), n_layer=L, n_head=2, n_embd=64, vocab_size=vocab, max_seq_len=T,
        windows=["L", "S", "S", "L"], attention_layers=[0, 1, 3], mlp_layers=[0, 1, 2, 3],
        value_embeds=[0, -1, -1, 0], skips=[[1, 2], [0, 3]], backout_layer=2, **model,
    )  # fmt: skip
    jitter_(model, 0.05)  # zero-initialized projections, gates, head: give them values
    return cfg, model


def test_key_offset_changes_only_the_long_layers_and_cached_decoding_still_matches():
    _, model = _small(key_offset_layers=[0, 3])  # the long layers
    flags = [b.attn.key_offset if b.attn is not None else None for b in model.blocks]
    assert flags == [True, False, None, True]  # LSSL, layer 2 without attention
    idx = torch.randint(0, 99, (1, 40), generator=torch.Generator().manual_seed(2))
    model.eval()
    with torch.no_grad():
        full = assert_cached_decoding_is_the_forward(model, idx, 25)
        for b in model.blocks:
            if b.attn is not None:
                b.attn.key_offset = False
        assert not torch.allclose(model(idx), full)  # the offset changes what the model computes


def test_mtp_loss_is_the_records_and_plain_cross_entropy_with_one_weight():
    gen = torch.Generator().manual_seed(4)
    logits, y = (
        torch.randn(37, 50, generator=gen, dtype=torch.float64),
        torch.randint(0, 50, (37,), generator=gen),
    )
    for w in ([1.0, 0.5, 0.25], [1.0, 0.3]):
        w = torch.tensor(w, dtype=torch.float64)
        got = mtp_loss(logits[None], y[None], w) * len(y)  # ours is the mean over positions
        torch.testing.assert_close(got, record_mtp_loss(logits, y, w), rtol=1e-12, atol=0)
    one = mtp_loss(logits[None], y[None], torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))
    torch.testing.assert_close(one, F.cross_entropy(logits, y), rtol=1e-12, atol=0)


def test_the_model_trains_on_the_mtp_loss_and_validates_on_plain_cross_entropy():
    cfg, model = _small(["model.mtp=3"])
    x = torch.randint(0, 99, (1, 64), generator=torch.Generator().manual_seed(5))
    y = torch.roll(x, -1, 1)
    write_weights(model.mtp_weights, (1.0, 0.5, 0.2))
    model.train()
    logits = model.capped_logits(model.hidden(x, model.layer_contexts(x))).float()
    torch.testing.assert_close(
        model(x, y), record_mtp_loss(logits[0], y[0], torch.tensor([1.0, 0.5, 0.2])) / 64, rtol=1e-5, atol=0
    )
    write_weights(model.mtp_weights, (1.0,))  # a stage that dropped the extra tokens
    assert model.mtp_weights.tolist() == [1.0, 0.0, 0.0]
    torch.testing.assert_close(model(x, y), F.cross_entropy(logits[0], y[0]), rtol=1e-5, atol=0)
    model.eval()
    write_weights(model.mtp_weights, (1.0, 0.5, 0.2))
    with torch.no_grad():
        torch.testing.assert_close(model(x, y), F.cross_entropy(logits[0], y[0]), rtol=1e-5, atol=0)


def test_rounded_bounds_would_start_the_third_stage_a_step_early():
    """Why `train.stage_bounds=fraction`: round(2/3 · 1880) = 1253, #53's int(3·s/N) changes at 1254."""
    rounded = parse_stages(PLAN_53, N + EXT, cooldown_frac=0.55, lr_floor=0.1, cooldown_form="fraction")
    assert stage_values(1253, rounded).batch_tokens == BS[2] != record_bs_ws(1253)[0]


def test_the_schedule_writes_the_stage_mtp_weights_into_the_model():
    cfg, model = _small(
        ["model.mtp=3", f"train.stages={PLAN_53}", "train.steps=1920", "train.stage_bounds=fraction"]
    )
    apply_to_model(schedule_at(10, cfg), model)
    assert model.mtp_weights.tolist() == pytest.approx(record_mtp(10), rel=1e-6)
    apply_to_model(schedule_at(700, cfg), model)
    assert model.mtp_weights.tolist() == pytest.approx([*record_mtp(700), 0.0], rel=1e-6)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["model.mtp=2", f"train.stages={PLAN_53}", "train.steps=1920"], "model.head.mtp must be at least 3"),
        (
            ["model.mtp=3", "train.stages=", "model.yarn=false", "train.cooldown_start=int"],
            "model.head.mtp takes its weights from train.stages",
        ),
        (
            ["train.stages=", "model.yarn=false", "train.cooldown_start=int", "train.stage_bounds=fraction"],
            "train.stage_bounds=fraction has no effect while train.stages=''",
        ),
        (
            ["model.key_offset_layers=[7]"],
            "model.attn.key_offset_layers must be attention layers",
        ),
        (
            ["model.mtp=3", "train.steps=1920", "train.stages=" + PLAN_53.replace("1,0.5>1,0", "1,0.5>1")],
            "mtp='1,0.5>1' must be weights W,W,… or START>END of one length",
        ),
    ],
)
def test_a_bad_new_switch_is_one_config_error_naming_it(overrides, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_recipe(BASE, overrides)
