"""The parts of records #43–#53 built so far, each against the record's code (records/track_1_short/
2025-12-22_MultiTokenPrediction, the script at the top of each log), written here: #49's partial key
offset, #53's multi-token-prediction loss, and #46–#53's schedule formulas (get_lr, get_bs, get_ws and
the MTP weights) through a stage plan written as `train.stages` text. The recipe `stages-2025-12`
itself is not built yet (see docs/roadmap.md)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

from speedrun.errors import ConfigError
from speedrun.model.gpt import GPT
from speedrun.model.key_offset import offset_keys
from speedrun.model.kv_cache import KVCache, forward_cached
from speedrun.model.mtp import mtp_loss, write_weights
from speedrun.recipes import load_recipe
from speedrun.train.schedule import apply_to_model, schedule_at
from speedrun.train.stages import parse_stages, stage_values

BASE = "normuon-2025-10"


def record_key_shift(k: torch.Tensor) -> torch.Tensor:
    """#53's CausalSelfAttention lines (k: B, T, H, D), compiled semantics (the source read first)."""
    hd, src, k = k.size(-1), k.clone(), k.clone()
    k[:, 1:, :, hd // 4 : hd // 2] = src[:, :-1, :, hd // 4 : hd // 2]
    k[:, 1:, :, hd // 4 + hd // 2 :] = src[:, :-1, :, hd // 4 + hd // 2 :]
    return k


def test_key_offset_is_the_records_shift():
    k = torch.randn(1, 9, 2, 16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(offset_keys(k, seq_dim=1), record_key_shift(k), rtol=0, atol=0)
    # (B, H, T, D) as the attention reads it
    torch.testing.assert_close(
        offset_keys(k.transpose(1, 2), seq_dim=2), record_key_shift(k).transpose(1, 2), rtol=0, atol=0
    )


def _small(overrides=(), L=4, T=64, vocab=100):
    cfg = load_recipe(BASE, list(overrides))
    cfg.model = dataclasses.replace(
        cfg.model, n_layer=L, n_head=2, n_embd=64, vocab_size=vocab, max_seq_len=T, embed_dtype="fp32",
        fp8_head=False, eot_id=vocab - 1, window_pattern="LSSL", no_attention_layers="2",
        no_mlp_layers="", value_embed_tables=1, backout_layer=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT(cfg.model)
    with torch.no_grad():  # zero-initialized projections, gates, head: give them values
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.05 if p.ndim > 1 else 0.3))
    return cfg, model


def test_key_offset_changes_only_the_long_layers_and_cached_decoding_still_matches():
    _, model = _small(["model.key_offset=true"])
    flags = [b.attn.key_offset if b.attn is not None else None for b in model.blocks]
    assert flags == [True, False, None, True]  # LSSL, layer 2 without attention
    idx = torch.randint(0, 99, (1, 40), generator=torch.Generator().manual_seed(2))
    model.eval()
    with torch.no_grad():
        full = model(idx)
        cache = KVCache()
        parts = [forward_cached(model, idx[:, :25], cache)]
        parts += [forward_cached(model, idx[:, t : t + 1], cache) for t in range(25, 40)]
        torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-4, atol=1e-4)
        for b in model.blocks:
            if b.attn is not None:
                b.attn.key_offset = False
        assert not torch.allclose(model(idx), full)  # the offset changes what the model computes


def record_mtp_loss(
    logits: torch.Tensor, target_seq: torch.Tensor, mtp_weights: torch.Tensor
) -> torch.Tensor:
    """#53's GPT.forward, training branch with n_predict > 1 (one packed row, summed)."""
    n_predict = mtp_weights.size(0)
    idx = F.pad(target_seq, (0, n_predict - 1)).unfold(0, n_predict, 1)
    target_logits = logits.gather(1, idx)
    cross_entropy = torch.logsumexp(logits, dim=-1).unsqueeze(1) - target_logits
    for k in range(1, n_predict):
        cross_entropy[-k:, k] = 0
    return (cross_entropy * mtp_weights).sum()


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
    logits = model.capped_logits(model.hidden(x, model.layer_masks(x))).float()
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


@pytest.mark.parametrize("step", [0, 1, 300, 626, 627, 845, 846, 1000, 1253, 1254, 1700, 1879, 1880, 1919])
def test_the_53_plan_gives_its_lr_batch_windows_and_mtp_weights(step):
    plan = parse_stages(PLAN_53, N + EXT, 0.55, 0.1, (0.85, 0.95, 300, 50), "fraction", True)
    v = stage_values(step, plan)
    assert v.lr == pytest.approx(record_lr(step), rel=1e-12, abs=1e-15), step
    assert (v.batch_tokens, v.short_window, v.long_window) == record_bs_ws(step), step
    assert v.mtp_weights == pytest.approx(record_mtp(step), rel=1e-12, abs=1e-15), step
    final = stage_values(N + EXT, plan)
    assert (final.short_window, final.long_window) == (WS_FINAL // 2, WS_POST_YARN)


def test_rounded_bounds_would_start_the_third_stage_a_step_early():
    """Why `train.stage_bounds=fraction`: round(2/3 · 1880) = 1253, #53's int(3·s/N) changes at 1254."""
    rounded = parse_stages(PLAN_53, N + EXT, 0.55, 0.1, (0.85, 0.95, 300, 50), "fraction", False)
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
        (["model.mtp=2", f"train.stages={PLAN_53}", "train.steps=1920"], "model.mtp must be at least 3"),
        (
            ["model.mtp=3", "train.stages=", "model.yarn=false", "train.cooldown_start=int"],
            "model.mtp takes its weights from train.stages",
        ),
        (
            ["train.stages=", "model.yarn=false", "train.cooldown_start=int", "train.stage_bounds=fraction"],
            "train.stage_bounds places",
        ),
        (
            ["model.key_offset=true", "model.window_pattern="],
            "model.key_offset shifts the unrotated key dims",
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
