"""CUDA graphs of the training step (speedrun/perf/graphs.py) on the CPU, through the code CUDA runs with
torch.cuda faked (tests/fake_cuda_graphs.py records the ops of a capture, replays them, refuses a host sync
or an import inside it): a key's first visit warms on the side stream and captures, the second checks the
replay against eager, later ones only replay; the step with graphs equals the plain step bit for bit; a
graph that baked a value fails its check; the warm-up visits each key of the capture plan twice within the
rules' 40 steps, and the plain path is what every CPU run and `train.perf=off` get."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from speedrun.config.stages import stage_plan
from speedrun.errors import ConfigError
from speedrun.perf import graphs
from speedrun.perf.capture_plan import MAX_WARMUP_STEPS, capture_plan, key_at
from speedrun.train.stages import stage_at, stage_bounds
from speedrun.train.step import train_step
from speedrun.train.warmup import warmup_steps
from tests.fake_cuda_graphs import CaptureError, FakeCuda
from tests.recipe_matrix import batch, build, rows, shrunk


class Tiny(nn.Module):
    """Embedding, a matrix, cross-entropy: the step's shape of work in a few hundred parameters."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.lin = nn.Linear(8, 16, bias=False)
        self.scale = 1.0  # a Python value the forward reads (keyed by graphs.model_key)
        self.extra = 1.0  # one it is not keyed on

    def forward(self, x, y):
        logits = self.lin(self.emb(x)) * self.scale * self.extra
        return nn.functional.cross_entropy(logits.view(-1, 16), y.view(-1))


class Opt:
    """What train_step asks of an optimizer: SGD, so every gradient shows in the weights."""

    def __init__(self, model: nn.Module) -> None:
        self.params = list(model.parameters())

    def parameters(self):
        return iter(self.params)

    @torch.no_grad()
    def step(self) -> None:
        torch._foreach_add_(self.params, [p.grad for p in self.params], alpha=-0.5)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None


def batches(n: int, shape=(2, 6), seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, 16, shape, generator=g), torch.randint(0, 16, shape, generator=g)) for _ in range(n)
    ]


def run(model, opt, data, accum: int):
    it = iter(data)
    return [train_step(model, opt, lambda: next(it), accum, None) for _ in range(len(data) // accum)]


def with_graphs(model: nn.Module, fake: FakeCuda) -> Opt:
    opt = Opt(model)
    opt.step_graphs = graphs.ManualStepGraphs(
        model, opt.params, graphs.CudaBackend(torch.device("cpu"), fake)
    )
    return opt


@pytest.mark.parametrize("accum", [1, 2])
def test_capture_check_replay_in_order_and_the_step_equals_the_plain_one_bit_for_bit(accum):
    data = batches(4 * accum)
    plain = Tiny()
    want = run(plain, Opt(plain), data, accum)
    model, fake = Tiny(), FakeCuda()
    opt = with_graphs(model, fake)
    got = run(model, opt, data, accum)
    assert [float(a) for a in got] == [float(b) for b in want]
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)
    sg = opt.step_graphs
    # first visit: the side stream's warm iterations, one capture, then the replay that does the work
    first = ["side waits for main", "on side", "main waits for side", "synchronize", "capture", "synchronize"]
    assert fake.calls[: len(first) + 1] == [*first, "replay"]
    assert fake.calls.count("capture") == 1 and fake.calls.count("replay") == 4 * accum
    assert [line.split(":")[0] for line in sg.log] == [
        "CUDA graph captured",
        "CUDA graph checked against eager",
    ]
    sg.seal()
    run(model, opt, batches(accum, seed=1), accum)  # sealed: replays only
    assert fake.calls.count("capture") == 1


def test_a_new_key_is_captured_and_checked_and_after_the_seal_refused():
    model, fake = Tiny(), FakeCuda()
    opt = with_graphs(model, fake)
    run(model, opt, batches(2), 1)
    model.scale = 2.0  # a new stage's value: a new graph
    run(model, opt, batches(1), 1)
    with pytest.raises(AssertionError, match="never checked"):
        opt.step_graphs.seal()
    run(model, opt, batches(1), 1)
    opt.step_graphs.seal()
    assert fake.calls.count("capture") == 2
    with pytest.raises(AssertionError, match="no CUDA graph .* after the warm-up"):
        run(model, opt, batches(1, shape=(3, 6)), 1)  # a shape the warm-up never met


def test_a_graph_that_baked_a_value_fails_its_check_against_eager():
    model, fake = Tiny(), FakeCuda()
    opt = with_graphs(model, fake)
    run(model, opt, batches(1), 1)
    model.extra = 3.0  # not in the key: the replay still multiplies by 1.0
    with pytest.raises(AssertionError, match="replay loss .* != eager"):
        run(model, opt, batches(1, seed=2), 1)


def test_the_capture_does_not_execute_so_a_missed_replay_reads_nan():
    model, fake = Tiny(), FakeCuda()
    sg = with_graphs(model, fake).step_graphs
    static = [t.clone() for t in batches(1)[0]]
    _, (loss, grads) = sg.backend.capture(lambda: sg._loss_and_grads(static, None))
    assert loss.isnan() and all(g.isnan().all() for g in grads)


class Syncs(Tiny):
    def forward(self, x, y):
        loss = super().forward(x, y)
        return loss * 0 + loss.item()  # a host sync: CUDA refuses it while capturing


class Imports(Tiny):
    def forward(self, x, y):
        import colorsys  # noqa: F401  (loaded the first time here)

        return super().forward(x, y)


@pytest.mark.parametrize("cls, words", [(Syncs, "host sync"), (Imports, "import of colorsys")])
def test_a_host_sync_or_an_import_inside_the_captured_step_is_found_on_the_cpu(cls, words):
    sys.modules.pop("colorsys", None)
    model = cls()
    opt = Opt(model)
    backend = graphs.CudaBackend(torch.device("cpu"), FakeCuda())
    backend.warm = lambda fn, times: None  # the capture is the first run (as a cold import would be)
    opt.step_graphs = graphs.ManualStepGraphs(model, opt.params, backend)
    with pytest.raises(CaptureError, match=words):
        run(model, opt, batches(1), 1)


def test_record_2026_07s_training_step_runs_the_cuda_graph_branch_on_the_cpu():
    """The shrunk record's real model through the CUDA branch (fake torch.cuda): no host sync and no import
    inside the captured forward and backward, and two steps equal the plain step's bit for bit."""
    cfg = shrunk("record-2026-07", "train.dtype=fp32", "model.block_dtype=fp32", "model.fp8_head=false",
                 "model.mlp_fp8=false")  # fmt: skip

    def two_steps(use_graphs: bool):
        model, optimizer = build(cfg)
        if use_graphs:
            params = [p for p in optimizer.parameters() if p.requires_grad]
            backend = graphs.CudaBackend(torch.device("cpu"), FakeCuda())
            optimizer.step_graphs = graphs.ManualStepGraphs(model, params, backend)
        losses = []
        for step in range(2):
            x, y = batch(step, cfg)
            it = iter([rows(cfg, x[i : i + 1], y[i : i + 1]) for i in range(2)])
            losses.append(train_step(model, optimizer, it.__next__, 2, None).item())
        if use_graphs:
            del optimizer.step_graphs
        return losses, [p.detach().clone() for p in model.parameters()]

    want, want_params = two_steps(False)
    got, got_params = two_steps(True)
    assert got == want
    for a, b in zip(got_params, want_params, strict=True):
        assert torch.equal(a, b)


def test_the_warmup_visits_every_key_of_the_capture_plan_twice_within_40_steps():
    from speedrun.recipes import load_recipe

    cfg = load_recipe("record-2026-07")
    plan = stage_plan(cfg)
    visits = graphs.plan_visit_steps(cfg)
    assert visits == [s for s, _, _ in capture_plan(plan, adam_every=1).visits]
    steps = graphs.merge_visits(warmup_steps(cfg, 0), visits)
    assert len(steps) <= MAX_WARMUP_STEPS and steps == sorted(steps)
    keys = [key_at(plan, s, 1) for s in steps]
    assert all(keys.count(k) >= 2 for k in set(keys)) and len(set(keys)) == 4
    assert set(warmup_steps(cfg, 0)) <= set(steps)  # the compile warm-up's own steps are kept
    # a resumed run meets its stage's key at its first step
    mid = plan.total_steps // 2
    resumed = graphs.merge_visits(warmup_steps(cfg, mid), graphs.plan_visit_steps(cfg, mid))
    assert resumed[:2] == [mid, mid] and all(s >= mid for s in resumed)
    assert graphs.merge_visits([7], None) == [7, 7]  # no stages: one key
    assert graphs.merge_visits([0, 5], [0, 0, 3, 3]) == [0, 0, 3, 3, 5, 5]  # a base step is checked too
    with pytest.raises(ConfigError, match="needs 42 steps, the rules allow 40"):
        graphs.merge_visits(list(range(20)), [50, 50])


def test_the_plain_step_is_kept_on_the_cpu_with_perf_off_and_on_several_processes():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    env = {"SPEEDRUN_GRAPHS": "manual"}
    assert graphs.chosen("auto", cuda, 1, env) == "manual"
    assert graphs.chosen("auto", cuda, 1, {}) == ""  # unset until the lease chooses
    assert graphs.chosen("off", cuda, 1, env) == graphs.chosen("auto", cpu, 1, env) == ""
    assert graphs.chosen("auto", cuda, 2, env) == ""
    with pytest.raises(ConfigError, match="SPEEDRUN_GRAPHS='both'"):
        graphs.chosen("auto", cuda, 1, {"SPEEDRUN_GRAPHS": "both"})
    cfg = shrunk("record-2026-07")
    model, optimizer = build(cfg)
    line = graphs.install(optimizer, model, model, cfg, cpu, 1, True, env=env)
    assert line.startswith("CUDA graphs: off") and not hasattr(optimizer, "step_graphs")
    assert graphs.warmup_steps(optimizer, [0, 5]) == [0, 5]


def test_install_attaches_the_manual_graphs_with_the_plans_visits():
    cfg = shrunk("record-2026-07")
    model, optimizer = build(cfg)
    fake_cuda = type("D", (), {"type": "cuda"})()
    backend = graphs.CudaBackend(torch.device("cpu"), FakeCuda())
    line = graphs.install(
        optimizer, model, model, cfg, fake_cuda, 1, True, backend, {"SPEEDRUN_GRAPHS": "manual"}
    )
    assert line.startswith("CUDA graphs: manual step (2 keys x 2 untimed visits")
    assert graphs.warmup_steps(optimizer, [0]) == graphs.merge_visits([0], graphs.plan_visit_steps(cfg))


def test_install_refuses_the_row_sharded_table_in_one_line():
    """#92's table pulls its rows on the host before each forward: a replay would skip the pull."""
    cfg = shrunk("anvil-2026-08")
    model, optimizer = build(cfg)
    assert "ngram_rows" in optimizer.parts
    fake_cuda = type("D", (), {"type": "cuda"})()
    backend = graphs.CudaBackend(torch.device("cpu"), FakeCuda())
    for way in ("manual", "trees"):
        with pytest.raises(ConfigError, match=f"SPEEDRUN_GRAPHS={way}: #92's row-sharded n-gram table") as e:
            graphs.install(
                optimizer, model, model, cfg, fake_cuda, 1, True, backend, {"SPEEDRUN_GRAPHS": way}
            )
        assert "\n" not in str(e.value) and not hasattr(optimizer, "step_graphs")


def test_the_trees_way_runs_the_plain_step_through_its_compiled_model():
    data = batches(4)
    plain = Tiny()
    want = run(plain, Opt(plain), data, 2)
    model = Tiny()
    opt = Opt(model)
    opt.step_graphs = graphs.TreeStepGraphs(model, compile_fn=lambda m, **kw: m)  # the CPU: no inductor trees
    got = run(model, opt, data, 2)
    assert [float(a) for a in got] == [float(b) for b in want]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("way", ["manual", "trees"])
def test_cuda_graph_capture_and_replay_equal_eager_on_the_gpu(way):
    cuda = torch.device("cuda")
    data = [tuple(t.to(cuda) for t in b) for b in batches(6)]
    plain = Tiny().to(cuda)
    want = run(plain, Opt(plain), data, 2)
    model = Tiny().to(cuda)
    opt = Opt(model)
    if way == "manual":
        opt.step_graphs = graphs.ManualStepGraphs(model, opt.params, graphs.CudaBackend(cuda))
    else:
        opt.step_graphs = graphs.TreeStepGraphs(model)
    got = run(model, opt, data, 2)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=2e-3, atol=1e-3)
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-4)


THREE_STAGES = (
    "train.stages=tokens=256 windows=1/1 frac=1/3; tokens=512 windows=1/2 frac=1/3; "
    "tokens=512 windows=2/2 frac=1/3; tokens=512 windows=2/2 ext=0"
)


class StageLoader:
    """The loader as the warm-up drives it: positioned by step (`load_state_dict`), each step two (1, T/2)
    micro-batch rows with their cu_seqlens, T its stage's tokens."""

    def __init__(self, cfg) -> None:
        self.cfg, self.plan, self.step, self.micro = cfg, stage_plan(cfg), 0, 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state) -> None:
        self.step = state["step"]

    def next_batch(self):

        tokens = self.plan.stages[stage_at(self.step, self.plan)[0]].batch_tokens // 2
        g = torch.Generator().manual_seed(2 * self.step + self.micro)
        seq = torch.randint(0, 60, (1, tokens + 1), generator=g)
        seq[:, ::50] = self.cfg.model.eot_id
        self.step, self.micro = self.step + self.micro, 1 - self.micro
        return rows(self.cfg, seq[:, :-1], seq[:, 1:])


def test_the_warm_up_captures_each_stage_key_then_checks_it_and_seals():
    """record-2026-07 shrunk to three stages (the extension shares stage 3's windows): the warm-up runs each
    key's first step twice, capture then check, in the run's order, and leaves the graphs sealed; the
    state it restores is the one a run without graphs starts from."""
    from speedrun.train.warmup import warm_up

    cfg = shrunk("record-2026-07", THREE_STAGES, "model.block_dtype=fp32", "model.fp8_head=false",
                 "model.mlp_fp8=false")  # fmt: skip
    model, optimizer = build(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fake = FakeCuda()
    backend = graphs.CudaBackend(torch.device("cpu"), fake)
    cuda = type("Device", (), {"type": "cuda"})()
    graphs.install(optimizer, model, model, cfg, cuda, 1, True, backend, {"SPEEDRUN_GRAPHS": "manual"})
    sg = optimizer.step_graphs
    seen = []
    forward_backward = sg.forward_backward
    sg.forward_backward = lambda batch, dtype: seen.append(sg.key(batch)) or forward_backward(batch, dtype)
    n = warm_up(cfg, model, model, optimizer, StageLoader(cfg), 2, None, lambda: None)
    plan = stage_plan(cfg)
    starts = [a for a, _ in stage_bounds(plan)][:3]
    want_steps = graphs.merge_visits(warmup_steps(cfg, 0), [s for s in starts for _ in range(2)])
    assert n == len(want_steps) and want_steps[:6] == [s for s in starts for _ in range(2)]
    assert [key_at(plan, s, 1) for s in want_steps].count(key_at(plan, 0, 1)) == 2
    assert len(sg.captured) == 3 and fake.calls.count("capture") == 3
    firsts = list(dict.fromkeys(seen))
    assert [seen.count(k) for k in firsts] == [4, 4, 2 * (n - 4)]  # 2 micro-batches each step
    assert all(cs.checked for cs in sg.captured.values()) and sg.sealed
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_the_compiled_step_runs_fullgraph_inside_the_capture_on_the_cpu():
    """As a GPU runs it: the module the step calls is compiled (fullgraph, dynamic=False; aot_eager keeps
    the CPU's compile short), the warm iterations compile it, then the capture runs the compiled forward
    and its compiled backward through torch.autograd.grad with the import guard on. The capturing step
    computes what the plain step computes (a non-recording fake replays nothing, so one step)."""
    cfg = shrunk("record-2026-07", "train.dtype=fp32", "model.block_dtype=fp32", "model.fp8_head=false",
                 "model.mlp_fp8=false", n_layer=2)  # fmt: skip
    torch._dynamo.reset()

    def one_step(use_graphs: bool):
        model, optimizer = build(cfg)
        train_model = model
        if use_graphs:
            train_model = torch.compile(model, fullgraph=True, dynamic=False, backend="aot_eager")
            params = [p for p in optimizer.parameters() if p.requires_grad]
            backend = graphs.CudaBackend(torch.device("cpu"), FakeCuda(record=False))
            optimizer.step_graphs = graphs.ManualStepGraphs(train_model, params, backend, plain=model)
        x, y = batch(0, cfg)
        loss = train_step(train_model, optimizer, iter([rows(cfg, x[:1], y[:1])]).__next__, 1, None)
        return loss.item(), [p.detach().clone() for p in model.parameters()]

    want, want_params = one_step(False)
    got, got_params = one_step(True)
    assert got == pytest.approx(want, rel=1e-6)
    for a, b in zip(got_params, want_params, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
