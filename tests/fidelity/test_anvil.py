"""ANVIL (#92, optim/anvil.py) against the record's formulas written out here in plain fp64 torch: the six
maps, the lane equaliser, single steps before and after the rail engage step, the value embeddings'
period-4 cadence, the bf16 mantissa commit, and 2 gloo processes against 1 (tests/library_checks.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from speedrun.optim.anvil import ANVIL_MAPS, Rails, ShardedAnvilAdam, whiten
from speedrun.optim.cautious_adam import AdamLabel
from speedrun.optim.normuon import join_fp32, normuon_normalize_
from speedrun.optim.table import Row
from tests import two_processes

# The record's constants, copied from its trainer (records/track_1_short/2026-08-30_ANVIL2, ANVIL_MAPS and
# _RAIL_FAST_BETA, _RAIL_SLOW_BETA, _RAIL_FAST_W, _RAIL_ENGAGE_STEP; the cascade's 1.05 and 1e-6)
RECORD_MAPS = [
    (3.923798038567, -6.095026865488, 3.905234618423),
    (3.278126713798, -3.328923386476, 0.989127286973),
    (3.505298394150, -5.137358782410, 1.968325560615),
    (2.815058591845, -3.685181239622, 1.417196497642),
    (2.245503932403, -2.443826979899, 0.963091710461),
    (2.256537145403, -2.166840097229, 0.929501253245),
]
FAST, SLOW, WEIGHT, ENGAGE = 0.85, 0.98, 0.4385, 514


def record_cascade(g: torch.Tensor) -> torch.Tensor:
    """anvil_cascade's whitening of one matrix, in g's dtype."""
    tall = g.shape[0] > g.shape[1]
    gram = (lambda x: x.T @ x) if tall else (lambda x: x @ x.T)
    a_mat = gram(g)
    d = torch.trace(a_mat).sqrt() * 1.05 + 1e-6
    x, a_mat = g / d, a_mat / d**2
    for k, (a, b, c) in enumerate(RECORD_MAPS):
        if k > 0:
            a_mat = gram(x)
        b_mat = b * a_mat + c * (a_mat @ a_mat)
        x = a * x + (x @ b_mat if tall else b_mat @ x)
    return x


def record_equalizer(v: torch.Tensor, lane: torch.Tensor, beta2: float) -> tuple[torch.Tensor, torch.Tensor]:
    """_rail_equalizer: per-lane EMA of the mean square along the longer side, norm restored."""
    red = -1 if v.shape[0] >= v.shape[1] else -2
    power = (v * v).mean(dim=red, keepdim=True)
    n = v.shape[red]
    pre = (power.sum() * n).sqrt()
    lane = lane + (power - lane) * (1 - beta2)
    gain = lane.clamp_min(1e-10).rsqrt()
    post = (power * n * gain**2).sum().sqrt()
    return v * gain * (pre / post.clamp_min(1e-10)), lane


def record_anvil_step(w, g, st, step, mu, lr, wd, lr_mul, beta2, engage=ENGAGE):
    """One anvil_bank_update of one fp64 matrix; ``st`` = {"fast", "slow", "lane"} is updated."""
    fast_beta, weight = (FAST, WEIGHT) if step >= engage else (mu, 1.0)
    st["fast"] = st["fast"] + (g - st["fast"]) * (1 - fast_beta)
    st["slow"] = st["slow"] + (g - st["slow"]) * (1 - SLOW)
    blend = weight * st["fast"] + (1 - weight) * st["slow"]
    d = g + (blend - g) * mu
    v, st["lane"] = record_equalizer(record_cascade(d), st["lane"], beta2)
    rows, cols = w.shape
    eff_lr = lr_mul * max(1.0, rows / cols) ** 0.5 * lr
    aligned = (st["slow"] * w) >= 0
    return w - w * aligned * (wd * lr) * eff_lr - v * eff_lr


def lanes(shape):
    rows, cols = shape
    return torch.zeros((rows, 1) if rows >= cols else (1, cols), dtype=torch.float64)


def test_the_six_maps_are_the_records_and_whiten_like_it_in_fp64():
    assert [tuple(m) for m in RECORD_MAPS] == list(ANVIL_MAPS)
    # the README's figures for these maps: tail gain 643.13 (the slope at 0) and envelope [0.9951, 1.00041]
    s = torch.linspace(3e-3, 1 / 1.05, 20001, dtype=torch.float64)
    for a, b, c in ANVIL_MAPS:
        s = a * s + b * s**3 + c * s**5
    gain = torch.tensor([a for a, _, _ in ANVIL_MAPS], dtype=torch.float64).prod()
    assert gain.item() == pytest.approx(643.13, abs=0.01)
    assert s.min().item() == pytest.approx(0.9951, abs=1e-4)
    assert s.max().item() == pytest.approx(1.00041, abs=1e-5)
    gen = torch.Generator().manual_seed(0)
    for shape in [(48, 16), (16, 48), (24, 24), (1100, 8)]:  # tall, wide, square, split (> 1024 rows)
        g = torch.randn(3, *shape, generator=gen, dtype=torch.float64)
        got = whiten(g, torch.float64)
        for i in range(3):
            torch.testing.assert_close(got[i], record_cascade(g[i]), rtol=1e-10, atol=1e-12)
        got2d = whiten(g[0], torch.float64)  # one unstacked matrix
        torch.testing.assert_close(got2d, got[0], rtol=1e-12, atol=1e-13)


def test_lane_equalisation_keeps_the_frobenius_norm_and_matches_the_record():
    gen = torch.Generator().manual_seed(1)
    for shape in [(40, 12), (12, 40), (16, 16)]:
        v = torch.randn(2, *shape, generator=gen)
        energy = torch.rand(2, *lanes(shape).shape, generator=gen) * 3  # a warm state: gains differ by lane
        out = normuon_normalize_(v.clone(), energy.clone(), 0.9, "rows")
        for i in range(2):
            want, _ = record_equalizer(v[i].double(), energy[i].double(), 0.9)
            torch.testing.assert_close(out[i].double(), want, rtol=1e-5, atol=1e-6)
            assert out[i].norm().item() == pytest.approx(v[i].norm().item(), rel=1e-6)
            assert not torch.allclose(out[i] / out[i].norm(), v[i] / v[i].norm(), rtol=1e-2)  # it acts


def _anvil(params: dict[str, torch.nn.Parameter], muls=None, engage=ENGAGE, adam=None, **kw):
    muls = muls or {}
    rows = [
        Row(n, p, "normuon", "matrix", True, lr_mul=muls.get(n, 1.0))
        if n.startswith("m")
        else Row(n, p, "adam", n, True)
        for n, p in params.items()
    ]
    return ShardedAnvilAdam(
        rows, adam or {}, muon_lr=0.023, momentum=0.85, beta2=0.9, muon_weight_decay=2.25,
        rails=Rails(engage_step=engage), ns_dtype=torch.float32, **kw,
    )  # fmt: skip


def test_single_steps_before_and_after_the_engage_step_follow_the_record():
    """Two tall matrices (one with #92's 2x c_proj multiplier) in one bank and a wide one in another, four
    steps with the engage step at 2: steps 0-1 read the fast rail alone on the scheduled beta, steps 2-3
    blend 0.4385 fast + 0.5615 slow; μ and the LR change every step as the schedule writes them."""
    gen = torch.Generator().manual_seed(2)
    shapes = {"m_tall": (48, 16), "m_proj": (48, 16), "m_wide": (16, 48)}
    params = {n: torch.nn.Parameter(torch.randn(*s, generator=gen) * 0.1) for n, s in shapes.items()}
    opt = _anvil(params, muls={"m_proj": 2.0}, engage=2)
    ref = {n: p.detach().double().clone() for n, p in params.items()}
    st = {n: {"fast": 0 * ref[n], "slow": 0 * ref[n], "lane": lanes(s)} for n, s in shapes.items()}
    group = opt.param_groups[0]
    for step, (mu, lr_mul) in enumerate([(0.85, 1.0), (0.87, 0.9), (0.89, 0.8), (0.91, 0.7)]):
        group["momentum"], group["lr"] = mu, 0.023 * lr_mul
        before = {n: p.detach().double().clone() for n, p in params.items()}
        for n, p in params.items():
            g = torch.randn(*shapes[n], generator=gen)
            p.grad = g.clone()
            mul = 2.0 if n == "m_proj" else 1.0
            ref[n] = record_anvil_step(before[n], g.double(), st[n], step, mu, group["lr"], 2.25, mul, 0.9, 2)
        assert opt.engaged() == (step >= 2)
        opt.step()
        opt.zero_grad()
        for n, p in params.items():
            got, want = p.detach().double() - before[n], ref[n] - before[n]
            # fp32 against fp64: measured 0.7e-6 to 1.6e-6 (2026-12-02); the decay gated on the update instead
            # of the slow rail, or no engage step, fails it
            assert (got - want).norm() / want.norm() < 2e-5, (step, n)
            ref[n] = p.detach().double().clone()  # the next step starts from the same weights


def record_adam(p, g, m, v, t, betas, lr, wd, eps=1e-10):
    b1, b2 = betas
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    u = m / (v.sqrt() + eps) * (lr * (1 - b2**t) ** 0.5 / (1 - b1**t))
    u = u + p * ((u * p) > 0) * (lr * lr * wd)
    return p - u, m, v


def test_value_embeddings_step_every_fourth_step_from_the_cadence_step_with_squared_betas():
    """adam_every=2 and the cadence from step 4: value_embed updates at steps 1, 3 (betas (0.75, 0.95),
    wd 5·w), then 7 and 11 on the summed gradients of 4-7 and 8-11 (betas squared, wd doubled, Adam's
    step count 3 and 4); the token embedding keeps every odd step on its own betas."""
    gen = torch.Generator().manual_seed(3)
    params = {n: torch.nn.Parameter(torch.randn(16, 8, generator=gen)) for n in ("embed", "value_embed")}
    hp = {
        "embed": AdamLabel(0.008, (0.5, 0.95), 0.005 * 150, 1e-10),
        "value_embed": AdamLabel(0.56, (0.75, 0.95), 0.005 * 5, 1e-10),
    }
    opt = _anvil(params, adam=hp, adam_every=2, every4_from=4)
    ref = {n: [p.detach().double().clone(), 0.0, 0.0, 0, 0.0] for n, p in params.items()}  # p, m, v, t, sum
    for step in range(12):
        for n, p in params.items():
            g = torch.randn(16, 8, generator=gen)
            p.grad = g.clone()
            r = ref[n]
            r[4] = r[4] + g.double()
            late = n == "value_embed" and step >= 4
            if (step % 4 == 3) if late else (step % 2 == 1):
                betas, wd = hp[n].betas, hp[n].weight_decay
                if late:
                    betas, wd = (betas[0] ** 2, betas[1] ** 2), 2 * wd
                r[3] += 1
                r[0], r[1], r[2] = record_adam(r[0], r[4], r[1], r[2], r[3], betas, hp[n].lr, wd)
                r[4] = 0.0
        opt.step()
        opt.zero_grad()
        for n, p in params.items():
            want = ref[n][0]
            torch.testing.assert_close(p.detach().double(), want, rtol=1e-5, atol=1e-6, msg=f"{step} {n}")
    assert opt.adam_steps == {"embed": 6, "value_embed": 4}


def test_bf16_banks_commit_exactly_the_fp32_master_through_the_mantissa():
    """A bf16 bank whose fp32 value is (bf16 bits, uint16 mantissa) follows an fp32 bank fed the same
    gradients bit for bit over several steps, the engage step among them; the bf16 weight is the fp32
    master's top half (truncated)."""
    gen = torch.Generator().manual_seed(4)
    start = (torch.randn(2, 32, 16, generator=gen) * 0.1).bfloat16()
    p16, p32 = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.float())
    o16, o32 = _anvil({"m": p16}, engage=3), _anvil({"m": p32}, engage=3)
    for _ in range(6):
        g = torch.randn(2, 32, 16, generator=gen).bfloat16()
        p16.grad, p32.grad = g.clone(), g.float()
        o16.step()
        o32.step()
        (mantissa,) = (st["mantissa"] for st in o16.state.values() if "mantissa" in st)
        master = join_fp32(p16.detach().view(torch.uint16).view(2, 32, 16), mantissa.view(2, 32, 16))
        assert torch.equal(master.view(torch.int32), p32.detach().view(torch.int32))
        top = (p32.detach().view(torch.int32) >> 16).to(torch.int16)
        assert torch.equal(p16.detach().view(torch.int16), top)


# ---- 2 gloo processes against 1 (run by tests/library_checks.py on the suite's one launch) ----


def two_ranks(rank: int, world: int) -> dict[str, float]:
    """Three matrices in one bank (padded to 4 on 2 ranks), a wide one, a sharded embedding and value
    embeddings on the period-4 cadence, 8 steps across the engage step (3) and the cadence (4), on this
    launch's ranks and on one process with the mean gradient: the largest relative weight difference."""

    def make(one: bool) -> tuple[dict[str, torch.nn.Parameter], ShardedAnvilAdam]:
        gen = torch.Generator().manual_seed(5)
        shapes = {"m0": (24, 8), "m1": (24, 8), "m2": (24, 8), "m3": (8, 24)}
        shapes |= {"embed": (16, 8), "value_embed": (16, 8)}
        params = {n: torch.nn.Parameter(torch.randn(*s, generator=gen) * 0.2) for n, s in shapes.items()}
        hp = AdamLabel(0.05, (0.75, 0.95), 0.025, 1e-10)
        comms = None
        if one:
            from speedrun.optim.sharded import Collectives

            comms = Collectives()
            comms.world, comms.rank = 1, 0
        opt = _anvil(params, muls={"m1": 2.0}, engage=3, adam={"embed": hp, "value_embed": hp},
                     adam_every=2, every4_from=4, comms=comms)  # fmt: skip
        return params, opt

    sharded, opt = make(False)
    single, ref = make(True)
    start = {n: p.detach().clone() for n, p in single.items()}
    for step in range(8):
        grads = []
        for r in range(world):
            gen = torch.Generator().manual_seed(1000 * step + r)
            grads.append({n: torch.randn(p.shape, generator=gen) for n, p in sharded.items()})
        for n in sharded:
            sharded[n].grad = grads[rank][n].clone()
            single[n].grad = sum(g[n] for g in grads) / world
        for o in (opt, ref):
            o.param_groups[0]["momentum"] = 0.85 + 0.01 * step
            o.step()
            o.zero_grad()
    worst = max(((sharded[n] - single[n]).norm() / single[n].norm()).item() for n in sharded)
    moved = min((single[n] - start[n]).norm().item() for n in single)
    return {"max_rel_diff": worst, "least_moved": moved, "world": world}


@two_processes.SHARED
def test_two_gloo_processes_step_like_one(library_results):
    got = library_results["anvil"]
    assert got["world"] == 2 and got["least_moved"] > 0
    assert got["max_rel_diff"] < 1e-6  # the same fp32 arithmetic per matrix; only matmul batching differs


def test_one_process_check_runs_without_a_process_group():
    assert not dist.is_initialized()
    got = two_ranks(0, 1)
    assert got["max_rel_diff"] == 0.0 and got["least_moved"] > 0


def test_state_dict_round_trip_continues_exactly_and_refuses_normuon_state():
    """A fresh ANVIL loaded from a state dict taken after the engage step and mid-cycle (kept value-embed
    gradients) continues bit for bit; a NorMuon state is refused in one line."""
    gen = torch.Generator().manual_seed(6)
    shapes = {"m0": (24, 8), "m1": (8, 24), "value_embed": (16, 8)}
    grads = [{n: torch.randn(s, generator=gen) for n, s in shapes.items()} for _ in range(8)]
    hp = {"value_embed": AdamLabel(0.05, (0.75, 0.95), 0.025, 1e-10)}

    def make():
        torch.manual_seed(0)
        params = {n: torch.nn.Parameter(torch.randn(s)) for n, s in shapes.items()}
        return params, _anvil(params, engage=2, adam=hp, adam_every=2, every4_from=4)

    def run(params, opt, steps):
        for g in steps:
            for n, p in params.items():
                p.grad = g[n].clone()
            opt.step()
            opt.zero_grad()

    a, opt_a = make()
    run(a, opt_a, grads)
    b, opt_b = make()
    run(b, opt_b, grads[:5])
    state = opt_b.state_dict()
    assert state["kept"] and state["format"] == "sharded-anvil-adam-1"
    c, opt_c = make()
    with torch.no_grad():
        for n in c:
            c[n].copy_(b[n])
    opt_c.load_state_dict(state)
    run(c, opt_c, grads[5:])
    for n in a:
        assert torch.equal(a[n], c[n]), n
    with pytest.raises(ValueError, match="not sharded-anvil-adam-1"):
        opt_c.load_state_dict({**state, "format": "sharded-normuon-adam-2"})


def test_the_config_selects_and_checks_it():
    from speedrun.errors import ConfigError
    from speedrun.recipes import load_recipe

    cfg = load_recipe("demo-2026", ["optim.name=anvil", "optim.value_embed_every4_from=336"])
    assert (cfg.optim.anvil_slow_beta, cfg.optim.anvil_fast_beta) == (SLOW, FAST)
    assert (cfg.optim.anvil_fast_weight, cfg.optim.anvil_engage_step) == (WEIGHT, ENGAGE)
    with pytest.raises(ConfigError, match="needs optim.name=anvil"):
        load_recipe("demo-2026", ["optim.anvil_engage_step=10"])  # a NorMuon recipe reads no ANVIL key
    with pytest.raises(ConfigError, match="multiple of 4"):
        load_recipe("demo-2026", ["optim.name=anvil", "optim.value_embed_every4_from=6"])
    with pytest.raises(ConfigError, match="muon_ns_steps has no effect under optim.name=anvil"):
        load_recipe("demo-2026", ["optim.name=anvil", "optim.muon_ns_steps=4"])
    with pytest.raises(ConfigError, match="anvil_fast_weight"):
        load_recipe("demo-2026", ["optim.name=anvil", "optim.anvil_fast_weight=1.5"])


@pytest.mark.slow  # ~12 s on a busy 2-core host
def test_demo_2026_trains_a_few_steps_with_it_shrunk(text_data, tmp_path):
    """The whole loop on the 2026 composition with ANVIL (engage step 3, value embeddings every 4th step
    from step 4): finite falling validation losses, and the log names the optimizer."""
    import json
    import math

    from speedrun.recipes import load_recipe
    from speedrun.train import loop

    eot = json.loads((text_data / "meta.json").read_text())["eot_id"]
    over = [f"data.dir={text_data}", "data.tokenizer=bpe:512", "model.vocab_size=512", f"model.eot_id={eot}",
            "model.n_embd=64", "model.n_head=2", "model.bigram_rows=2048", "model.bigram_sign_rows=64",
            "model.max_seq_len=1024", "model.window=256", "train.seq_len=1024",
            "train.micro_batch_tokens=1024", "train.global_batch_tokens=1024", "train.steps=8",
            "train.warmdown_steps=2", "train.val_every=4", "train.val_tokens=2048", "train.time_budget_s=0",
            "train.budget_min_steps=0", "train.timing_warmup_steps=0", "train.dtype=fp32",
            "optim.name=anvil", "optim.anvil_engage_step=3", "optim.value_embed_every4_from=4",
            "optim.muon_weight_decay=2.25", "optim.normuon_beta2=0.9"]  # fmt: skip
    loop.train(load_recipe("demo-2026", over), tmp_path / "run")
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) == 3 and all(math.isfinite(v) for v in val) and val[-1] < val[0], val
    assert "optimizer: ANVIL on" in (tmp_path / "run" / "log.txt").read_text()


def test_the_memory_estimate_counts_the_optimizers_own_state():
    """The plan's optimizer-state figure (train/plan/memory.py) equals what the built optimizer holds,
    NorMuon's and ANVIL's (two rails where NorMuon has one momentum)."""
    from speedrun.model.families import build_model
    from speedrun.optim.build import build_table_optimizer
    from speedrun.recipes import load_recipe
    from speedrun.train.plan.memory import _optimizer_bytes

    small = ["model.n_embd=64", "model.n_head=2", "model.bigram_rows=2048", "model.bigram_sign_rows=64"]
    held = {}
    for name in ("normuon", "anvil"):
        cfg = load_recipe("demo-2026", [*small, f"optim.name={name}"])
        torch.manual_seed(0)
        model = build_model(cfg.model)
        held[name] = build_table_optimizer(model, cfg).state_bytes()
        assert _optimizer_bytes(cfg, model, 1)[0] == held[name], name
    assert held["anvil"] > held["normuon"]
