"""#92's ("ANVIL2", PR #360) schedule at every one of its 1,194 steps against the record's code: the
TrainingSchedule, get_rail_beta, _sns_p_at, _ptp_w_at, the value-embedding cadence and the virtual attention
cap of the train_gpt.py at the top of records/track_1_short/2026-08-30_ANVIL2/this_pr/*.txt (commit fd1b14a5;
the refactor track_1_short/{config,schedule,training}.py at 55865738 / f380c1f0 has the same numbers),
transcribed here. Where the record's README and its code differ, the code (and the log it printed) wins:
the LR floor is 0.30 (the README: 0.20), and with the 52 grown steps P changes at 681, 965 and 1107 and the
taper starts at 1107 (the README's 961 and 1101 are an earlier 46-step growth's). The schedule keys are
given here (ANVIL_SCHEDULE) as `anvil-2026-08` must carry them; the model parts of #92 are tested apart."""

from __future__ import annotations

from itertools import accumulate

import numpy as np
import pytest
import torch

from speedrun.config.stages import parse_stages, stage_plan
from speedrun.data.bos_loader import cu_seqlens, record_max_docs
from speedrun.errors import ConfigError
from speedrun.optim import anvil
from speedrun.optim.anvil import Rails, ShardedAnvilAdam
from speedrun.optim.cautious_adam import AdamLabel
from speedrun.optim.table import Row
from speedrun.recipes import load_recipe
from speedrun.train import schedule
from speedrun.train.schedule import schedule_at
from speedrun.train.stages import candidate_changes, stage_bounds
from tests.fidelity.test_record_2026 import RecordSchedule

# The schedule keys of `anvil-2026-08` ([train] and [optim]; the model's model.head.sampled_stride = 20011 is
# what sampled= needs). The fractions are the record's STAGE_DURATIONS [0.2854, 0.3209, 0.3931] over their
# sum 0.9994, stage 3 less the taper's 0.06; stage 3 grows by 52 steps; the taper's LR is 1.73·√(20/24).
ANVIL_STAGES = (
    "tokens=131072 doc=896 windows=1/3 lr=1 frac=0.2854/0.9994 mtp=1,0.5,0.25>1,0.5,0 prefix=0.25 "
    "sampled=10240; "
    "tokens=262144 doc=2048 windows=3/7 lr=1.52 frac=0.3209/0.9994 mtp=1,0.5>1,0 prefix=0.2,0.15,0.1,0.05 "
    "sampled=10240; "
    "tokens=393216 doc=3072 segment=2560 windows=5/11 lr=1.73 frac=0.333136/0.9994 grow=52 prefix=0 "
    "sampled=14336,14336,24576; "
    "tokens=327680 doc=3072 segment=2560 windows=5/11 lr=1.579266707473229 frac=0.06 prefix=0; "
    "tokens=131072 doc=3072 segment=2560 windows=6/13 ext=20 val=6/20 yarn=13 prefix=0"
)
ANVIL_SCHEDULE = {
    "train.steps": 1194,  # 1,122 scheduled + 52 grown + 20 extension
    "train.stages": ANVIL_STAGES,
    "train.warmdown_frac": 0.8,  # cooldown_frac=0.80
    "train.final_lr_frac": 0.3,  # LR_FLOOR = 0.30 (the README says 0.20)
    "optim.muon_momentum_start": 0.85,  # get_rail_beta: 0.85 -> 0.93 over 240 steps, back over the last 50
    "optim.muon_momentum": 0.93,
    "optim.muon_momentum_warmup_steps": 240,
    "optim.muon_momentum_cooldown_steps": 50,
    "optim.anvil_engage_step": 514,  # _RAIL_ENGAGE_STEP: then _RAIL_FAST_BETA 0.85, _RAIL_FAST_W 0.4385
    "optim.anvil_fast_beta": 0.85,
    "optim.anvil_fast_weight": 0.4385,
    "optim.adam_every": 2,  # Adam on odd steps
    "optim.value_embed_every4_from": 336,  # VEMB/NGRAM_ADAM_PERIOD4_START
    "optim.tie_until": 1176,  # split_step = boundaries[4][0] | 1 = 1175: untied after it
}


def anvil_config(**more):
    """`qk96-2026-08` (#90: stages, MTP, YaRN, the prefix loss) with #92's schedule keys and ANVIL."""
    keys = {**ANVIL_SCHEDULE, "optim.name": "anvil", "model.head.sampled_stride": 20011, **more}
    return load_recipe("qk96-2026-08", [f"{k}={v}" for k, v in keys.items()])


# ------------------------------------------------------------------------------------------------------
# The record, transcribed: TRAINING_STAGES (duration, train_max_seq_len, batch_size, window_sizes, lr_mul,
# mtp_weights_start, mtp_weights_end) and TrainingSchedule with SCHEDULE_GROWTH_STEPS into stage index 2

DURATIONS = [d / sum([0.2854, 0.3209, 0.3931]) for d in [0.2854, 0.3209, 0.3931]]
STAGES_92 = [
    (DURATIONS[0], 896, 8 * 2048 * 8, (1, 3), 1.0, [1.0, 0.5, 0.25], [1.0, 0.5, 0.0]),
    (DURATIONS[1], 2048, 16 * 2048 * 8, (3, 7), 1.52, [1.0, 0.5], [1.0, 0.0]),
    (DURATIONS[2] - 0.06, 3072, 24 * 2048 * 8, (5, 11), 1.73, [1.0], [1.0]),
    (0.06, 3072, 20 * 2048 * 8, (5, 11), 1.73 * (20 / 24) ** 0.5, [1.0], [1.0]),
    (None, 3072, 8 * 2048 * 8, (6, 13), 1.0, [1.0], [1.0]),
]
GROWTH_STEPS, GROWTH_STAGE, VIRTUAL_SEQ_CAP, LR_FLOOR = 52, 2, 2560, 0.30
SNS_PER_STAGE, SNS_RAMP = [10240, 10240, 10240, 32768, 32768], {2: [14336, 14336, 24576]}
PERIOD4_START, ENGAGE, FAST_BETA, FAST_W = 336, 514, 0.85, 0.4385


class Schedule92(RecordSchedule):
    """TrainingSchedule(TRAINING_STAGES, 1122, 20, cooldown_frac=0.80, split_embed_stage=4,
    ws_post_yarn_ext=20) with the growth, get_lr's LR_FLOOR, and the step functions around it."""

    stages = STAGES_92
    lr_floor = LR_FLOOR

    def __init__(self, scheduled: int = 1122, extension: int = 20):
        self.cooldown_frac = 0.80
        self.scheduled = scheduled + GROWTH_STEPS  # the cool-down spans the grown steps too
        self.total_steps = self.scheduled + extension
        ends = [
            0,
            *[round(c * scheduled) for c in accumulate(s[0] for s in self.stages[:-1])],
            self.total_steps,
        ]
        ends[GROWTH_STAGE + 1 : -1] = [e + GROWTH_STEPS for e in ends[GROWTH_STAGE + 1 : -1]]
        assert self.scheduled == ends[-2]
        self.ends = ends
        self.boundaries = list(zip(ends[:-1], ends[1:], strict=True))
        self.split_step = self.boundaries[4][0] | 1

    def rail_beta(self, step: int) -> float:
        """get_rail_beta(step): ANVIL's scheduled fast-rail beta and Nesterov lookahead."""
        cd_start = self.total_steps - 50
        if step < 240:
            return 0.85 + step / 240 * (0.93 - 0.85)
        if step > cd_start:
            return 0.93 - (step - cd_start) / 50 * (0.93 - 0.85)
        return 0.93

    def rails(self, step: int) -> tuple[float, float]:
        """step_optimizers' (_bimax_bf, _bimax_w): the fast rail's beta and blend weight."""
        return (FAST_BETA, FAST_W) if step >= ENGAGE else (self.rail_beta(step), 1.0)

    def sns_p(self, step: int) -> int:
        """_sns_p_at(step), _SNS_UNTIL_RESOLVED = boundaries[2][1]."""
        if step >= self.boundaries[2][1]:
            return 0
        i, (a, b) = next((i, bd) for i, bd in enumerate(self.boundaries) if step < bd[1])
        ramp = SNS_RAMP.get(i)
        return ramp[(step - a) * len(ramp) // (b - a)] if ramp else SNS_PER_STAGE[i]

    def prefix_weight(self, step: int) -> float:
        """_ptp_w_at(step)."""
        s1e, s2e = self.boundaries[0][1], self.boundaries[1][1]
        if step < s1e:
            return 0.25
        if step < s2e:
            t = (step - s1e) / max(1, s2e - s1e)
            return [0.20, 0.15, 0.10, 0.05][min(3, int(t * 4))]
        return 0.0

    def attention_len(self, step: int) -> int:
        """ForwardScheduleConfig.train_max_seq_len: min(train_max_seq_len, VIRTUAL_SEQ_CAP)."""
        return min(self.lookup(step)[0][1], VIRTUAL_SEQ_CAP)


def record_virtual_ends(cum_lengths: list[int], cap: int) -> list[int]:
    """distributed_data_generator's `_virtual_ends` (documents' ends in a rank's batch -> segment ends)."""
    edges = [0, *cum_lengths]
    return [0, *(e for a, b in zip(edges[:-1], edges[1:], strict=True) for e in (*range(a + cap, b, cap), b))]


def value_embed_fired(step: int) -> bool:
    """_vemb_shard_fired(step): Adam on odd steps, from VEMB_ADAM_PERIOD4_START on steps = 3 (mod 4)."""
    return step % 2 == 1 and (step % 4 == 3 or step < PERIOD4_START)


def test_the_boundaries_and_switch_steps_are_what_the_record_logged():
    rec = Schedule92()
    assert rec.ends == [0, 320, 681, 1107, 1174, 1194]  # the log: "[schedule] stage ends=[...]"
    assert rec.split_step == 1175 and rec.total_steps == 1194
    plan = parse_stages(ANVIL_STAGES, 1194)
    assert stage_bounds(plan) == rec.boundaries
    assert (plan.scheduled_steps, plan.grown_steps, plan.extension_steps) == (1174, 52, 20)
    # the log's "[graph:step] ... first steps [0, 320, 411, 501, 591, 681, 965, 1107, 1174]": the stage
    # starts, the prefix weight's quarters of stage 2 and P's changes
    assert candidate_changes(plan) == [681, 965, 1107]
    cfg = anvil_config()
    prefix = [schedule_at(s, cfg).stage.prefix_weight for s in range(1194)]
    assert [s for s in range(1, 1194) if prefix[s] != prefix[s - 1]] == [320, 411, 501, 591, 681]


def test_the_schedule_at_every_step_is_the_records():
    cfg, rec = anvil_config(), Schedule92()
    assert cfg.train.steps == rec.total_steps == 1194
    for step in range(rec.total_steps):
        got, stage = schedule_at(step, cfg), rec.lookup(step)[0]
        v = got.stage
        assert got.lr == pytest.approx(rec.get_lr(step), rel=1e-12, abs=1e-15), step
        assert got.muon_momentum == pytest.approx(rec.rail_beta(step), rel=1e-12), step
        assert (v.batch_tokens, v.max_doc_len) == (stage[2], stage[1]), step
        assert v.attention_len == rec.attention_len(step), step
        assert v.segment == (VIRTUAL_SEQ_CAP if stage[1] > VIRTUAL_SEQ_CAP else 0), step
        assert (v.short_window, v.long_window) == stage[3], step
        assert v.mtp_weights == pytest.approx(rec.mtp_weights(step), rel=1e-12, abs=1e-15), step
        assert v.prefix_weight == pytest.approx(rec.prefix_weight(step), rel=1e-12, abs=1e-15), step
        assert v.candidates == rec.sns_p(step), step
        assert not got.frozen, step
        assert got.grad_scale == pytest.approx(stage[2] / 8, rel=1e-15), step
    final = schedule_at(rec.total_steps, cfg)  # apply_final_ws_ext: long window 20, YaRN left at 13
    assert (final.stage.short_window, final.stage.long_window, final.stage.candidates) == (6, 20, 0)
    assert final.yarn == (3, 7, 11, 13) and final.yarn_short == (1, 3, 5, 6)
    assert cfg.optim.tie_until == rec.split_step + 1 and cfg.optim.adam_every == 2


def test_the_optimizer_follows_the_records_rails_cadence_and_split_at_every_step(monkeypatch):
    """A tiny ShardedAnvilAdam built from the config's keys (as optim/build.py does) runs all 1,194 steps
    with the schedule written into its groups by apply_schedule: the fast rail's beta, the blend weight and
    the lookahead μ it uses, when the value embeddings step and on which betas, and when the embedding
    unties from the head, each against the record's step_optimizers."""
    cfg, rec = anvil_config(), Schedule92()
    o = cfg.optim
    used: list[tuple[float, float, float]] = []
    plain = anvil.twin_rail_nesterov_

    def spy(grad, fast, slow, fast_beta, slow_beta, weight, mu):
        used.append((fast_beta, weight, mu))
        return plain(grad, fast, slow, fast_beta, slow_beta, weight, mu)

    monkeypatch.setattr(anvil, "twin_rail_nesterov_", spy)
    monkeypatch.setattr(schedule, "apply_to_model", lambda values, model: None)  # no model here
    gen = torch.Generator().manual_seed(0)
    p = {
        n: torch.nn.Parameter(torch.randn(4, 4, generator=gen)) for n in ("m", "embed", "head", "value_embed")
    }
    rows = [Row("m", p["m"], "normuon", "matrix", True)] + [
        Row(n, p[n], "adam", n, True) for n in list(p)[1:]
    ]
    adam = {n: AdamLabel(0.008, (0.5, 0.95), 0.0, 1e-10) for n in ("embed", "head")}
    adam["value_embed"] = AdamLabel(0.56, (0.75, 0.95), 0.025, 1e-10)
    rails = Rails(o.anvil_slow_beta, o.anvil_fast_beta, o.anvil_fast_weight, o.anvil_engage_step)
    opt = ShardedAnvilAdam(
        rows, adam, muon_lr=0.023, momentum=o.muon_momentum_start, beta2=0.9, muon_weight_decay=0.0,
        rails=rails, ns_dtype=torch.float32, adam_every=o.adam_every, every4_from=o.value_embed_every4_from,
        tie=(p["embed"], p["head"], o.tie_until),
    )  # fmt: skip
    for group in opt.param_groups:
        group["initial_lr"] = group["lr"]
    hypers, hyper = [], opt._adam_hyper  # (step, betas, decay) of each value_embed update

    def spy_hyper(label: str) -> AdamLabel:
        h = hyper(label)
        hypers.extend([(opt.steps_done, h.betas, h.weight_decay)] * (label == "value_embed"))
        return h

    opt._adam_hyper = spy_hyper
    grads = {n: torch.randn(4, 4, generator=gen) * 1e-3 for n in p}
    ve_steps = 0
    for step in range(rec.total_steps):
        schedule.apply_schedule(schedule_at(step, cfg), opt, None)
        for n, t in p.items():
            t.grad = grads[n].clone()
        opt.step()
        assert used[-1] == pytest.approx((*rec.rails(step), rec.rail_beta(step)), rel=1e-12), step
        ve_steps += value_embed_fired(step)
        assert opt.adam_steps["value_embed"] == ve_steps, step
        assert opt.tied == (step < rec.split_step), step  # copy_lm_state_to_embed at the split step
    assert len(used) == rec.total_steps and ve_steps == 168 + 214  # odd steps to 335, then 339, 343 … 1191
    late = PERIOD4_START <= np.array([s for s, _, _ in hypers])
    assert [s for s, _, _ in hypers] == [s for s in range(rec.total_steps) if value_embed_fired(s)]
    for (_, betas, wd), squared in zip(hypers, late, strict=True):  # value_embed_betas_and_wd_mul
        assert betas == ((0.75**2, 0.95**2) if squared else (0.75, 0.95)) and wd == 0.025 * (1 + squared)


def test_attention_segments_are_the_records_virtual_ends():
    """cu_seqlens with segment=2560 against distributed_data_generator's _virtual_ends on random documents
    (some far longer than the cap, some ending exactly on it)."""
    rng = np.random.default_rng(0)
    for trial in range(50):
        lengths = list(rng.integers(1, 9000, size=rng.integers(1, 12)))
        if trial % 5 == 0:
            lengths[0] = 2 * VIRTUAL_SEQ_CAP  # a cut lands exactly on the next document's start
        n = sum(lengths)
        inputs = np.ones(n, dtype=np.int64)
        inputs[np.cumsum([0, *lengths[:-1]])] = 0  # BOS
        want = record_virtual_ends(list(np.cumsum(lengths)), VIRTUAL_SEQ_CAP)
        max_docs = len(want) + 3
        got, dropped = cu_seqlens(inputs, 0, max_docs, VIRTUAL_SEQ_CAP)
        table = np.full(max_docs, n)
        table[: len(want)] = want  # the record's _cum_lengths
        assert dropped == 0 and list(got) == list(table), trial
        assert max(np.diff(want)) <= VIRTUAL_SEQ_CAP
        plain, _ = cu_seqlens(inputs, 0, max_docs)  # without a segment: the documents alone
        assert list(plain[: len(lengths) + 1]) == [0, *np.cumsum(lengths)]


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("ext=20", "ext=20 grow=5", "'grow=5' is not key=value with a key of"),
        ("segment=2560 windows=5/11 lr=1.73", "segment=3072 windows=5/11 lr=1.73", r"below doc= \(3072\)"),
        (
            "segment=2560 windows=5/11 lr=1.73",
            "segment=0 windows=5/11 lr=1.73",
            "segment=0 must be at least 1",
        ),
        ("prefix=0.2,0.15,0.1,0.05", "prefix=0.2,0.15,x,0.05", "prefix='x' is not a valid number"),
        ("grow=52", "grow=1200", "ext=20 and grow=1200 leave -26 of train.steps"),
        ("grow=52", "grow=-1", "grow must be a finite number >= 0"),
    ],
)
def test_each_new_stage_key_is_refused_in_one_line_at_the_config_edge(old, new, message):
    stages = ANVIL_STAGES.replace(old, new, 1)
    assert stages != ANVIL_STAGES
    with pytest.raises(ConfigError, match=message) as caught:
        anvil_config(**{"train.stages": stages})
    assert "\n" not in str(caught.value)


def test_a_second_growing_stage_moves_every_later_boundary_and_growth_needs_rounded_boundaries():
    plan = parse_stages(ANVIL_STAGES.replace("frac=0.06 prefix=0;", "frac=0.06 grow=3 prefix=0;", 1), 1197)
    assert stage_bounds(plan) == [(0, 320), (320, 681), (681, 1107), (1107, 1177), (1177, 1197)]
    assert plan.grown_steps == 55
    with pytest.raises(ConfigError, match="grow= needs train.stage_bounds=round"):
        anvil_config(**{"train.stage_bounds": "fraction"})


def test_the_recipe_carries_these_keys():
    """anvil-2026-08 (the model side writes it) must carry ANVIL_SCHEDULE as given here."""
    try:
        cfg = load_recipe("anvil-2026-08")
    except ConfigError:
        pytest.skip("anvil-2026-08 is not in this tree yet")
    for key, value in ANVIL_SCHEDULE.items():
        section, name = key.split(".")
        if key != "train.stages":  # the recipe may wrap its lines: compared as plans below
            assert getattr(getattr(cfg, section), name) == value, key
    assert stage_plan(cfg) == stage_plan(anvil_config())
    assert cfg.model.head.sampled_stride == 20011 and cfg.optim.name == "anvil"


def test_the_runs_loader_and_model_get_the_attention_segments(tmp_path):
    """The run's own loader (train/plan/run_data.open_loader, over one synthetic shard) cuts segments of at
    most 2,560 tokens from stage 3 on and none before; the model's varlen windows carry min(doc, 2560) as the
    longest stretch attended (FA3's max_seqlen)."""
    from types import SimpleNamespace

    from speedrun.model.gpt2026 import windows
    from speedrun.tools import bench
    from speedrun.train.distributed import DistContext

    cfg, rec = anvil_config(), Schedule92()
    loader = bench.synthetic_loader(cfg, DistContext(0, 0, 1, torch.device("cpu")), tmp_path)
    try:
        for step in (680, 681, 1107, 1174):
            state = {**loader.state_dict(), "step": step, "micro_step": 0}
            loader.load_state_dict(state)
            x, _, cu = (t.numpy() for t in loader.next_packed())
            starts = list(np.flatnonzero(x == cfg.model.eot_id)) + [len(x)]
            cut = VIRTUAL_SEQ_CAP if rec.lookup(step)[0][1] > VIRTUAL_SEQ_CAP else len(x)
            want = record_virtual_ends(starts[1:], cut)
            table = np.full(record_max_docs(len(x)), len(x))
            table[: len(want)] = want
            assert list(cu) == list(table), step
            assert (want != [0, *starts[1:]]) == (step >= 681), step  # the cap cut ~1,000-token documents
    finally:
        loader.close()
    for step in (0, 320, 681, 1107, 1174):
        values = schedule_at(step, cfg)
        model = SimpleNamespace(mtp_weights=None, prefix_weight=None, sampled_sweep=None)
        model.yarn_windows = (values.yarn, values.yarn_short)  # YaRN's tables are test_yarn's
        windows.apply_schedule(model, values)
        assert model.varlen_windows.max_doc_len == rec.attention_len(step), step


@pytest.mark.slow
def test_the_shrunk_schedule_trains_through_the_loop_with_segments_growth_and_stepped_prefix(
    text_data, tmp_path
):
    """qk96-2026-08 shrunk with ANVIL and a plan of #92's form (documents cut at 128 tokens attending in
    segments of 48, two steps grown into stage 2, the prefix weight stepped, a batch taper): the loop
    runs every stage to finite losses and a validation, and logs the plan."""
    import json
    import math

    from speedrun.train import loop
    from tests.recipe_matrix import shrink

    eot = json.loads((text_data / "meta.json").read_text())["eot_id"]
    stages = (
        "tokens=512 doc=128 windows=1/1 frac=1/2; "
        "tokens=1024 doc=128 segment=48 windows=1/2 frac=1/2 grow=2; "
        "tokens=512 doc=128 segment=48 windows=1/2 ext=1"
    )
    over = [*shrink("record-2026-07"), f"data.dir={text_data}", "data.tokenizer=bpe:512",
            f"model.eot_id={eot}", "optim.name=anvil", "optim.anvil_engage_step=3",
            "optim.value_embed_every4_from=4", "train.steps=7", f"train.stages={stages}",
            "train.global_batch_tokens=1024", "train.log_every=1", "data.max_docs=0",
            "train.val_tokens=1024"]  # fmt: skip
    cfg = load_recipe("record-2026-07", over)
    loop.train(cfg, tmp_path / "run")
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train_loss"] for r in lines if "train_loss" in r]
    assert len(losses) == 7 and all(math.isfinite(v) for v in losses)
    assert any("val_loss" in r and math.isfinite(r["val_loss"]) for r in lines)
    log = (tmp_path / "run" / "log.txt").read_text()
    assert "attention segments <= 48 (2 steps grown)" in log
