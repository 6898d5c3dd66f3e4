"""#92's sampled softcapped cross-entropy (model/gpt2026/sampled.py; P from train/stages.py): the loss
equals a reference written here (dense logits, the candidate columns gathered, softcap, logsumexp over
them), equals the full cross-entropy when P covers the vocabulary, and its gradients equal the
reference's; the candidate set is the record's build (every target, then the sweep's free classes from
the step's start); the fixed-max LSE is the plain logsumexp; validation is the full softmax while the
schedule samples; the P schedule is #92's. All in fp64 on the CPU, so no kernel choice changes a digit
beyond rounding."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from speedrun.config.stages import parse_stages
from speedrun.errors import ConfigError
from speedrun.model.gpt2026 import head, prefix, sampled
from speedrun.model.layers import CastedLinear, softcap
from speedrun.recipes import load_recipe
from speedrun.train.stages import candidate_changes, stage_values

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


# #92's stages with its P switches at 681, 961 and 1101: 10,240 through stages 1 and 2 (ending at 681),
# 14,336, 14,336, 24,576 over the thirds of stage 3 (681-1100), then the taper and extension in full
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
    for s in (1, 681, 700, 961, 1101, 1150):
        assert stage_values(s, plan).sweep_start == sum(stage_values(k, plan).candidates for k in range(s))


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
