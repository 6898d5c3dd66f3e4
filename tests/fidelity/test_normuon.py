"""The 2025–26 optimizer pieces against fp64 references written here from modded-nanogpt HEAD's code
(train_gpt.py @ f411b3d3: polar_express, _apply_normuon_variance_reduction,
_cautious_wd_and_update_inplace, _adam_update_step, get_muon_momentum, NorMuonAndAdam.step)."""

from __future__ import annotations

import pytest
import torch

from speedrun.optim.cautious_adam import AdamLabel, cautious_adam_
from speedrun.optim.normuon import (
    cautious_step,
    join_fp32,
    momentum_at,
    normuon_normalize_,
    second_moment_shape,
    split_fp32,
)
from speedrun.optim.orthogonalize import (
    POLAR_EXPRESS_COEFFICIENTS,
    _odd_quintic_iterations,
    newton_schulz,
    polar_express,
)
from speedrun.optim.sharded import ShardedNorMuonAdam
from speedrun.optim.table import Row

# HEAD's table, copied from the record (not imported from our module)
RECORD_COEFFS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


def record_polar_express_fp64(g: torch.Tensor) -> torch.Tensor:
    """HEAD's iteration in fp64: tall matrices multiply on the right (A = XᵀX), wide on the left."""
    x = g.double()
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * (1 + 2e-2) + 1e-6)
    tall = x.size(-2) > x.size(-1)
    for a, b, c in RECORD_COEFFS:
        if tall:
            A = x.mT @ x
            x = a * x + x @ (b * A + c * A @ A)
        else:
            A = x @ x.mT
            x = a * x + (b * A + c * A @ A) @ x
    return x


@pytest.mark.parametrize("shape", [(3, 64, 64), (2, 96, 32), (2, 32, 96)])
def test_polar_express_is_the_records_iteration(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    want = record_polar_express_fp64(g)
    # the same steps in fp64 (our wide-only form: tall matrices transposed) agree to rounding
    x = g.double().mT if shape[-2] > shape[-1] else g.double()
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) * 1.02 + 1e-6)
    exact = _odd_quintic_iterations(x, POLAR_EXPRESS_COEFFICIENTS)
    exact = exact.mT if shape[-2] > shape[-1] else exact
    torch.testing.assert_close(exact, want, rtol=1e-10, atol=1e-12)
    # the bf16 backend: within bf16 rounding of it (measured <= 2.6%), and much farther from the
    # classic Newton-Schulz quintic, which a mixed-up backend would return
    err = lambda y: ((y.double() - want).norm(dim=(-2, -1)) / want.norm(dim=(-2, -1))).max()  # noqa: E731
    assert err(polar_express(g)) < 4e-2
    assert err(newton_schulz(g)) > 3 * err(polar_express(g))


def record_normuon_fp64(
    v: torch.Tensor, buf: torch.Tensor, beta2: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """NorMuon as the paper states it: divide by sqrt(EMA of the mean square along the reduced dim),
    then restore the Frobenius norm. Reduced dim: -1 if rows >= cols else -2."""
    v, buf = v.double(), buf.double()
    dim = -1 if v.size(-2) >= v.size(-1) else -2
    buf = beta2 * buf + (1 - beta2) * (v * v).mean(dim=dim, keepdim=True)
    u = v / buf.clamp_min(1e-10).sqrt()
    u = u * (v.norm(dim=(-2, -1), keepdim=True) / u.norm(dim=(-2, -1), keepdim=True))
    return u, buf


@pytest.mark.parametrize(
    "shape,stat", [((2, 48, 16), (2, 48, 1)), ((2, 16, 48), (2, 1, 48)), ((1, 8, 8), (1, 8, 1))]
)
def test_normuon_normalization_and_its_axis(shape, stat):
    assert second_moment_shape(shape) == stat
    gen = torch.Generator().manual_seed(1)
    buf = torch.zeros(stat)
    ref_buf = buf.double()
    for _ in range(3):  # the EMA carries over steps
        v = torch.randn(shape, generator=gen) * torch.rand(shape[-1], generator=gen)  # uneven columns
        want, ref_buf = record_normuon_fp64(v, ref_buf, 0.9)
        got = normuon_normalize_(v.clone(), buf, 0.9)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(buf.double(), ref_buf, rtol=1e-6, atol=0)
    # it changes the direction (not a plain rescale) but keeps each matrix's norm
    assert not torch.allclose(got / got.norm(), v / v.norm(), atol=1e-3)


def test_cautious_decay_only_where_update_and_weight_agree():
    gen = torch.Generator().manual_seed(2)
    w, u = torch.randn(64, 32, generator=gen), torch.randn(64, 32, generator=gen)
    u[0, :4] = 0.0  # zero update: mask >= 0 decays (HEAD's NorMuon mask)
    lr, decay = 0.03, 1.2 * 0.02
    w64, u64 = w.double(), u.double()
    agree = (u64 * w64) >= 0
    want = torch.where(agree, w64 * (1 - decay * lr), w64) - lr * u64
    torch.testing.assert_close(cautious_step(w, u, lr, decay).double(), want, rtol=1e-6, atol=1e-7)


def test_mantissa_buffer_reconstructs_fp32_bit_for_bit():
    x = torch.cat(
        [torch.randn(10_000) * 10.0 ** torch.randint(-30, 30, (10_000,)), torch.tensor([0.0, -0.0, 1e-40])]
    )
    x = torch.cat([x, torch.tensor([float("inf"), float("-inf")])])
    high, low = split_fp32(x)
    assert torch.equal(join_fp32(high, low).view(torch.int32), x.view(torch.int32))
    # the bf16 half is the top 16 bits (truncation, as HEAD stores it), the buffer the rest
    bits = x.view(torch.int32).long() & 0xFFFFFFFF
    assert torch.equal(high.long() & 0xFFFF, bits >> 16)
    assert torch.equal(low.long() & 0xFFFF, bits & 0xFFFF)
    # a bf16 weight with an empty buffer is its own fp32 value
    b = torch.randn(100).bfloat16()
    assert torch.equal(join_fp32(b.view(torch.uint16), torch.zeros(100, dtype=torch.uint16)), b.float())


def record_momentum(step, total, warmup, cooldown, lo, hi):
    """HEAD's get_muon_momentum with training_schedule.total_steps = total."""
    momentum_cd_start = total - cooldown
    if step < warmup:
        return lo + (step / warmup) * (hi - lo)
    if step > momentum_cd_start:
        return hi - ((step - momentum_cd_start) / cooldown) * (hi - lo)
    return hi


def test_momentum_warms_up_and_cools_down_like_the_record():
    for step in range(0, 1286):
        assert momentum_at(step, 1285, 300, 50, 0.85, 0.95) == record_momentum(
            step, 1285, 300, 50, 0.85, 0.95
        )
    assert momentum_at(1285, 1285, 300, 50, 0.85, 0.95) == pytest.approx(0.85)


def record_adam_fp64(p, grads, betas, eps, lr, wd):
    """HEAD's _adam_update(_step) in fp64 over a list of gradients (one per step)."""
    p, m, v = p.double(), torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64)
    b1, b2 = betas
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        update = m / (v.sqrt() + eps) * (lr * (1 - b2**t) ** 0.5 / (1 - b1**t))
        update = update + p * ((update * p) > 0) * (lr * lr * wd)
        p = p - update
    return p


def test_cautious_adam_matches_the_record():
    gen = torch.Generator().manual_seed(3)
    p = torch.randn(40, 8, generator=gen)
    grads = [torch.randn(40, 8, generator=gen) for _ in range(4)]
    hp = AdamLabel(lr=0.05, betas=(0.5, 0.95), weight_decay=0.005 * 150, eps=1e-10)
    want = record_adam_fp64(p, grads, hp.betas, hp.eps, hp.lr, hp.weight_decay)
    w, m, v = p.clone(), torch.zeros_like(p), torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        cautious_adam_(w, g, m, v, t, hp.lr, hp)
    torch.testing.assert_close(w.double(), want, rtol=1e-5, atol=1e-6)


def _optimizer(params: dict[str, torch.nn.Parameter], adam_every=1, tie=None, lr=0.05):
    rows = [
        Row(
            name,
            p,
            "normuon" if name.startswith("m") else "adam",
            "matrix" if name.startswith("m") else name,
            True,
        )
        for name, p in params.items()
    ]
    hp = AdamLabel(lr=lr, betas=(0.5, 0.95), weight_decay=0.0, eps=1e-10)
    return ShardedNorMuonAdam(
        rows,
        {"embed": hp, "head": hp},
        muon_lr=0.02,
        momentum=0.9,
        beta2=0.95,
        muon_weight_decay=0.0,
        adam_every=adam_every,
        tie=tie,
    )


def test_adam_every_other_step_steps_once_on_the_summed_gradients():
    gen = torch.Generator().manual_seed(4)
    head = torch.nn.Parameter(torch.randn(16, 8, generator=gen))
    mat = torch.nn.Parameter(torch.randn(8, 8, generator=gen))
    start_head, start_mat = head.detach().clone(), mat.detach().clone()
    opt = _optimizer({"head": head, "m0": mat}, adam_every=2)
    grads = [torch.randn(16, 8, generator=gen) for _ in range(2)]
    for g in grads:
        head.grad, mat.grad = g.clone(), torch.randn(8, 8, generator=gen)
        opt.step()
        opt.zero_grad()
        if g is grads[0]:
            assert torch.equal(head.detach(), start_head)  # skipped step: untouched
            assert not torch.equal(mat.detach(), start_mat)  # NorMuon steps every step
    want = record_adam_fp64(start_head, [grads[0] + grads[1]], (0.5, 0.95), 1e-10, 0.05, 0.0)
    torch.testing.assert_close(head.detach().double(), want, rtol=1e-5, atol=1e-6)


def test_tied_embedding_follows_the_head_then_continues_from_its_state():
    """Tied for 2 steps: the head steps on (embed grad + head grad) and the embedding copies it; from
    step 3 the embedding continues the head's Adam recurrence (moments and step count) on its own
    gradient: both equal an fp64 Adam over [s1, s2, own third gradient] from the common start."""
    gen = torch.Generator().manual_seed(5)
    embed = torch.nn.Parameter(torch.empty(16, 8))
    head = torch.nn.Parameter(torch.randn(16, 8, generator=gen))
    with torch.no_grad():
        embed.copy_(head)
    start = head.detach().clone()
    opt = _optimizer({"embed": embed, "head": head}, tie=(embed, head, 2))
    grads = [(torch.randn(16, 8, generator=gen), torch.randn(16, 8, generator=gen)) for _ in range(3)]
    for step, (ge, gh) in enumerate(grads):
        embed.grad, head.grad = ge.clone(), gh.clone()
        opt.step()
        opt.zero_grad()
        if step < 2:
            assert torch.equal(embed.detach(), head.detach())
    assert not opt.tied
    sums = [ge + gh for ge, gh in grads[:2]]
    for p, third in ((embed, grads[2][0]), (head, grads[2][1])):
        want = record_adam_fp64(start, [*sums, third], (0.5, 0.95), 1e-10, 0.05, 0.0)
        torch.testing.assert_close(p.detach().double(), want, rtol=1e-5, atol=1e-6)


def test_state_dict_round_trip_continues_exactly():
    """A fresh optimizer loaded from a state dict (taken after a skipped Adam step, so with kept
    gradients) continues bit for bit like the original."""
    gen = torch.Generator().manual_seed(6)

    def make():
        torch.manual_seed(0)
        params = {
            "head": torch.nn.Parameter(torch.randn(16, 8)),
            "m0": torch.nn.Parameter(torch.randn(8, 24)),
        }
        return params, _optimizer(params, adam_every=2)

    grads = [(torch.randn(16, 8, generator=gen), torch.randn(8, 24, generator=gen)) for _ in range(4)]

    def run(params, opt, steps):
        for gh, gm in steps:
            params["head"].grad, params["m0"].grad = gh.clone(), gm.clone()
            opt.step()
            opt.zero_grad()

    a, opt_a = make()
    run(a, opt_a, grads)
    b, opt_b = make()
    run(b, opt_b, grads[:3])
    state = opt_b.state_dict()
    assert state["kept"]  # step 3 skipped Adam
    c, opt_c = make()
    with torch.no_grad():
        for k in c:
            c[k].copy_(b[k])
    opt_c.load_state_dict(state)
    run(c, opt_c, grads[3:])
    for k in a:
        assert torch.equal(a[k], c[k]), k


def test_one_normuon_step_composes_the_record_pieces_with_the_shape_multiplier():
    """ShardedNorMuonAdam on a tall and a wide matrix (two banks) against the record's step in fp64:
    Nesterov (lerp form) → Polar Express → NorMuon → cautious decay, lr·√max(1, rows/cols)."""
    gen = torch.Generator().manual_seed(7)
    tall = torch.nn.Parameter(torch.randn(96, 32, generator=gen) * 0.1)
    wide = torch.nn.Parameter(torch.randn(32, 96, generator=gen) * 0.1)
    opt = ShardedNorMuonAdam(
        [Row("tall", tall, "normuon", "matrix", True), Row("wide", wide, "normuon", "matrix", True)],
        {}, muon_lr=0.02, momentum=0.9, beta2=0.95, muon_weight_decay=1.2,
    )  # fmt: skip
    start = {"tall": tall.detach().double().clone(), "wide": wide.detach().double().clone()}
    grads = {"tall": torch.randn(96, 32, generator=gen), "wide": torch.randn(32, 96, generator=gen)}
    tall.grad, wide.grad = grads["tall"].clone(), grads["wide"].clone()
    opt.step()
    for name, p in (("tall", tall), ("wide", wide)):
        g = grads[name].double()
        buf = torch.zeros_like(g) + (g - 0) * (1 - 0.9)  # lerp(0, g, 0.1)
        d = g + (buf - g) * 0.9  # lerp(g, buf, 0.9)
        v = record_polar_express_fp64(d)
        v, _ = record_normuon_fp64(
            v, torch.zeros(second_moment_shape(tuple(g.shape)), dtype=torch.float64), 0.95
        )
        rows, cols = g.shape
        lr = 0.02 * max(1.0, rows / cols) ** 0.5
        w = start[name]
        want = w - w * ((v * w) >= 0) * (1.2 * 0.02) * lr - v * lr
        delta, want_delta = p.detach().double() - w, want - w
        assert (delta - want_delta).norm() / want_delta.norm() < 4e-2, name  # bf16 Polar Express


def test_the_new_switches_are_checked_at_the_edge():
    from speedrun.errors import ConfigError
    from speedrun.recipes import load_recipe

    with pytest.raises(ConfigError, match="optim.name=normuon"):
        load_recipe("demo", ["optim.adam_every=2"])
    with pytest.raises(ConfigError, match="tie_embeddings=false"):
        load_recipe("demo-normuon", ["model.zero_init_head=true"])
    with pytest.raises(ConfigError, match="multiple of optim.adam_every"):
        load_recipe("demo-normuon", ["optim.tie_until=93"])


def test_schedule_gives_the_cooldown_and_leaves_old_recipes_alone():
    from speedrun.recipes import load_recipe
    from speedrun.train.schedule import schedule_at

    cfg = load_recipe("demo-normuon")
    o, n = cfg.optim, cfg.train.steps
    for step in range(n + 1):
        want = record_momentum(step, n, 30, 6, 0.85, 0.95)
        assert schedule_at(step, cfg).muon_momentum == pytest.approx(want, abs=1e-15)
    assert o.muon_momentum_warmup_steps == 30 and o.muon_momentum_cooldown_steps == 6
    demo = load_recipe("demo")  # no cooldown: the warm-up formula of before, bit for bit
    for step in range(demo.train.steps + 1):
        frac = min(1.0, step / 30)
        assert schedule_at(step, demo).muon_momentum == (1 - frac) * 0.85 + frac * 0.95


def test_bf16_weights_step_exactly_like_fp32_through_the_mantissa_buffer():
    """A bf16 matrix whose fp32 value lives in (bf16 bits, uint16 mantissa) follows the fp32 matrix fed
    the same gradients bit for bit (#57): the bf16 weight is just the top half of the fp32 one."""
    gen = torch.Generator().manual_seed(8)
    start = (torch.randn(3, 48, 16, generator=gen) * 0.1).bfloat16()
    p16, p32 = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.float())

    def make(p):
        return ShardedNorMuonAdam(
            [Row("m", p, "normuon", "matrix", True)], {}, muon_lr=0.02, momentum=0.9, beta2=0.95,
            muon_weight_decay=1.2,
        )  # fmt: skip

    o16, o32 = make(p16), make(p32)
    for _ in range(4):
        g = torch.randn(3, 48, 16, generator=gen).bfloat16()
        p16.grad, p32.grad = g.clone(), g.float()
        o16.step()
        o32.step()
    mantissa = o16.state["bank:48x16:bfloat16"]["mantissa"]
    rebuilt = join_fp32(p16.detach().view(torch.uint16), mantissa)
    assert torch.equal(rebuilt.view(torch.int32), p32.detach().view(torch.int32))
    assert not torch.equal(p16.detach().float(), p32.detach())  # bf16 alone would have lost bits
