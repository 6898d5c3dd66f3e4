"""The optimizer tail's CUDA graphs (speedrun/perf/optimizer_graphs.py) on the CPU through faked torch.cuda
(tests/fake_cuda_graphs.py): each bank shape is captured once, checked against eager at its second call,
then only replayed; the schedule's lr and momentum, which move every step, reach the replay as values in
memory (a baked value would fail the comparison); and the weights, the momentum, the second moment and
the bf16 mantissa equal bit for bit those of the same bank update run without graphs, over steps whose
inputs come from fresh tensors each time (the optimizer does not keep addresses; the graph's buffers do)."""

from __future__ import annotations

import pytest
import torch

from speedrun.optim.normuon import normuon_update
from speedrun.perf import optimizer_graphs
from speedrun.perf.graphs import CudaBackend
from speedrun.perf.optimizer_graphs import BankGraphs
from tests.fake_cuda_graphs import FakeCuda
from tests.unit.test_compiled_updates import LR, Parts, _fp32, _sharded


def tensor_scalars(*args):
    """The bank update as the graph runs it: its three scalars as fp32 tensors (the reference's twin)."""
    a = list(args)
    for i in (5, 6, 7):
        if not isinstance(a[i], torch.Tensor):
            a[i] = torch.tensor(a[i], dtype=torch.float32)
    return normuon_update(*a)


def steps(opt, params, n: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    for step in range(n):
        opt.param_groups[0]["lr"] = LR * (1 - step / 10)
        opt.param_groups[0]["momentum"] = 0.85 + 0.03 * step
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


def test_bank_graphs_capture_check_replay_and_step_like_the_update_without_graphs():
    opt, params = _sharded(0)
    opt.bank_update = tensor_scalars
    fake = FakeCuda()
    (bg,) = optimizer_graphs.install(Parts(table=opt), CudaBackend(torch.device("cpu"), fake))
    assert opt.bank_update is bg
    steps(opt, params, 2)
    bg.seal()
    steps(opt, params, 2, seed=3)  # fresh gradients: the rest of the reference's stream
    assert len(bg.graphs) == 2 and fake.calls.count("capture") == 2  # two bank shapes
    assert [line.split(":")[0] for line in bg.log].count("optimizer graph checked against eager") == 2
    want_opt, want_p = _sharded(0)
    want_opt.bank_update = tensor_scalars
    steps(want_opt, want_p, 2)
    steps(want_opt, want_p, 2, seed=3)
    want, got = _fp32(want_opt, want_p), _fp32(opt, params)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    for key, st in want_opt.state.items():
        for k, v in st.items():
            assert torch.equal(opt.state[key][k], v), (key, k)


def test_an_optimizer_graph_that_baked_the_learning_rate_fails_its_check():
    """An update that reads the lr from Python (here a closure the test moves each step, as a careless
    update would read a param group) is baked by the capture; the eager check at the second call sees it."""
    opt, params = _sharded(0)
    live = {"lr": LR}

    def bakes_lr(*args):
        return tensor_scalars(*args[:5], live["lr"], *args[6:])

    opt.bank_update = bakes_lr
    optimizer_graphs.install(Parts(table=opt), CudaBackend(torch.device("cpu"), FakeCuda()))
    steps(opt, params, 1)
    live["lr"] = LR / 2
    with pytest.raises(AssertionError, match="replay update differs from eager"):
        steps(opt, params, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bank_graphs_replay_like_the_eager_update_on_the_gpu():
    """Each bank's update as the optimizer calls it (arguments recorded from a CPU step), on CUDA: capture,
    check, then replays with a new lr and momentum each call, against the update run eagerly on copies."""
    opt, params = _sharded(0)
    calls = []
    opt.bank_update = lambda *a: calls.append(a) or tensor_scalars(*a)
    steps(opt, params, 1)
    cuda = torch.device("cuda")
    for args in calls:
        live = [None if t is None else t.to(cuda) for t in args[:5]]
        ref = [None if t is None else t.clone() for t in live]
        lr0 = args[5].to(cuda) if isinstance(args[5], torch.Tensor) else args[5]
        bg = BankGraphs(tensor_scalars, CudaBackend(cuda))
        gen = torch.Generator(device=cuda).manual_seed(0)
        for step in range(4):
            grads = torch.randn(live[0].shape, device=cuda, generator=gen).to(live[0].dtype)
            live[0], ref[0] = grads, grads.clone()
            lr, mu = lr0 * (1 - step / 10), 0.85 + 0.03 * step
            new = bg(*live, lr, args[6], mu, *args[8:]).clone()
            want = tensor_scalars(*ref, lr, args[6], mu, *args[8:])
            torch.testing.assert_close(new, want, rtol=1e-3, atol=1e-5)
            live[3].copy_(new)
            ref[3].copy_(want)
        assert len(bg.graphs) == 1 and all(tg.checked for tg in bg.graphs.values())
