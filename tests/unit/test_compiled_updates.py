"""The compiled optimizer updates (speedrun/perf/compiled_updates.py) against their eager twins.

Not bit for bit, and why: the eager update rounds `1 − μ` from a double (Python floats), the graph
computes it in fp32 from its fp32 μ tensor (one graph for every μ of the schedule), and inductor fuses
the elementwise tail and reorders NorMuon's reductions. Measured on an AVX2 host the weights differ by
under 3e-6 of the step size after three steps; the tolerance is 5e-5 of it, and the eager update itself
moves each weight by about the step size, so a wrong formula (a lost term, a swapped axis) fails by
orders of magnitude. The momentum and second-moment buffers agree to 1e-5 of
their largest entry (measured: under 3e-6)."""

from __future__ import annotations

import pytest
import torch

from speedrun.optim.muon import Muon, set_muon_split
from speedrun.optim.normuon import join_fp32
from speedrun.optim.orthogonalize import orthogonalize
from speedrun.optim.sharded import ShardedNorMuonAdam
from speedrun.optim.table import Row
from speedrun.perf import compiled_updates
from speedrun.perf.compiled_updates import CompiledBankUpdate

LR = 0.02
TOLERANCE = 5e-5 * LR  # see the module docstring


class Parts:  # a RunOptimizer's shape as install reads it
    def __init__(self, **parts):
        self.parts = parts


def _sharded(seed: int) -> tuple[ShardedNorMuonAdam, dict[str, torch.nn.Parameter]]:
    """Two banks: bf16 matrices stepped in fp32 through the mantissa (#57) and wide fp32 ones, one with
    a per-matrix lr multiplier (a (k, 1, 1) lr tensor)."""
    gen = torch.Generator().manual_seed(seed)
    params = {
        "m16": torch.nn.Parameter((torch.randn(3, 48, 16, generator=gen) * 0.1).bfloat16()),
        "w0": torch.nn.Parameter(torch.randn(16, 40, generator=gen) * 0.1),
        "w1": torch.nn.Parameter(torch.randn(16, 40, generator=gen) * 0.1),
    }
    rows = [Row(n, p, "normuon", "matrix", True, lr_mul=2.0 if n == "w1" else 1.0) for n, p in params.items()]
    opt = ShardedNorMuonAdam(
        rows, {}, muon_lr=LR, momentum=0.85, beta2=0.95, muon_weight_decay=1.2, ns_dtype=torch.float32
    )
    return opt, params


def _fp32(opt: ShardedNorMuonAdam, params) -> dict[str, torch.Tensor]:
    mantissa = opt.state["bank:48x16:bfloat16"]["mantissa"]
    out = {n: p.detach().clone() for n, p in params.items() if p.dtype == torch.float32}
    out["m16"] = join_fp32(params["m16"].detach().view(torch.uint16), mantissa)
    return out


@pytest.mark.slow  # two inductor graphs on the CPU: ~20 s on a 2-core host
def test_compiled_normuon_banks_step_like_eager_with_one_graph_per_bank_for_every_schedule_value():
    torch._dynamo.reset()
    eager, pe = _sharded(0)
    compiled, pc = _sharded(0)
    compiled.bank_update = CompiledBankUpdate()
    gen = torch.Generator().manual_seed(1)
    start = _fp32(eager, pe)
    frames = None
    for step in range(3):
        for opt in (eager, compiled):  # the schedule moves lr and momentum every step
            opt.param_groups[0]["lr"] = LR * (1 - step / 10)
            opt.param_groups[0]["momentum"] = 0.85 + 0.03 * step
        for name in pe:
            g = torch.randn(pe[name].shape, generator=gen)
            pe[name].grad, pc[name].grad = g.to(pe[name].dtype), g.to(pc[name].dtype)
        eager.step()
        compiled.step()
        if step == 0:
            frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames  # no recompile per lr/μ
    want, got = _fp32(eager, pe), _fp32(compiled, pc)
    for name in want:
        moved = (want[name] - start[name]).abs().max().item()
        assert moved > 100 * TOLERANCE, name  # the tolerance is far below one step's change
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=TOLERANCE, msg=name)
    for key, st in eager.state.items():  # the mantissa's low bits are compared in the fp32 weights above
        for k, v in st.items():
            if k != "mantissa":  # a few fp32 ulps of the buffer's largest entry (lerp and means, fused)
                atol = 1e-5 * v.abs().max().item()
                torch.testing.assert_close(compiled.state[key][k], v, rtol=0, atol=atol, msg=f"{key} {k}")


@pytest.mark.slow  # inductor graphs on the CPU
def test_compiled_muon_orthogonalization_steps_like_eager():
    def make():
        gen = torch.Generator().manual_seed(2)
        qkv = torch.nn.Parameter(torch.randn(48, 16, generator=gen) * 0.1)
        stack = torch.nn.Parameter(torch.randn(2, 16, 40, generator=gen) * 0.1)
        set_muon_split(qkv, 3)
        return Muon([qkv, stack], lr=LR, backend="newton_schulz", ns_dtype=torch.float32), [qkv, stack]

    (eager, pe), (compiled, pc) = make(), make()
    compiled.orthogonalize = compiled_updates.compiled_orthogonalize()
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        for a, b in zip(pe, pc, strict=True):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        eager.step()
        compiled.step()
    for a, b in zip(pe, pc, strict=True):
        torch.testing.assert_close(b.detach(), a.detach(), rtol=0, atol=TOLERANCE)


def test_install_swaps_the_compiled_updates_only_for_auto_on_cuda():
    """CPU (either setting) and `off` keep the eager twins, the optimizer's own functions, so a CPU run
    is bit for bit what it was; `auto` on CUDA swaps both kinds (lazily: nothing compiles here)."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for mode, device in (("auto", cpu), ("off", cpu), ("off", cuda)):
        table, _ = _sharded(0)
        muon = Muon([torch.nn.Parameter(torch.zeros(4, 4))], ns_dtype=torch.float32)
        line = compiled_updates.install(Parts(table=table, muon=muon), mode, device)
        assert table.bank_update is None and muon.orthogonalize is orthogonalize, (mode, device)
        assert line.startswith("optimizer updates: eager") and f"train.perf={mode}" in line
    table, _ = _sharded(0)
    muon = Muon([torch.nn.Parameter(torch.zeros(4, 4))], ns_dtype=torch.float32)
    limit = torch._dynamo.config.recompile_limit
    try:
        line = compiled_updates.install(Parts(table=table, muon=muon), "auto", cuda)
    finally:
        torch._dynamo.config.recompile_limit = limit
    assert isinstance(table.bank_update, CompiledBankUpdate) and muon.orthogonalize is not orthogonalize
    assert line == (
        "optimizer updates: compiled (NorMuon per bank (2 graphs), Muon's orthogonalization; train.perf=auto)"
    )
