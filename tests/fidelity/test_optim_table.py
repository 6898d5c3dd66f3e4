"""Row fields and label switches of the optimizer table (optim/table.py, optim/sharded.py) against
references written here from the records: per-head-pair Q/K orthogonalization (#80, PR #253: HEAD's
qk_bank of (2·head_dim, model_dim) blocks) vs a per-block fp64 SVD polar factor; per-matrix LR
multipliers (HEAD's per_matrix_lr_mul: c_proj ×2); scalars paused at schedule transitions (#52, PR #177:
step_optimizers' transition counter and its scalar DistAdam)."""

from __future__ import annotations

import pytest
import torch

from speedrun.model.families import build_model
from speedrun.optim.build import RunOptimizer, build_optimizer
from speedrun.optim.cautious_adam import AdamLabel
from speedrun.optim.sharded import ShardedNorMuonAdam
from speedrun.optim.table import Row
from speedrun.recipes import load_recipe
from speedrun.train.schedule import StepSchedule, apply_schedule, schedule_at
from tests.fidelity.test_bos_align_recipe import record_window

SMALL = ["model.n_layer=2", "model.n_head=4", "model.n_embd=64", "model.vocab_size=128"]
PLAIN = ["optim.muon_backend=svd", "optim.normuon_beta2=0", "optim.muon_weight_decay=0"]


def polar_fp64(g: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
    return u @ vh


def model_and_optimizer(overrides: list[str]):
    cfg = load_recipe("demo-normuon", [*SMALL, *PLAIN, *overrides])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    return cfg, model, build_optimizer(model, cfg)


@pytest.mark.parametrize("fused", [True, False])
def test_qk_head_pairs_are_orthogonalized_per_pair_and_v_whole(fused):
    """One step with the exact (SVD) backend and no NorMuon normalization: every Q and K head pair
    (2·16 rows) moves by −lr·polar(its own gradient block), V and the projections by the polar
    factor of the whole matrix; the pairs of a layer sit in one bank with the other layer's."""
    cfg, model, opt = model_and_optimizer(
        [f"model.fused_qkv={str(fused).lower()}", "optim.muon_qk_block_heads=2"]
    )
    d, pair = 64, 2 * 16
    params = dict(model.named_parameters())
    start = {n: p.detach().double().clone() for n, p in params.items()}
    gen = torch.Generator().manual_seed(1)
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    table = opt.parts["table"]
    assert {b.shape for b in table.banks} >= {(pair, d), (d, d)}
    lr = cfg.optim.muon_lr

    def moved(name: str, rows: slice) -> torch.Tensor:
        return params[name].detach().double()[rows] - start[name][rows]

    for layer in range(2):
        a = f"blocks.{layer}.attn."
        parts = (
            [(a + "c_attn.weight", slice(0, d), True), (a + "c_attn.weight", slice(d, 2 * d), True),
             (a + "c_attn.weight", slice(2 * d, 3 * d), False)]
            if fused
            else [(a + "c_q.weight", slice(0, d), True), (a + "c_k.weight", slice(0, d), True),
                  (a + "c_v.weight", slice(0, d), False)]
        )  # fmt: skip
        for name, rows, paired in parts:
            g = params[name].grad[rows]
            if paired:
                want = torch.cat([polar_fp64(g[i : i + pair]) for i in range(0, d, pair)])
                assert (want - polar_fp64(g)).abs().max() > 0.1  # per pair is not the whole matrix's
            else:
                want = polar_fp64(g)
            torch.testing.assert_close(moved(name, rows), -lr * want, rtol=1e-5, atol=1e-7)


def test_per_matrix_lr_multiplier_scales_the_update_exactly():
    """Two matrices of one bank, the same weights and gradients, multipliers 1 and 2: HEAD's
    p − p·mask·(wd·lr)·lr_f − V·lr_f with lr_f = lr·shape·mul scales the whole step by mul. From zero
    weights (no decay term) the step is exactly twice; from random ones, twice up to fp32 rounding."""
    for scale in (0.0, 0.1):
        gen = torch.Generator().manual_seed(2)
        w = torch.randn(48, 16, generator=gen) * scale
        p1, p2 = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
        opt = ShardedNorMuonAdam(
            [Row("a", p1, "normuon", "matrix", True), Row("b", p2, "normuon", "matrix", True, lr_mul=2.0)],
            {}, muon_lr=0.02, momentum=0.9, beta2=0.95, muon_weight_decay=1.2, ns_dtype=torch.float32,
        )  # fmt: skip
        assert len(opt.banks) == 1  # one bank: the multiplier is per matrix, not per bank
        g = torch.randn(48, 16, generator=gen)
        p1.grad, p2.grad = g.clone(), g.clone()
        opt.step()  # one step: after it the weights differ, so the next decay terms would too
        d1, d2 = p1.detach() - w, p2.detach() - w
        if scale == 0.0:
            assert torch.equal(d2, 2 * d1)
        else:
            torch.testing.assert_close(d2, 2 * d1, rtol=1e-4, atol=1e-7)
            assert not torch.allclose(d2, d1, rtol=0.1)
    cfg, model, opt = model_and_optimizer(["optim.mlp_proj_lr_mul=2.0"])
    rows = {r.name: r for r in opt.parts["table"].rows}  # the table the builder made from the labels
    assert {n for n, r in rows.items() if r.lr_mul == 2.0} == {
        f"blocks.{i}.mlp.c_proj.weight" for i in range(2)
    }


@pytest.mark.parametrize("span", [40, 200])
def test_pause_steps_are_the_records_transition_counter(span):
    """#52's step loop: a step whose window differs from the last is a transition; it sets a counter
    to `transition_steps`, and a step runs paused while the counter is positive (then decrements it).
    On bos-align-2025-07's window schedule (#26's formula); span 200 overlaps transitions."""
    cfg = load_recipe("bos-align-2025-07", [f"optim.scalar_freeze_steps={span}"])
    n = cfg.train.steps
    ws, counter, paused = record_window(0, n), 0, []
    for step in range(n):
        new = record_window(step, n)
        if new != ws:
            ws, counter = new, span
        paused.append(counter > 0)
        counter -= counter > 0
    assert sum(paused) >= span * 5
    assert [schedule_at(step, cfg).frozen for step in range(n)] == paused
    off = load_recipe("bos-align-2025-07")
    assert not any(schedule_at(step, off).frozen for step in range(n))


def record_adam_fp64(p, grad, m, v, t, lr, betas, eps):
    """#52's DistAdam step (weight decay 0) in fp64; returns new (p, m, v)."""
    b1, b2 = betas
    m = b1 * m + (1 - b1) * grad
    v = b2 * v + (1 - b2) * grad * grad
    return p - m / (v.sqrt() + eps) * (lr * (1 - b2**t) ** 0.5 / (1 - b1**t)), m, v


def test_paused_scalars_drop_their_gradients_and_keep_their_adam_state():
    """Adam every other step, the scalar label paused on steps 2–4 (through apply_schedule), over 9
    steps, against #52's loop: gradients accumulate from the even step into the odd one; an odd step
    not paused steps the scalar DistAdam and zeroes the grads, a paused one zeroes them only; a paused
    step also zeroes the scalars' grads on an even step. The head is never paused."""
    gen = torch.Generator().manual_seed(3)
    scalar = torch.nn.Parameter(torch.randn(6, generator=gen))
    head = torch.nn.Parameter(torch.randn(8, 4, generator=gen))
    start = {"s": scalar.detach().double().clone(), "h": head.detach().double().clone()}
    hp = {"scalar": AdamLabel(0.04, (0.9, 0.99), 0.0, 1e-8), "head": AdamLabel(0.02, (0.5, 0.95), 0.0, 1e-8)}
    rows = [Row("s", scalar, "adam", "scalar", False), Row("h", head, "adam", "head", False)]
    opt = RunOptimizer({"table": ShardedNorMuonAdam(rows, hp, 0.02, 0.9, 0.95, 0.0, adam_every=2,
                                                    frozen_labels=("scalar",))})  # fmt: skip
    table = opt.parts["table"]
    paused = {2, 3, 4}
    ref = {k: [start[k], torch.zeros_like(start[k]), torch.zeros_like(start[k]), 0] for k in start}
    acc = {k: torch.zeros_like(start[k]) for k in start}
    for step in range(9):
        apply_schedule(StepSchedule(lr=1.0, muon_momentum=0.9, window=0, frozen=step in paused), opt, None)
        g = {"s": torch.randn(6, generator=gen), "h": torch.randn(8, 4, generator=gen)}
        scalar.grad, head.grad = g["s"].clone(), g["h"].clone()
        before = {k: v.clone() for k, v in table.state["s"].items()}
        opt.step()
        opt.zero_grad()
        for k, label in (("s", "scalar"), ("h", "head")):  # the record's loop
            acc[k] = acc[k] + g[k].double()
            in_transition = step in paused and k == "s"
            if step % 2 == 1:
                if not in_transition:
                    p, m, v, t = ref[k]
                    ref[k][:3] = record_adam_fp64(p, acc[k], m, v, t + 1, hp[label].lr, hp[label].betas, 1e-8)
                    ref[k][3] = t + 1
                acc[k] = torch.zeros_like(acc[k])
            if in_transition:
                acc[k] = torch.zeros_like(acc[k])
        if step in paused:  # moments untouched while paused
            assert all(torch.equal(before[key], table.state["s"][key]) for key in before)
    assert table.adam_steps == {"scalar": 3, "head": 4}
    assert ref["s"][3] == 3 and ref["h"][3] == 4
    torch.testing.assert_close(scalar.detach().double(), ref["s"][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(head.detach().double(), ref["h"][0], rtol=1e-5, atol=1e-6)


def test_state_dict_with_a_param_in_two_banks_round_trips_and_reads_format_1():
    """A fused QKV with per-head-pair Q/K has blocks in two banks: the saved state (a list per param,
    one tensor per block) restores a fresh optimizer that then continues bit for bit; a state of the
    first format (one stacked tensor per param, one Adam step count) loads too."""
    over = ["model.fused_qkv=true", "optim.muon_qk_block_heads=2", "optim.adam_every=1", "optim.tie_until=0"]

    def make():
        return model_and_optimizer(over)[1:]

    gen = torch.Generator().manual_seed(4)
    shapes = [p.shape for p in make()[0].parameters()]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]

    def run(model, opt, steps):
        for gs in steps:
            for p, g in zip(model.parameters(), gs, strict=True):
                p.grad = g.clone()
            opt.step()
            opt.zero_grad()

    a, opt_a = make()
    run(a, opt_a, grads)
    for old_format in (False, True):
        b, opt_b = make()
        run(b, opt_b, grads[:2])
        state = opt_b.state_dict()
        saved = state["table"]
        assert isinstance(saved["params"]["blocks.0.attn.c_attn.weight"]["momentum"], list)
        if old_format:
            saved["format"] = "sharded-normuon-adam-1"
            saved["adam_steps"] = 2
            for name, entry in saved["params"].items():  # -1: one stacked tensor per single-bank param
                if name.endswith(("c_fc.weight", "c_proj.weight")):
                    entry.update({k: torch.stack(v) for k, v in entry.items()})
        c, opt_c = make()
        c.load_state_dict(b.state_dict())
        opt_c.load_state_dict(state)
        run(c, opt_c, grads[2:])
        for (name, pa), pc in zip(a.named_parameters(), c.parameters(), strict=True):
            assert torch.equal(pa, pc), (name, old_format)


def test_the_new_switches_are_checked_at_the_edge():
    from speedrun.errors import ConfigError

    for bad, match in [
        (["optim.muon_qk_block_heads=2"], r"while optim.name=muon \(it needs optim.name=normuon\|anvil\)"),
        (["optim.mlp_proj_lr_mul=2.0"], "optim.mlp_proj_lr_mul=2.0 has no effect while optim.name=muon"),
        (["optim.name=normuon", "optim.muon_qk_block_heads=3"], "must divide model.n_head"),
        (["optim.name=normuon", "optim.scalar_freeze_steps=-1"], "must be >= 0"),
        (["optim.name=normuon", "optim.mlp_proj_lr_mul=0"], "> 0"),
    ]:
        with pytest.raises(ConfigError, match=match):
            load_recipe("demo", bad)


def test_multi_tensor_adam_is_the_per_tensor_step_bit_for_bit():
    from speedrun.optim.cautious_adam import adam_foreach_, cautious_adam_

    gen = torch.Generator().manual_seed(5)
    shapes = [(3,), (4, 5), ()]
    hp = AdamLabel(0.04, (0.9, 0.99), 0.0, 1e-8)
    one = [torch.randn(s, generator=gen) for s in shapes]
    many = [t.clone() for t in one]
    state = [[torch.zeros(s) for s in shapes] for _ in range(4)]
    for t in (1, 2, 3):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        for w, g, m, v in zip(one, grads, state[0], state[1], strict=True):
            cautious_adam_(w, g, m, v, t, 0.04, hp)
        adam_foreach_(many, grads, state[2], state[3], t, 0.04, hp)
    assert all(torch.equal(a, b) for a, b in zip(one, many, strict=True))


def test_stage_plan_transitions_are_where_batch_or_windows_change():
    """#52's definition (a step whose window or batch size differs from the step before) on today's
    stage plan: the stage starts, extension included; pauses then cover 40 steps from each."""
    from speedrun.train.schedule import frozen_at, stage_transition
    from speedrun.train.stages import stage_values
    from tests.record_stages import STAGES_2026_07

    plan = STAGES_2026_07

    def changed(step: int) -> bool:
        a, b = stage_values(step - 1, plan), stage_values(step, plan)
        return (a.batch_tokens, a.long_window) != (b.batch_tokens, b.long_window)

    steps = range(1, plan.total_steps)
    assert [stage_transition(s, plan) for s in steps] == [changed(s) for s in steps]
    paused = [s for s in range(plan.total_steps) if frozen_at(s, 40, lambda t: stage_transition(t, plan))]
    starts = [s for s in steps if changed(s)]
    n = plan.total_steps
    assert len(starts) == 3 and paused == sorted({t + k for t in starts for k in range(40) if t + k < n})
