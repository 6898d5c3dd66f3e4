"""Recipe `medium-2025-12` against track 2's record #18 (records/track_2_medium/2025-12-31_BulkSmallTrackTransfer,
the code at the top of each log), its formulas written here: get_bs, get_ws, get_lr, get_muon_momentum, the
MTP schedule, the YaRN calls and the untie step at every step; its parameter count from its tensors; the
fp32 forward loss and gradients of its model on tiny identical weights (FA3 replaced by a dense
document-causal window mask, as tests/test_stages_recipe.py) for what it changes over stages-2025-12: all
16 layers attend, five value tables on both ends, three skips with a gate each, the second embedding with
its x0 weight, #54's softcap, #55's gates on 16 dims; the optimizer rows it sets (NorMuon LR x0.1 on the
gates, the x0 lambdas' own Adam LR, the second embedding with the value embeddings)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from speedrun.model.families import build_model
from speedrun.recipes import load_recipe
from speedrun.train.schedule import apply_to_model, schedule_at
from tests.test_stages_recipe import record_key_shift, record_mtp_loss

RECIPE = "medium-2025-12"
N, EXT = 4700, 40  # num_scheduled_iterations, num_extension_iterations
BS = (131072, 262144, 393216) + (524288,) * 9  # train_bs_schedule
BS_EXT = 32 * 2048 * 8
WS = (3, 7, 11, 13, 15, 17, 19, 21, 23, 23, 23, 23)  # ws_schedule
WS_FINAL, WS_POST_YARN = 23, 27
BLOCK = 128


def record_bs(step: int) -> int:
    """#18's get_bs."""
    if step >= N:
        return BS_EXT
    return BS[int(len(BS) * (step / N))]


def record_ws(step: int) -> tuple[int, int]:
    """#18's get_ws: short min(11, long // 2)."""
    if step >= N:
        return WS_FINAL // 2, WS_FINAL
    x = step / N
    return min(11, WS[int(len(WS) * x)] // 2), WS[int(len(WS) * x)]


def record_lr(step: int) -> float:
    """#18's get_lr (cooldown_frac 0.70)."""
    if step > N:
        return 0.1
    lr_max, x = 1.0, step / N
    if x > 1 / 12:
        lr_max = 1.52
    if x > 2 / 12:
        lr_max = 1.73
    if x > 3 / 12:
        lr_max = 2.0
    if x >= 1 - 0.70:
        w = (1 - x) / 0.70
        return lr_max * w + (1 - w) * 0.1
    return lr_max


def record_momentum(step: int) -> float:
    """#18's get_muon_momentum (warm-up 300, cool-down 50 of num_iterations, 0.85 ↔ 0.95)."""
    cd_start = N + EXT - 50
    if step < 300:
        return 0.85 + step / 300 * (0.95 - 0.85)
    if step > cd_start:
        return 0.95 - (step - cd_start) / 50 * (0.95 - 0.85)
    return 0.95


def record_mtp(step: int) -> list[float]:
    """#18's _build_mtp_schedule: x = s / (N/4)."""
    x = step / (N / 4)
    if x < 1 / 3:
        return [1.0, 0.5, 0.25 * (1 - 3 * x)]
    if x < 2 / 3:
        return [1.0, 0.5 * (1 - (3 * x - 1))]
    return [1.0]


def record_yarn_calls() -> list[tuple[int, int]]:
    """The (old, new) long windows of #18's yarn.apply calls over the run (advance_schedule: only while the
    new window is at most 13; apply_final_ws_ext sets 27 without one)."""
    calls, ws_long = [], record_ws(0)[1]
    for step in range(N + EXT + 1):
        new = record_ws(step)[1]
        if new != ws_long and new <= 13:
            calls.append((ws_long, new))
        ws_long = new
    return calls


def test_the_schedule_at_every_step_is_the_records():
    cfg = load_recipe(RECIPE)
    assert cfg.train.steps == N + EXT
    for step in range(N + EXT):
        got = schedule_at(step, cfg)
        v = got.stage
        assert got.lr == pytest.approx(record_lr(step), rel=1e-12, abs=1e-15), step
        assert got.muon_momentum == pytest.approx(record_momentum(step), rel=1e-12), step
        assert v.batch_tokens == record_bs(step), step
        assert (v.short_window, v.long_window) == record_ws(step), step
        assert v.mtp_weights == pytest.approx(record_mtp(step), rel=1e-12, abs=1e-15), step
        assert v.max_doc_len == 4096, step  # train_max_seq_len = 128 * 16 * 2
        assert not got.frozen, step  # start_transition is never called
    final = schedule_at(N + EXT, cfg).stage
    assert (final.short_window, final.long_window) == (11, WS_POST_YARN)
    # YaRN: our window history is the chain of the record's calls, at the final validation too
    calls = record_yarn_calls()
    assert calls == [(3, 7), (7, 11), (11, 13)]
    assert schedule_at(N + EXT, cfg).yarn == (3, 7, 11, 13)
    assert schedule_at(1175, cfg).yarn == (3, 7, 11, 13) and schedule_at(1174, cfg).yarn == (3, 7, 11)
    # copy_lm_to_embed after step split_step (odd: Adam steps on odd steps only)
    split_step = math.ceil(2 / 3 / 4 * N) | 1
    assert split_step == 785 and cfg.optim.tie_until == split_step + 1 and cfg.optim.adam_every == 2


def test_the_one_step_stage_is_what_keeps_step_1175_at_x173():
    """Without it (x2 from the fourth stage's start, int(12·s/N) = 3) step 1,175 would differ."""
    assert record_bs(1175) == 524288 and record_lr(1175) == 1.73 and record_lr(1176) == 2.0
    cfg = load_recipe(RECIPE)
    stages = cfg.train.stages.split(";")
    merged = stages[:3] + [" tokens=524288 doc=4096 windows=6/13 lr=2 frac=1/12"] + stages[5:]
    other = load_recipe(RECIPE, ["train.stages=" + ";".join(merged)])
    assert schedule_at(1175, cfg).lr == pytest.approx(1.73, rel=1e-12)
    assert schedule_at(1175, other).lr == pytest.approx(2.0, rel=1e-12)


def record_18_param_count(vocab: int = 50304, d: int = 1024, layers: int = 16, heads: int = 8) -> int:
    """#18's GPT.__init__ tensors (world size 1: no padding scalars)."""
    tables = 2 + 1 + 5  # embed, lm_head, embed2, five value embeddings
    qkvo, mlp = layers * 4 * d * d, layers * 2 * 4 * d * d
    gates = 16 + 3 * 16 + layers * heads * 16 + 10 * heads * 16  # smear, skips, attention, value embeddings
    x0_lambdas, scalars = 2 * layers, 3 * layers + 5
    return tables * vocab * d + qkvo + mlp + gates + x0_lambdas + scalars


def test_the_parameter_count_is_the_records():
    cfg = load_recipe(RECIPE)
    with torch.device("meta"):
        model = build_model(cfg.model)
    assert sum(p.numel() for p in model.parameters()) == record_18_param_count() == 613_420_437
