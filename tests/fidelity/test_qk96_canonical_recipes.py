"""qk96-2026-08 (#90, PR #344) and canonical-2026-08 (#91, PR #350) against their record scripts: the code at
the top of records/track_1_short/2026-08-03_FP8MLPBackwardPackedQKV/candidate_h100/*.txt (refs/pull/344/head,
run with NUM_EXTENSION_ITERATIONS=45) and 2026-08-06-CanonicalMasking/pr-344-1300/*.txt (refs/pull/350/head,
#344's code with the mask, extension default 30). Their TrainingSchedule (with #88's prefix weights) and
get_muon_momentum are transcribed here and compared at every step; the parameter count from #344's
GPT.__init__ tensors; the resolved config's distinctive values; a dry run of each. The parts are tested
elsewhere against the same scripts: fidelity/test_qk_head_dim.py, fidelity/test_fp8_qkv.py (#344),
fidelity/test_mudd_gate.py (#85),
fidelity/test_record_2026_07_parts.py (#88's prefix loss, #350's mask)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from speedrun.cli import main
from speedrun.config.gpt2026 import attention_scale, qk_width
from speedrun.model.families import build_model
from speedrun.recipes import load_recipe
from speedrun.recipes.index import entry
from speedrun.train.schedule import schedule_at
from tests.fidelity.test_record_2026 import RecordSchedule, record_muon_momentum

# recipe -> (num_scheduled_iterations, num_extension_iterations) of the runs the records report
RECORDS = {"qk96-2026-08": (1270, 45), "canonical-2026-08": (1270, 30)}

# #344's (and #350's) TRAINING_STAGES: (duration, train_max_seq_len, batch_size, window_sizes, lr_mul,
# mtp_weights_start, mtp_weights_end, prefix_weight_start, prefix_weight_end)
STAGES = [
    (1 / 3, 896, 8 * 2048 * 8, (1, 3), 1.0, [1.0, 0.5, 0.25], [1.0, 0.5, 0.0], 0.25, 0.25),
    (1 / 3, 2048, 16 * 2048 * 8, (3, 7), 1.52, [1.0, 0.5], [1.0, 0.0], 0.25, 0.0),
    (1 / 3, 2048, 24 * 2048 * 8, (5, 11), 1.73, [1.0], [1.0], 0.0, 0.0),
    (None, 2048, 24 * 2048 * 8, (6, 13), 1.0, [1.0], [1.0], 0.0, 0.0),
]


class Schedule344(RecordSchedule):
    """#344's TrainingSchedule(TRAINING_STAGES, N, EXT, cooldown_frac=0.60) (split_embed_stage 2,
    ws_post_yarn_ext 20), get_lr's floor 0.15 and get_muon_momentum."""

    stages = STAGES

    def prefix_weight(self, step: int) -> float:
        stage, t = self.lookup(step)
        return stage[7] + (stage[8] - stage[7]) * t

    def muon_momentum(self, step: int) -> float:
        return record_muon_momentum(step, self.total_steps)


def test_the_boundaries_are_the_scripts():
    assert Schedule344(1270, 45).boundaries == [(0, 423), (423, 847), (847, 1270), (1270, 1315)]
    assert Schedule344(1270, 30).boundaries == [(0, 423), (423, 847), (847, 1270), (1270, 1300)]
    assert Schedule344(1270, 45).split_step == 847


@pytest.mark.parametrize("recipe", RECORDS)
def test_the_schedule_at_every_step_is_the_records(recipe):
    cfg = load_recipe(recipe)
    rec = Schedule344(*RECORDS[recipe])
    assert cfg.train.steps == rec.total_steps
    for step in range(rec.total_steps):
        got, stage = schedule_at(step, cfg), rec.lookup(step)[0]
        v = got.stage
        assert got.lr == pytest.approx(rec.get_lr(step), rel=1e-12, abs=1e-15), step
        assert got.muon_momentum == pytest.approx(rec.muon_momentum(step), rel=1e-12), step
        assert (v.batch_tokens, v.max_doc_len) == (stage[2], stage[1]), step
        assert (v.short_window, v.long_window) == stage[3], step
        assert v.mtp_weights == pytest.approx(rec.mtp_weights(step), rel=1e-12, abs=1e-15), step
        assert v.prefix_weight == pytest.approx(rec.prefix_weight(step), rel=1e-12, abs=1e-15), step
        assert not got.frozen, step
        assert got.grad_scale == pytest.approx(stage[2] / 8, rel=1e-15), step  # 1 / grad_accum_steps
    final = schedule_at(rec.total_steps, cfg).stage  # apply_final_ws_ext: the long window 20
    assert (final.short_window, final.long_window) == (6, 20)
    # copy_lm_state_to_embed after split_step (odd, an Adam step): our optimizer unties after it
    assert cfg.optim.tie_until == rec.split_step + 1 and cfg.optim.adam_every == 2
    # the prefix weight is the script's at the stage edges too (0.25 through stage 1, then to 0)
    assert [schedule_at(s, cfg).stage.prefix_weight for s in (0, 422, 423, 846, 847)] == pytest.approx(
        [0.25, 0.25, 0.25, 0.25 * (1 - 423 / 424), 0.0]
    )


def test_the_resolved_configs_are_the_scripts_values():
    a, b = load_recipe("qk96-2026-08").model, load_recipe("canonical-2026-08").model
    # #344: QK_HEAD_DIM=96 beside V 128; logits at 0.1·√(128/96)
    assert qk_width(a) == 96 and a.n_embd // a.n_head == 128 and a.attn.fp8_qkv
    assert attention_scale(a) == pytest.approx(0.1 * (128 / 96) ** 0.5, rel=1e-15)
    # #85 as HEAD f411b3d runs it: the gate network from x0 and at layer 4, gates on 3 and 10, DC on 10,
    # XSA on self.xsa_layers; #55's skip gate and #28's attention gate bank gone
    assert (a.mudd.gate_layer, a.mudd.gate_attn_layers, a.mudd.dc_layers) == (4, [3, 10], [10])
    assert a.attn.xsa_layers == [1, 3, 4, 7] and a.attn.gate == 0 and a.stream.skip_gate == 0
    assert a.mudd.sources == [7, 3]  # #81 unchanged
    # HEAD's bigram table: 50304 * 15 // 2 rows of 768 beside x0 (x = x0.clone())
    assert (a.embed.bigram_rows, a.embed.bigram_dim or a.n_embd) == (50304 * 15 // 2, 768)
    assert not a.embed.bigram_in_x0 and a.embed.bigram_sign_rows == 8192
    assert a.head.prefix_loss_weight == 0.25 and a.mlp.fp8  # #88; #84/#89's FP8 forward
    assert not a.head.canonical_val_mask and b.head.canonical_val_mask  # #350 only in #91
    assert a == replace(b, head=replace(b.head, canonical_val_mask=False))  # the model: the mask alone
    assert b.head.softcap > 0  # the mask's -60 lies below the capped logits


def record_344_param_count(world: int = 8) -> int:
    """#344's GPT.__init__ tensors: embed, lm_head, 5 value-embedding tables, the bigram table, smear and
    value-embedding gates, qk_bank (60 groups of 2·96 rows, padded to the world), vo_bank (20, padded),
    the MLP bank's 12 layers, post/resid lambdas, `scalars` (11 SA pairs, smear, skip, padding) and the
    MUDD (#81: 100,124) and gate-network (#85: 103,635) weights."""
    V, d = 50304, 768
    pad = lambda n: -(-n // world) * world  # noqa: E731
    embeddings = 2 * V * d + 5 * V * d + 50304 * 15 // 2 * 768
    gates = 12 + 5 * 6 * 12
    banks = pad(60) * 2 * 96 * d + pad(20) * d * d + 12 * 2 * 3072 * d
    lambdas = 11 * 2 + 11 * 2
    scalars = 11 * 2 + 2 + (-11 * 2 - 2) % world
    return embeddings + gates + banks + lambdas + scalars + 100_124 + 103_635


@pytest.mark.parametrize("recipe", RECORDS)
def test_the_parameter_count_is_the_records_less_what_it_allocates_unread(recipe):
    """Ours = the record's tensors at world size 1 less the MLP bank's padding layer, layer 6's SA pair
    (no attention there), and layer 10's resid/post pairs and value-embedding gate (MUDD gives those)."""
    with torch.device("meta"):
        model = build_model(load_recipe(recipe).model)
    ours = sum(p.numel() for p in model.parameters())
    assert ours == record_344_param_count(world=1) - 2 * 3072 * 768 - 2 - 4 - 6 * 12 == 632_937_817
    assert record_344_param_count(world=8) - record_344_param_count(world=1) == 4 * 192 * 768 + 4 * 768**2


def test_the_index_lists_them_as_records_90_and_91():
    a, b = entry("qk96-2026-08"), entry("canonical-2026-08")
    assert (a.record, a.time, a.date, a.steps) == ("#90", "1.13 min 8xH100", "2026-08-03", "1,315")
    assert (b.record, b.time, b.date, b.steps) == ("#91", "1.126 min 8xH100", "2026-08-06", "1,300")
    # tokens: 423 steps of 131,072, 424 of 262,144, then 423 + EXT of 393,216
    assert a.tokens == f"{round((423 * 131072 + 424 * 262144 + 468 * 393216) / 1e6)}M"
    assert b.tokens == f"{round((423 * 131072 + 424 * 262144 + 453 * 393216) / 1e6)}M"


@pytest.mark.parametrize("recipe", RECORDS)
def test_dry_run_prints_the_records_shape(recipe, capsys):
    assert main(["train", "--recipe", recipe, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "params: 632937817\n" in out and "head_dim: 128 (Q/K 96, #344)" in out
    assert ('"canonical_val_mask": true' in out) == (recipe == "canonical-2026-08")


def test_on_the_meta_device_the_canonical_mask_is_its_shape_only():
    """Counting builds (the index, --dry-run, FLOPs) skip #350's 20 s table: the same buffer, no bits."""
    from tests.fidelity.test_record_2026_07_parts import tiny

    cfg = tiny(["model.canonical_val_mask=true"], vocab_size=600, max_seq_len=64, n_embd=32)
    with torch.device("meta"):
        counted = build_model(cfg).canonical_mask
    real = build_model(cfg).canonical_mask
    assert counted.is_meta and not real.is_meta and real.any()
    assert (counted.shape, counted.dtype) == (real.shape, real.dtype) == ((640, 80), torch.uint8)


def record_val_loss(h, head_w, idx, targets, canon_mask):
    """The validation loss lines of #344 (canon_mask None: `23 * torch.sigmoid((logits + 5) / 7.5)` on the
    bf16 head output, then `.float()`) and #350 (`logits.float()` first, then the cap and the mask)."""
    logits = F.linear(h, head_w.to(torch.bfloat16))
    if canon_mask is None:
        logits = (23 * torch.sigmoid((logits + 5) / 7.5)).float().view(-1, logits.size(-1))
    else:
        logits = 23 * torch.sigmoid((logits.float() + 5) / 7.5)
        logits = logits.view(-1, logits.size(-1))
        shifts = torch.arange(8, dtype=torch.uint8)
        dropped = (canon_mask[idx.view(-1), :, None] >> shifts & 1).view(logits.shape).bool()
        logits = logits.masked_fill(dropped, -60.0)
    return F.cross_entropy(logits, targets.view(-1))


@pytest.mark.parametrize("masked", [False, True])
def test_validation_caps_in_the_dtype_of_each_records_lines(masked):
    """#344 caps the bf16 logits, #350 casts them to fp32 first and masks: each model's validation loss is
    its record's lines bit for bit, and the other record's lines differ (the check can fail)."""
    from tests.fidelity.test_record_2026_07_parts import tiny

    over = ["model.canonical_val_mask=true"] if masked else []
    cfg = tiny(over, vocab_size=600, max_seq_len=64, n_embd=32, fp8_head=True, logit_softcap=11.5,
               softcap_divisor=7.5, softcap_offset=5.0, softcap_in_bf16=True, ce_bf16=True)  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    torch.nn.init.normal_(model.lm_head.weight, std=1.0)  # logits of a few tens: the cap binds
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(1, 64, 32, generator=gen).to(torch.bfloat16)
    idx, targets = torch.randint(0, 600, (2, 1, 64), generator=gen)
    model.hidden = lambda *_: h  # the head's lines alone, on a fixed bf16 final hidden state
    with torch.no_grad():
        ours = model(idx, targets)
        mask = model.canonical_mask if masked else None
        theirs = record_val_loss(h, model.lm_head.weight, idx, targets, mask)
        none = torch.zeros(640, 80, dtype=torch.uint8)  # #350's lines with nothing to drop
        other = record_val_loss(h, model.lm_head.weight, idx, targets, None if masked else none)
    assert torch.equal(ours, theirs) and not torch.equal(ours, other)
    if masked:  # the mask drops pairs on these ids: the masked loss is below the unmasked fp32 one
        assert (model.canonical_mask[idx.view(-1)] != 0).any()
