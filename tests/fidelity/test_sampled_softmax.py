"""#92's sampled softcapped cross-entropy (model/gpt2026/sampled.py; P from train/stages.py): the loss
equals a reference written here (dense logits, the candidate columns gathered, softcap, logsumexp over
them), equals the full cross-entropy when P covers the vocabulary, and its gradients equal the
reference's; the candidate set is the record's build (every target, then the sweep's free classes from
the step's start); the fixed-max LSE is the plain logsumexp; validation is the full softmax while the
schedule samples; the P schedule is #92's. All in fp64 on the CPU, so no kernel choice changes a digit
beyond rounding."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from speedrun.config.stages import parse_stages
from speedrun.errors import ConfigError
from speedrun.model.families import build_model
from speedrun.model.gpt2026 import head, prefix, sampled
from speedrun.model.layers import CastedLinear, softcap
from speedrun.recipes import load_recipe
from speedrun.train.schedule import apply_to_model, schedule_at
from speedrun.train.stages import candidate_changes, stage_values
from tests import two_processes
from tests.conftest import read_metrics, run_speedrun
from tests.fidelity.test_yarn_recipe import RECIPE, shrunk_overrides

V, D, STRIDE = 96, 16, 29  # a small vocabulary; 29 is coprime with 96
CAP, DIVISOR, OFFSET = 11.5, 7.5, 5.0  # #54's 23·sigmoid((z + 5)/7.5)
PART = load_recipe("demo-2026").model.head.__class__(
    softcap=CAP, softcap_divisor=DIVISOR, softcap_offset=OFFSET, fp8=False, sampled_stride=STRIDE
)


def record_candidates(targets: np.ndarray, count: int, start: int, vocab: int, stride: int) -> list[int]:
    """#92's CandidateBuilder.build, written out: mark the targets, then the next classes of the sweep
    k·stride mod V from `start` that are not marked, until there are P; ascending ids."""
    order = [(k * stride) % vocab for k in range(vocab)]
    chosen = set(int(t) for t in targets.reshape(-1))
    for k in range(vocab):
        if len(chosen) == count:
            break
        chosen.add(order[(start + k) % vocab])
    return sorted(chosen)


def reference_loss(x, weight, targets, cand, mtp_w, table, prefix_w) -> torch.Tensor:
    """Dense logits, the candidates' columns, the record's softcap and a logsumexp over them; MTP over
    y_{t+k} within a row, the prefix target where it is a candidate; the sum over B·T."""
    B, T = targets.shape
    logits = x @ weight.T
    z = 2 * CAP * torch.sigmoid((logits + OFFSET) / DIVISOR)[..., cand]
    lse = torch.logsumexp(z, dim=-1)
    where = {c: i for i, c in enumerate(cand)}
    total = torch.zeros((), dtype=x.dtype)
    for b in range(B):
        for t in range(T):
            for k, w in enumerate(mtp_w):
                if t + k < T:
                    total = total + w * (lse[b, t] - z[b, t, where[int(targets[b, t + k])]])
            p = int(table[targets[b, t]]) if table is not None else -1
            if p >= 0 and p in where:
                total = total + prefix_w * (lse[b, t] - z[b, t, where[p]])
    return total / (B * T)


class Head(torch.nn.Module):
    """What sampled.loss reads of the model: the head and the loss buffers (head.register_buffers')."""

    def __init__(self, mtp: list[float] | None = None, table: torch.Tensor | None = None, pw: float = 0.0):
        super().__init__()
        self.lm_head = CastedLinear(D, V, bias=False).double()
        torch.nn.init.normal_(self.lm_head.weight, std=0.5)
        self.sampled_sweep = sampled.sweep(V, STRIDE)
        self.sampled_start = torch.tensor(0)
        self.mtp_weights = torch.tensor(mtp, dtype=torch.float64) if mtp else None
        self.prefix_table = table
        self.prefix_weight = torch.tensor(pw, dtype=torch.float64) if table is not None else None


def batch(seed: int, B: int = 2, T: int = 12, classes: int = V) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, D, generator=g, dtype=torch.float64), torch.randint(
        0, classes, (B, T), generator=g
    )


@pytest.mark.parametrize("start", [0, 37, 95])
def test_the_candidate_set_is_the_records_build_every_target_distinct_and_p_wide(start):
    _, targets = batch(1, classes=40)
    count = 48
    got = sampled.candidate_set(targets, count, torch.tensor(start), sampled.sweep(V, STRIDE)).tolist()
    assert got == record_candidates(targets.numpy(), count, start, V, STRIDE)
    assert len(got) == len(set(got)) == count and got == sorted(got)
    assert set(targets.reshape(-1).tolist()) <= set(got)


def test_the_candidate_set_moves_with_the_sweep_start_and_covers_the_vocabulary_over_steps():
    _, targets = batch(2, classes=8)  # few targets: most of each set is negatives
    order, count, seen, sets = sampled.sweep(V, STRIDE), 25, set(), []
    for step in range(12):  # the start moves by P a step (train/stages.sweep_position)
        cand = sampled.candidate_set(targets, count, torch.tensor(step * count % V), order).tolist()
        sets.append(cand)
        seen |= set(cand)
    assert all(a != b for a, b in zip(sets, sets[1:], strict=False)) and seen == set(range(V))


def test_more_distinct_targets_than_p_is_refused():
    _, targets = batch(3, B=1, T=40, classes=V)
    with pytest.raises(RuntimeError, match="more distinct targets"):
        sampled.candidate_set(targets, 8, torch.tensor(0), sampled.sweep(V, STRIDE))


def test_the_fixed_max_logsumexp_equals_the_plain_logsumexp():
    z = 2 * CAP * torch.sigmoid(torch.randn(5, 300, dtype=torch.float64) * 6)  # in (0, 23]
    torch.testing.assert_close(
        sampled.fixed_max_logsumexp(z, 2 * CAP), torch.logsumexp(z, -1), rtol=0, atol=1e-12
    )


@pytest.mark.parametrize("mtp, with_prefix", [(None, False), ([1.0, 0.5, 0.25], False), ([1.0, 0.5], True)])
def test_the_loss_and_its_gradients_equal_the_gathered_reference(mtp, with_prefix):
    table = torch.tensor([-1 if c % 3 == 0 else c // 2 for c in range(V)]) if with_prefix else None
    model = Head(mtp, table, 0.25)
    model.sampled_start.fill_(41)
    x, targets = batch(4, classes=30)
    x.requires_grad_(True)
    count = 40
    got = sampled.loss(model, x, targets, PART, count)
    cand = record_candidates(targets.numpy(), count, 41, V, STRIDE)
    w = model.lm_head.weight.detach().clone().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    want = reference_loss(x_ref, w, targets, cand, mtp or [1.0], table, 0.25)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    got.backward()
    want.backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(model.lm_head.weight.grad, w.grad, rtol=1e-10, atol=1e-12)
    outside = sorted(set(range(V)) - set(cand))
    assert model.lm_head.weight.grad[outside].abs().max() == 0  # only the candidates' rows learn


def test_with_p_the_whole_vocabulary_it_is_the_full_softcapped_cross_entropy():
    table = torch.tensor([-1 if c % 4 == 0 else c // 3 for c in range(V)])
    model = Head([1.0, 0.5], table, 0.25)
    x, targets = batch(5)
    got = sampled.loss(model, x, targets, PART, V)
    logits = softcap(model.lm_head(x), CAP, "sigmoid", DIVISOR, OFFSET)  # fp64; the head's loss functions
    full = head.mtp_loss(logits, targets, model.mtp_weights)
    full = full + prefix.prefix_loss(logits, targets, table, model.prefix_weight)
    torch.testing.assert_close(got, full, rtol=1e-12, atol=1e-12)
    plain = Head()
    plain.lm_head.load_state_dict(model.lm_head.state_dict())
    want = F.cross_entropy(
        softcap(plain.lm_head(x), CAP, "sigmoid", DIVISOR, OFFSET).view(-1, V), targets.view(-1)
    )
    torch.testing.assert_close(sampled.loss(plain, x, targets, PART, V), want, rtol=1e-12, atol=1e-12)


# The P switches of #92's README (681, 961, 1101: an earlier 46-step growth; the shipped plan's 681, 965 and
# 1107 are fidelity/test_anvil_schedule.py's): 10,240 through stages 1 and 2 (ending at 681), 14,336, 14,336,
# 24,576
# over the thirds of stage 3 (681-1100), then the taper and extension in full
RECORD_92 = (
    "tokens=131072 windows=1/3 frac=227/1161 sampled=10240; "
    "tokens=262144 windows=3/7 frac=454/1161 sampled=10240; "
    "tokens=393216 windows=5/11 frac=420/1161 sampled=14336,14336,24576; "
    "tokens=327680 windows=5/11 frac=60/1161; tokens=131072 windows=6/13 ext=20"
)


def test_the_p_schedule_is_records_92():
    plan = parse_stages(RECORD_92, 1181)
    got = {s: stage_values(s, plan).candidates for s in (0, 680, 681, 960, 961, 1100, 1101, 1180, 1181)}
    assert got == {0: 10240, 680: 10240, 681: 14336, 960: 14336, 961: 24576, 1100: 24576, 1101: 0,
                   1180: 0, 1181: 0}  # fmt: skip
    assert candidate_changes(plan) == [681, 961, 1101]
    # each step's negatives start where the previous step's P ended
    counts = [stage_values(k, plan).candidates for k in range(1181)]
    for s in (1, 681, 700, 961, 1101, 1150):
        assert stage_values(s, plan).sweep_start == sum(counts[:s])


def test_a_sampled_stage_needs_the_stride_and_p_within_the_vocabulary():
    record = load_recipe("record-2026-07")
    stages = record.train.stages.replace("frac=1/3 mtp=1,0.5,0.25", "frac=1/3 sampled={p} mtp=1,0.5,0.25", 1)
    assert stages != record.train.stages
    with pytest.raises(ConfigError, match="sampled= needs model.head.sampled_stride"):
        load_recipe("record-2026-07", [f"train.stages={stages.format(p=10240)}"])
    with pytest.raises(ConfigError, match="exceeds model.vocab_size"):
        load_recipe(
            "record-2026-07", ["model.head.sampled_stride=20011", f"train.stages={stages.format(p=60000)}"]
        )
    with pytest.raises(ConfigError, match="coprime"):
        load_recipe(
            "record-2026-07", ["model.head.sampled_stride=2", f"train.stages={stages.format(p=10240)}"]
        )
    with pytest.raises(ConfigError, match="no stage of train.stages samples"):
        load_recipe("record-2026-07", ["model.head.sampled_stride=20011"])
    cfg = load_recipe(
        "record-2026-07", ["model.head.sampled_stride=20011", f"train.stages={stages.format(p=10240)}"]
    )
    assert cfg.model.head.sampled_stride == 20011 and math.gcd(20011, 50304) == 1  # the record's stride


def sampled_overrides(text_data) -> list[str]:
    """test_yarn_recipe's shrunk stages (4 micro-batches of 256 tokens a step, vocabulary 512) with P = 300,
    then 320 and 400 over stage 2's halves."""
    base = [a for a in shrunk_overrides(text_data) if not a.startswith("train.stages=")]
    stage = "tokens=1024 doc=128 windows="
    return [
        *base, "model.head.sampled_stride=20011",
        f"train.stages={stage}1/1 frac=1/2 sampled=300; {stage}1/2 frac=1/2 sampled=320,400; "
        f"{stage}1/2 ext=0",
    ]  # fmt: skip


def test_training_samples_and_validation_is_the_full_softmax_while_the_schedule_samples(text_data):
    cfg = load_recipe(RECIPE, sampled_overrides(text_data))
    torch.manual_seed(0)
    model = build_model(cfg.model)
    with torch.no_grad():
        model.lm_head.weight.normal_(std=0.05)
    apply_to_model(schedule_at(0, cfg), model)
    assert model.sampled_candidates == 300
    idx = torch.randint(0, cfg.model.eot_id, (1, 257), generator=torch.Generator().manual_seed(3))
    x, y = idx[:, :-1], idx[:, 1:]
    full = F.cross_entropy(model.eval()(x).view(-1, model.lm_head.weight.size(0)), y.reshape(-1))
    with torch.no_grad():
        evaluated = model.eval()(x, y)  # the validation forward, P still set
        trained = model.train()(x, y)
    torch.testing.assert_close(evaluated, full, rtol=1e-6, atol=1e-6)
    assert trained < full - 1e-3  # over 300 of 512 classes: a smaller normalizer
    with pytest.raises(AssertionError, match="validation is the full softmax"):
        sampled.loss(model.eval(), torch.zeros(1, 4, cfg.model.n_embd), y[:, :4], cfg.model.head, 300)


two_processes.job("sampled-softmax", lambda data: ["--recipe", RECIPE, *sampled_overrides(data)])


@pytest.mark.slow
@two_processes.SHARED
def test_one_and_two_processes_train_the_sampled_softmax_alike(text_data, tmp_path, tmp_path_factory):
    """Every micro-batch's candidate set is a function of the step and its own targets, so 1 process
    (4 micro-steps) and 2 (2 each) give the same losses: job `sampled-softmax` of tests/two_processes.py."""
    out = tmp_path / "run1"
    res = run_speedrun("train", "--recipe", RECIPE, "--out", str(out), *sampled_overrides(text_data))
    assert res.returncode == 0, res.stderr[-3000:]
    one = read_metrics(out)
    two = read_metrics(two_processes.run_dir("sampled-softmax", text_data, tmp_path_factory))
    assert [r["step"] for r in one] == [r["step"] for r in two] and len(one) > 6
    for a, b in zip(one, two, strict=True):
        for key in ("train_loss", "val_loss"):
            assert (key in a) == (key in b) and a.get(key, 0) == pytest.approx(b.get(key, 0), rel=1e-5)


def test_a_sampled_step_counts_the_head_at_p_columns(text_data):
    """The FLOPs count (train/flops.py) on a sampled step: the head's 6·d·V becomes 6·d·P."""
    from speedrun.train.flops import config_model, run_flops, step_flops_at

    cfg = load_recipe(RECIPE, sampled_overrides(text_data))
    unsampled = [re.sub(r" sampled=\S+;", ";", a) for a in sampled_overrides(text_data) if "stride" not in a]
    full = load_recipe(RECIPE, unsampled)
    assert not full.train.stages.count("sampled") and cfg.train.stages.count("sampled") == 2
    model = config_model(cfg)
    rows, d = model.lm_head.weight.shape
    for step, P in ((0, 300), (2, 300), (3, 320), (4, 320), (5, 400)):
        assert stage_values(step, parse_stages(cfg.train.stages, cfg.train.steps)).candidates == P
        assert step_flops_at(model, full, step) - step_flops_at(model, cfg, step) == 6 * d * (rows - P)
    # steps 0-2 at 300, 3-4 at 320 ((s − 3)·2 // 3 = 0), 5 at 400; 1,024 tokens a step
    saved = 6 * d * ((rows - 300) * 3 + (rows - 320) * 2 + (rows - 400)) * 1024
    assert run_flops(model, full, 6) - run_flops(model, cfg, 6) == pytest.approx(saved, rel=1e-12)


def test_the_warm_up_visits_every_step_where_p_changes(text_data):
    """Each P is a compiled graph of its own: the warm-up (train/warmup.py) runs the first step of each,
    so no timed step compiles; here stage 2 starts at 3 with P 320 and P turns 400 at step 5."""
    from speedrun.train.warmup import warmup_steps

    cfg = load_recipe(RECIPE, sampled_overrides(text_data))
    assert warmup_steps(cfg, 0) == [0, 3, 5] and warmup_steps(cfg, 4) == [4, 5]
