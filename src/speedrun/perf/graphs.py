"""CUDA graphs of the training step's forward and backward (issue 44; #92 captures its step by hand), two
ways, each an A/B part of the GPU kit (benchmarks/bench_graphs.py); the loser is deleted after the lease:

- `manual`, as #92: per graph key, static input buffers, a few eager warm iterations on a side stream, a
  `torch.cuda.CUDAGraph` of forward + `torch.autograd.grad`, replayed with the batch copied in. The key is
  what a replay cannot re-check: the batch's shapes and the Python values the model specializes on (its
  windows, YaRN history, candidate count, attention scales: `model_key`). A key's first visit captures,
  its second replays and checks loss and gradients against an eager forward/backward on the same
  buffers; `seal()` after the warm-up makes a key never captured fatal (never a silent eager step).
- `trees`: torch.compile's own cudagraph trees, `mode="reduce-overhead"`, on the plain model.

The warm-up runs each of its steps and each capture-plan key's first step twice (perf/capture_plan.py;
`warmup_steps`, within the rules' 40). Gradients leave a replay in the graph's own
pool memory; the step copies them into `p.grad` (a new tensor on the first micro-batch, added on later
ones), as `loss.backward()` would have accumulated them.

Chosen by `SPEEDRUN_GRAPHS=manual|trees` with `train.perf=auto` on CUDA, one process (the overlapped
reductions' hooks and DDP need a backward of their own); unset (the default until the lease measures),
`train.perf=off` and every CPU run keep the plain step, bit for bit. The torch.cuda calls go through
`CudaBackend(cuda=...)`, so tests run this very code on the CPU with torch.cuda faked
(tests/fake_cuda_graphs.py records the ops of a capture and refuses a host sync or an import inside it).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from speedrun.config.stages import stage_plan
from speedrun.errors import ConfigError
from speedrun.perf import optimizer_graphs
from speedrun.perf.capture_plan import MAX_WARMUP_STEPS, capture_plan, key_at
from speedrun.train.stages import stage_bounds

WARM_ITERATIONS = 3  # eager runs on the capture stream first (cuBLAS workspaces, autotuning; #92 does 3)
SELF_CHECK_ABS, SELF_CHECK_REL = 1e-3, 2e-3  # #92's loss tolerance (atomics in the loss kernels)
GRAD_CHECK_REL = 1e-2  # each gradient's largest difference against its largest magnitude
WAYS = ("manual", "trees")


def chosen(mode: str, device: torch.device, world_size: int, env: dict[str, str] | None = None) -> str:
    """Which graph path this run takes: '' (the plain step) unless `train.perf=auto` on CUDA, one process,
    and SPEEDRUN_GRAPHS names a way."""
    way = (os.environ if env is None else env).get("SPEEDRUN_GRAPHS", "")
    if way and way not in WAYS:
        raise ConfigError(f"SPEEDRUN_GRAPHS={way!r}: use one of {', '.join(WAYS)} (or leave it unset)")
    if mode != "auto" or device.type != "cuda" or world_size != 1:
        return ""
    return way


def model_key(model: torch.nn.Module) -> tuple:
    """The Python values a compiled forward specializes on and a replay cannot re-check: the stage's windows,
    the YaRN history, #92's candidate count and every module's float attention scale."""
    scales = tuple(m.scale for m in model.modules() if isinstance(getattr(m, "scale", None), float))
    names = ("varlen_windows", "yarn_windows", "sampled_candidates")
    return (*(getattr(model, n, None) for n in names), scales)


class CudaBackend:
    """The torch.cuda calls of a capture, in one place (`cuda` is faked in the CPU tests)."""

    def __init__(self, device: torch.device, cuda: Any = torch.cuda) -> None:
        self.cuda = cuda
        self.stream = cuda.Stream(device)
        self.pool = cuda.graph_pool_handle()  # one pool: replays of different keys never interleave

    def warm(self, fn: Callable[[], object], times: int) -> None:
        """Run `fn` eagerly `times` times on the capture stream, outside any capture."""
        self.stream.wait_stream(self.cuda.current_stream())
        with self.cuda.stream(self.stream):
            for _ in range(times):
                fn()
        self.cuda.current_stream().wait_stream(self.stream)
        self.cuda.synchronize()

    def capture(self, fn: Callable[[], Any]) -> tuple[Any, Any]:
        """Record `fn` into a new graph (a capture records without executing); returns (graph, outputs)."""
        graph = self.cuda.CUDAGraph()
        with self.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            out = fn()
        self.cuda.synchronize()
        return graph, out


@dataclass
class Captured:
    static: list[Tensor]  # the batch buffers the graph reads; each micro-batch is copied in
    graph: Any
    loss: Tensor  # graph outputs, in the pool
    grads: list[Tensor | None]
    checked: bool = False


@dataclass
class ManualStepGraphs:
    """#92's way: forward + backward of one micro-batch as a replayed CUDA graph per key."""

    model: torch.nn.Module  # the module the step runs (compiled or plain)
    params: list[Tensor]
    backend: Any
    key_of: Callable[[torch.nn.Module], tuple] = model_key
    plain: torch.nn.Module | None = None  # whose Python values key a graph (default: `model`)
    captured: dict[tuple, Captured] = field(default_factory=dict)
    sealed: bool = False
    log: list[str] = field(default_factory=list)  # one line per capture and check (the run log's)

    def key(self, batch: Sequence[Tensor]) -> tuple:
        return (
            tuple((tuple(t.shape), t.dtype) for t in batch),
            self.key_of(self.model if self.plain is None else self.plain),
        )

    def _loss_and_grads(self, static: list[Tensor], autocast_dtype: torch.dtype | None):
        # no autocast weight cache: a capture must not keep casts made outside it (torch.cuda.graph's rule)
        device = static[0].device.type
        ctx = torch.autocast(device, dtype=autocast_dtype, cache_enabled=False) if autocast_dtype else _Null()
        with ctx:
            loss = self.model(*static)
        return loss, torch.autograd.grad(loss, self.params, allow_unused=True)

    def forward_backward(self, batch: Sequence[Tensor], dtype: torch.dtype | None) -> Tensor:
        """One micro-batch: replay its key's graph (capturing, or checking, on a warm-up visit) and add its
        gradients into `p.grad`; returns the loss (a copy: the next replay rewrites the graph's own)."""
        key = self.key(batch)
        cs = self.captured.get(key)
        if cs is None:
            assert not self.sealed, f"no CUDA graph for {key} after the warm-up (perf/capture_plan.py)"
            cs = self._capture(key, batch, dtype)
            fresh = True
        else:
            fresh = False
        for dst, src in zip(cs.static, batch, strict=True):
            dst.copy_(src)
        cs.graph.replay()
        if not fresh and not cs.checked:  # the second visit: the buffers hold this batch, not the capture's
            self._check(key, cs, dtype)
        self._accumulate(self.params, cs.grads)
        return cs.loss.detach().clone()

    def _capture(self, key: tuple, batch: Sequence[Tensor], dtype: torch.dtype | None) -> Captured:
        static = [t.detach().clone() for t in batch]
        self.backend.warm(lambda: self._loss_and_grads(static, dtype), WARM_ITERATIONS)
        graph, (loss, grads) = self.backend.capture(lambda: self._loss_and_grads(static, dtype))
        self.log.append(f"CUDA graph captured: {key[0]}")
        cs = self.captured[key] = Captured(static, graph, loss, list(grads))
        return cs

    @torch.no_grad()
    def _check(self, key: tuple, cs: Captured, dtype: torch.dtype | None) -> None:
        """Replay against eager on the same buffers: catches a graph that baked a value or a stale address."""
        with torch.enable_grad():
            loss, grads = self._loss_and_grads(cs.static, dtype)
        replay, eager = float(cs.loss), float(loss)
        assert abs(replay - eager) <= max(SELF_CHECK_ABS, abs(eager) * SELF_CHECK_REL), (
            f"CUDA graph {key[0]}: replay loss {replay} != eager {eager}"
        )
        for g, e in zip(cs.grads, grads, strict=True):
            if g is None or e is None:
                assert g is e, f"CUDA graph {key[0]}: a gradient is missing on one side"
                continue
            worst = float((g.float() - e.float()).abs().max())
            assert worst <= GRAD_CHECK_REL * float(e.float().abs().max()) + 1e-6, (
                f"CUDA graph {key[0]}: replay gradient differs from eager by {worst:.3g}"
            )
        cs.checked = True
        self.log.append(f"CUDA graph checked against eager: {key[0]} (loss {replay:.6f} vs {eager:.6f})")

    @staticmethod
    def _accumulate(params: list[Tensor], grads: list[Tensor | None]) -> None:
        """p.grad as loss.backward() leaves it: a new tensor with this micro-batch's gradient, or the sum
        so far (a new tensor each step, not a persistent buffer: the optimizer may keep a gradient over a
        step it skips, optim/sharded.py's Adam cadence)."""
        fresh = [(p, g) for p, g in zip(params, grads, strict=True) if g is not None and p.grad is None]
        add = [
            (p.grad, g) for p, g in zip(params, grads, strict=True) if g is not None and p.grad is not None
        ]
        for p, g in fresh:
            p.grad = g.clone()
        if add:
            torch._foreach_add_([a for a, _ in add], [g for _, g in add])

    def seal(self) -> None:
        unchecked = [k[0] for k, cs in self.captured.items() if not cs.checked]
        assert not unchecked, f"CUDA graphs captured but never checked against eager: {unchecked}"
        self.sealed = True


def merge_visits(base: list[int], visits: Sequence[int] | None) -> list[int]:
    """The warm-up's steps with CUDA graphs: every step of `base` (the compile warm-up's: a stage's first
    step, a change of #92's candidate count) and of the capture plan's `visits` (None: a run without
    stages), each twice, the first capturing and the second checking, ascending as the timed run goes;
    refused past the rules' 40 steps."""
    steps = sorted(2 * [*set(base) | set(visits or ())])
    if len(steps) > MAX_WARMUP_STEPS:
        raise ConfigError(
            f"the warm-up with CUDA graphs needs {len(steps)} steps, the rules allow {MAX_WARMUP_STEPS}"
        )
    return steps


class TreeStepGraphs:
    """torch.compile's cudagraph trees (`mode="reduce-overhead"`): inductor captures and replays forward
    and backward itself; each micro-batch marks a new step and the loss is cloned out of its pool."""

    def __init__(self, model: torch.nn.Module, compile_fn: Callable[..., Any] = torch.compile) -> None:
        self.model = compile_fn(model, mode="reduce-overhead", dynamic=False, fullgraph=True)
        self.sealed = False
        self.log: list[str] = []

    def forward_backward(self, batch: Sequence[Tensor], dtype: torch.dtype | None) -> Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        ctx = torch.autocast(batch[0].device.type, dtype=dtype) if dtype else _Null()
        with ctx:
            loss = self.model(*batch)
        loss.backward()
        return loss.detach().clone()

    def seal(self) -> None:
        self.sealed = True


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def plan_visit_steps(cfg: Any, start: int = 0) -> list[int] | None:
    """The capture plan's visit steps from `start` on: each step graph key's first step at or after
    `start`, twice (a resumed run meets its stage's key at `start`); None without stages. The step graphs
    do not depend on the Adam parity (the optimizer tail's keys do)."""
    plan = stage_plan(cfg)
    if plan is None:
        return None
    capture_plan(plan, adam_every=1)  # refused past the rules' 40 steps
    first: dict[Any, int] = {}
    for a, b in stage_bounds(plan):
        if max(a, start) < b:
            first.setdefault(key_at(plan, max(a, start), 1), max(a, start))
    return [s for s in first.values() for _ in range(2)]


def install(optimizer: Any, model: torch.nn.Module, train_model: torch.nn.Module, cfg: Any,
            device: torch.device, world_size: int, compiled: bool, backend: Any = None,
            env: dict[str, str] | None = None) -> str:  # fmt: skip
    """Attach the chosen graph path to the run's optimizer (`optimizer.step_graphs`, read by the step and
    the warm-up); returns the log line. Needs the compile warm-up (compiled forwards) to capture in."""
    way = chosen(cfg.train.perf, device, world_size, env)
    if not way or not compiled:
        why = "" if not way else ", the warm-up needs train.compile"
        return f"CUDA graphs: off (train.perf={cfg.train.perf}, device {device.type}{why})"
    if getattr(optimizer, "feeders", None):
        raise ConfigError(
            f"SPEEDRUN_GRAPHS={way}: #92's row-sharded n-gram table pulls its rows on the host before each"
            " forward, which a replay would skip; unset SPEEDRUN_GRAPHS"
        )
    try:  # refused here, in one line, before anything runs, past the rules' 40 warm-up steps
        visits = plan_visit_steps(cfg)
    except ValueError as e:
        raise ConfigError(f"SPEEDRUN_GRAPHS={way}: {e}") from None
    # the tail gets its own stream and pool, as #92's (tests hand one fake to both)
    tail_backend = backend or CudaBackend(device)
    backend = backend or CudaBackend(device)
    if way == "trees":
        graphs: Any = TreeStepGraphs(model)
    else:
        params = [p for p in optimizer.parameters() if p.requires_grad]
        graphs = ManualStepGraphs(train_model, params, backend, plain=model)
    graphs.visits = lambda start: plan_visit_steps(cfg, start)
    optimizer.step_graphs = graphs
    optimizer.tail_graphs = optimizer_graphs.install(optimizer, tail_backend)  # compiled bank updates, if any
    n = "one key" if visits is None else f"{len(visits) // 2} keys"
    tail = f", optimizer tail: {len(optimizer.tail_graphs)} bank update(s)" if optimizer.tail_graphs else ""
    return f"CUDA graphs: {way} step ({n} x 2 untimed visits in the warm-up{tail}; perf/graphs.py)"


def warmup_steps(optimizer: Any, base: list[int]) -> list[int]:
    """The warm-up's steps: `base`, plus the graph visits when the run captures (train/warmup.py)."""
    graphs = getattr(optimizer, "step_graphs", None)
    return base if graphs is None else merge_visits(base, graphs.visits(base[0]))


def seal(optimizer: Any) -> None:
    """After the warm-up: every captured key was checked, and no key is captured on the clock."""
    graphs = getattr(optimizer, "step_graphs", None)
    if graphs is not None:
        graphs.seal()
    for tail in getattr(optimizer, "tail_graphs", ()):
        tail.seal()
