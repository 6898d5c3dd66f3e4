"""Recipe `medium-2025-12` against track 2's record #18
(records/track_2_medium/2025-12-31_BulkSmallTrackTransfer, the code at the top of each log), its formulas
written here: get_bs, get_ws, get_lr, get_muon_momentum, the MTP schedule, the YaRN calls and the untie
step at every step; its parameter count from its tensors; the fp32 forward loss and gradients of its
model on tiny identical weights (FA3 replaced by a dense document-causal window mask, as
fidelity/test_stages_recipe.py) for what it changes over stages-2025-12: all 16 layers attend, five value
tables on both ends, three skips with a gate each, the second embedding with its x0 weight, #54's
softcap, #55's gates on 16 dims; the optimizer rows it sets (NorMuon LR x0.1 on the gates, the x0
lambdas' own Adam LR, the second embedding with the value embeddings); the memory guard's estimate."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from speedrun.model.families import build_model
from speedrun.recipes import load_recipe
from speedrun.train.schedule import apply_to_model, schedule_at
from tests.fidelity.checks import assert_loss_and_gradients_are_the_records, fp32_model
from tests.fidelity.refs import schedules
from tests.fidelity.refs.head import record_54_loss
from tests.fidelity.test_stages_recipe import record_key_shift
from tests.recipe_matrix import replace

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
    return schedules.muon_momentum(step, N + EXT)


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


# ------------------------------------------------------------------ #18's model, from its code


def record_18_forward(w, input_seq, target_seq, seqlens, ws, yarn, scale, mtp, heads, dim, training):
    """#18's GPT.forward (fp32: no FP8), the summed (MTP) loss in training, the mean in validation (its
    four chunks of equal length, each a mean, averaged: the mean). Its resid lambdas are our
    blocks.i.lambdas, its x0_lambdas.view(-1, 2) our blocks.i.x0_lambda, its skip_lambdas our skip_weights,
    its skip_gates our skip_gate.j, its sa_lambdas our attn.lambdas."""
    from tests.fidelity.test_polar_recipe import record_rotary
    from tests.fidelity.test_yarn_recipe import fa3_reference, norm, record_qkvo

    L, hd, T = 16, dim // heads, len(input_seq)
    cos, sin = yarn.cos.bfloat16().float(), yarn.sin.bfloat16().float()
    skip_connections, skip_in, skip_out, backout_layer = [], [2, 4, 6], [9, 10, 11], 11
    short_bm, long_bm = ws[0] * BLOCK, ws[1] * BLOCK
    bm_sizes = [long_bm, short_bm, short_bm, short_bm, long_bm] + [short_bm] * 6 + [long_bm] + [short_bm] * 3
    bm_sizes += [long_bm]
    key_offset = [b == long_bm for b in bm_sizes]
    x = F.embedding(input_seq, w["wte.weight"])
    ve = [F.embedding(input_seq, w[f"value_embeds.{i}.weight"]) for i in range(5)]
    ve = ve + [None] * (L - 10) + ve
    smear_gate = w["smear.gate.weight"]
    gate_out = w["smear.lamb"] * torch.sigmoid(F.linear(x[1:, : smear_gate.size(-1)], smear_gate))
    x = torch.cat([x[:1], x[1:] + gate_out * x[:-1]])
    x = x0 = norm(x[None])
    x02 = norm(F.embedding(input_seq, w["embed2.weight"])[None])
    skip_idx, x_backout = 0, None
    for i in range(L):
        if i in skip_out:
            sg = w[f"skip_gate.{skip_idx}.proj.weight"]
            gate = (
                torch.sigmoid(w["skip_weights"][skip_idx])
                * 2
                * torch.sigmoid(F.linear(x0[..., : sg.size(-1)], sg))
            )
            skip_idx += 1
            x = x + gate * skip_connections.pop()
        resid, x0l = w[f"blocks.{i}.lambdas"][0], w[f"blocks.{i}.x0_lambda"]
        if i == 0:
            x = (resid + x0l[0]) * x + x0l[1] * x02
        else:
            x = resid * x + x0l[0] * x0 + x0l[1] * x02
        h = norm(x)
        sa = w[f"blocks.{i}.attn.lambdas"]
        qkvo_w = record_qkvo(w, i, dim)
        q, k, v = (
            F.linear(h, sa[0] * qkvo_w[:3].flatten(end_dim=1)).view(1, T, 3 * heads, hd).chunk(3, dim=-2)
        )
        q, k = norm(q), norm(k)
        q, k = record_rotary(q, cos, sin), record_rotary(k, cos, sin)
        if key_offset[i]:
            k = record_key_shift(k)
        if ve[i] is not None:
            vg = w[f"blocks.{i}.attn.ve_gate.proj.weight"]
            ve_gate_out = 2 * torch.sigmoid(F.linear(h[..., : vg.size(-1)], vg)).view(1, T, heads, 1)
            v = v + ve_gate_out * ve[i].view_as(v)
        y = fa3_reference(q[0], k[0], v[0], seqlens, bm_sizes[i], scale).view(1, T, heads, hd)
        gate = w[f"blocks.{i}.attn.gate.proj.weight"]
        y = y * torch.sigmoid(F.linear(h[..., : gate.size(-1)], gate)).view(1, T, heads, 1)
        x = x + F.linear(y.contiguous().view(1, T, dim), sa[1] * qkvo_w[3])
        m = F.linear(norm(x), w[f"blocks.{i}.mlp.c_fc.weight"])
        x = x + F.linear(F.relu(m).square(), w[f"blocks.{i}.mlp.c_proj.weight"])
        if i in skip_in:
            skip_connections.append(x)
        if i == backout_layer:
            x_backout = x
    return record_54_loss(w, x, x_backout, target_seq, mtp, training)


def tiny_medium(heads: int = 2, dim: int = 64, T: int = 1024, vocab: int = 120):
    """The recipe's model at 2 heads of 32, vocab 120, fp32, every parameter moved off its init."""
    cfg, model = fp32_model(RECIPE, n_head=heads, n_embd=dim, vocab_size=vocab, max_seq_len=T)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.02 if p.ndim > 1 else 0.3))
            if "gate" in n:  # the gates start at zero: make them matter
                p.copy_(torch.randn_like(p))
    return cfg, model


@pytest.mark.parametrize(
    "step", [100, 1000, N + EXT]
)  # MTP 3 at 1/3; MTP 1 at 5/11 after YaRN 3→7→11; validation
def test_forward_loss_and_gradients_match_the_18_model_in_fp32(step):
    from tests.fidelity.test_yarn_recipe import RecordYarn

    heads, dim, T, vocab = 2, 64, 1024, 120
    cfg, model = tiny_medium(heads, dim, T, vocab)
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(0, vocab - 1, (T + 1,), generator=gen)
    seq[[0, 700]] = vocab - 1
    cu = torch.full((256,), T, dtype=torch.int32)
    cu[:2] = torch.tensor([0, 700])
    x, y = seq[:-1], seq[1:]
    training = step < N + EXT
    model.train(training)
    apply_to_model(schedule_at(step, cfg), model)
    ws = record_ws(step) if training else (WS_FINAL // 2, WS_POST_YARN)
    yarn, scale, ws_long = RecordYarn(dim // heads, T), 0.1, record_ws(0)[1]
    for s in range(step + 1):  # advance_schedule(s): yarn.apply while the new window is at most 13
        new = record_ws(s)[1]
        if new != ws_long and new <= 13:
            yarn.apply_yarn(ws_long, new)
            scale *= 0.2 * math.log(new / ws_long) + 1
        ws_long = new
    weights = {n: p.detach().clone().requires_grad_(training) for n, p in model.named_parameters()}
    with torch.set_grad_enabled(training):
        loss = model(x[None], y[None], cu)
        ref = record_18_forward(weights, x, y, cu, ws, yarn, scale, record_mtp(step), heads, dim, training)
    assert_loss_and_gradients_are_the_records(model, loss, ref, weights, T, training)


def test_initial_values_are_the_18_models():
    """#18's GPT.__init__: resid lambdas 1.05, x0 lambdas (2 per layer) 0, skip λ −1.5 (three), the
    gates zero, the second embedding N(0, 1) (nn.Embedding's default), the value embeddings zero."""
    cfg = load_recipe(RECIPE)
    model = build_model(replace(cfg.model, n_head=2, n_embd=64, vocab_size=120, max_seq_len=256))
    for block in model.blocks:
        assert block.lambdas.tolist() == pytest.approx([1.05]) and block.x0_lambda.tolist() == [0.0, 0.0]
    assert model.skip_weights.tolist() == [-1.5] * 3
    assert [s.skip_from for s in model.specs if s.skip_from is not None] == [6, 4, 2]
    assert all(not g.proj.weight.any() for g in model.skip_gate)
    assert model.embed2.weight.std().item() == pytest.approx(1.0, rel=0.05)
    assert all(not e.weight.any() for e in model.value_embeds)


def test_the_optimizer_rows_are_the_records():
    """#18's labels and multipliers: attn_gate/value_embed_gate in NorMuon at lr_mul 0.1, embed2 with the
    value embeddings (Adam 0.004 x75, wd x5), x0 lambdas at 0.004 x5 with the main betas, smear and skip
    gates at 0.004 x0.01 without decay, the scalars at 0.008 x5 with (0.9, 0.99)."""
    from speedrun.config.labels import label_table
    from speedrun.optim.rules import adam_groups, param_rules

    cfg, model = tiny_medium()
    rules = label_table(cfg.optim, 32)
    entries = param_rules(model, rules)
    by_label = {e.label.name: e.rule for e in entries}
    assert (
        by_label["gate"].rule == "normuon" and by_label["gate"].lr_mul == 0.1 and by_label["gate"].gate_rows
    )
    assert by_label["embed2"].group == "value_embed" and by_label["skip_gate"].group == "skip_gate"
    groups = adam_groups(rules, {r.group for r in by_label.values()})
    assert groups["value_embed"].lr == 0.3 and groups["x0"].lr == 0.02 and groups["scalar"].lr == 0.04
    assert tuple(groups["x0"].betas) == (0.8, 0.95) and tuple(groups["scalar"].betas) == (0.9, 0.99)
    assert groups["skip_gate"].lr == groups["smear_gate"].lr == pytest.approx(0.004 * 0.01)
    assert groups["embed"].lr == groups["head"].lr == 0.004


def test_the_memory_guards_estimate_for_8xh100_is_near_the_records_peak():
    """The compiled estimate per GPU of an 8-GPU run against `peak memory allocated: 57397 MiB` at the
    end of both #18 logs (8xH100 80 GB): above it, as our compiled PyTorch keeps more than the record's
    kernels (docs/benchmarks.md, "Memory: estimate vs records": 1.24x), and the guard lets it start."""
    from speedrun.train.plan.memory import estimate_memory, guarded_bytes

    cfg = load_recipe(RECIPE, ["train.dtype=bf16"])
    estimate = estimate_memory(cfg, 8, compiled=True).total
    assert 1.0 < estimate / (57397 * 2**20) < 1.3
    assert guarded_bytes(cfg, 8, True) < 79 * 2**30  # the guard lets it start on an H100
