"""What a COMPILED training step keeps for its backward, counted on the CPU with fake tensors.

The step is traced as `torch.compile` hands it to inductor: aot_autograd with inductor's decompositions
and its min-cut partitioner (`compiler="inductor"`), so the forward graph's extra outputs are exactly the
tensors the compiled step saves for its backward. Nothing is computed: parameters and inputs are fake,
so a full-width 49,152-token step is traced in a minute on any CPU. The varlen attention is a custom op
with FA3's / FlexAttention's memory contract (saves q, k, v, the output and an fp32 (H, T) log-sum-exp),
as the CPU's blocked tier would save its own chunks instead. Counted per step at its backward's start:

- `saved`: the bytes of the forward graph's saved tensors that are not parameters or buffers;
- `backward`: the largest of the backward graph's live bytes beyond the saved ones, walking its nodes in
  order and freeing each value after its last use, where only what inductor cannot fuse is materialized
  (outputs of matmuls, custom ops and the like, and the values they read);
- `weights`: parameters and buffers.

Blind spots: temporaries inside custom ops (the FP8 head's e5m2 gradient copy, 1 byte a logit) and the
allocator's rounding; the optimizer's state and accumulated gradients are the guard's own count.
"""

from __future__ import annotations

import operator
import warnings
from contextlib import contextmanager
from unittest import mock

import torch
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._subclasses.fake_tensor import FakeTensorMode

from speedrun.config import Config
from speedrun.model.families import build_model
from speedrun.model.gpt2026 import windows
from speedrun.train.schedule import apply_to_model, schedule_at
from speedrun.train.step import autocast, autocast_dtype


@torch.library.custom_op("speedrun_memcount::attend", mutates_args=())
def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed (T, H, D) → (output (T, H, Dv), log-sum-exp (H, T) fp32): the kernels' outputs."""
    raise AssertionError("traced only")


@_attend.register_fake
def _(q, k, v):
    return v.new_empty((*q.shape[:-1], v.size(-1))), q.new_empty((q.size(1), q.size(0)), dtype=torch.float32)


@torch.library.custom_op("speedrun_memcount::attend_backward", mutates_args=())
def _attend_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    raise AssertionError("traced only")


@_attend_backward.register_fake
def _(grad, q, k, v, out, lse):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output)


def _backward(ctx, grad, grad_lse):
    return _attend_backward(grad, *ctx.saved_tensors)


_attend.register_autograd(_backward, setup_context=_setup)


def _kernel_like(q, k, v, cu_seqlens, window=0, scale=None, max_seqlen=None, tier="auto"):
    return _attend(q, k, v)[0]


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return (
            value.untyped_storage().nbytes()
            if value.is_contiguous()
            else value.numel() * value.element_size()
        )
    return 0


def _backward_peak(bw: torch.fx.GraphModule) -> int:
    """Live bytes beyond the graph's inputs, node by node, each value freed after its last use. As
    inductor fuses, a pointwise or reduction value that only feeds pointwise or reduction ops is never
    materialized; everything else (matmuls, custom ops, and their inputs) is."""
    last_use: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in bw.graph.nodes:
        for used in node.all_input_nodes:
            last_use[used] = node
    dying: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for value, user in last_use.items():
        dying.setdefault(user, []).append(value)
    live = peak = 0
    for node in bw.graph.nodes:
        if _materialized(node):
            live += sum(_nbytes(v) for v in _values(node))
            peak = max(peak, live)
        for value in dying.get(node, []):  # saved inputs too: freed once used up
            if value.target is operator.getitem:  # one output of a multi-output op
                live -= _nbytes(value.meta.get("val"))
            elif value.op == "placeholder" or (_materialized(value) and len(_values(value)) == 1):
                live -= _nbytes(value.meta.get("val"))
    return peak


def _fusable(node: torch.fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return node.op == "call_function" and (torch.Tag.pointwise in tags or torch.Tag.reduction in tags)


def _materialized(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or _is_view(node) or node.target is operator.getitem:
        return False
    if not _fusable(node):
        return True
    return any(u.op == "output" or not (_fusable(u) or _is_view(u)) for u in node.users)


def _values(node: torch.fx.Node) -> list:
    val = node.meta.get("val")
    return list(val) if isinstance(val, (tuple, list)) else [val]


def _is_view(node: torch.fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and hasattr(target, "is_view") and bool(target.is_view)


class _Step(torch.nn.Module):
    """The model's training forward with its loss, as the loop calls the compiled model."""

    def __init__(self, model: torch.nn.Module, dtype) -> None:
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, x, y, cu):
        with autocast(x.device, self.dtype):
            return (self.model(x, y, cu),)


@contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore")
        yield


def compiled_saved_bytes(cfg: Config) -> dict[str, int]:
    """Bytes a compiled varlen step of `cfg` keeps at its backward's start (one process, one micro-batch
    of `train.micro_batch_tokens` in one packed row of documents of the stage's longest length)."""
    assert cfg.train.dtype != "auto", "resolve train.dtype first (fp32 or bf16)"
    assert getattr(cfg.model, "attention", "") == "varlen", "the varlen step: a gpt2026 varlen recipe"
    t = cfg.train
    T = t.micro_batch_tokens
    parts: dict[str, torch.fx.GraphModule] = {}

    def partition(joint, inputs, **kwargs):
        fw, bw = min_cut_rematerialization_partition(joint, inputs, compiler="inductor", **kwargs)
        parts["fw"], parts["bw"] = fw, bw
        return fw, bw

    def boxed(gm, example_inputs):
        from functorch.compile import make_boxed_func

        return make_boxed_func(gm.forward)

    from torch._inductor.decomposition import select_decomp_table

    fake = FakeTensorMode(allow_non_fake_inputs=False)
    with fake, _quiet(), mock.patch.object(windows, "varlen_attention", _kernel_like):
        torch.manual_seed(0)
        model = build_model(cfg.model)
        model.train()
        apply_to_model(schedule_at(t.steps - 1, cfg), model)  # the last stage: the longest windows
        max_doc = model.varlen_windows.max_doc_len or T
        x = torch.randint(0, cfg.model.vocab_size, (1, T))
        y = torch.randint(0, cfg.model.vocab_size, (1, T))
        cu = torch.arange(0, T + 1, max_doc, dtype=torch.int32)
        weights = sum(_nbytes(p) for p in {id(p): p for p in model.parameters()}.values())
        weights += sum(_nbytes(b) for b in model.buffers())
        aot_module_simplified(
            _Step(model, autocast_dtype(cfg)),
            [x, y, cu],
            fw_compiler=boxed,
            bw_compiler=boxed,
            partition_fn=partition,
            decompositions=select_decomp_table(),
        )
    fw = parts["fw"]
    outputs = list(fw.graph.nodes)[-1].args[0]
    n_user = 1  # the loss
    saved = [n for n in outputs[n_user:] if isinstance(n, torch.fx.Node) and n.op != "placeholder"]
    by_storage: dict[int, int] = {}
    for node in saved:
        for v in _values(node):
            if isinstance(v, torch.Tensor):
                by_storage[id(v.untyped_storage())] = _nbytes(v)
    return {
        "weights": weights,
        "saved": sum(by_storage.values()),
        "backward": _backward_peak(parts["bw"]),
        "saved_by_op": _by_op(saved),
    }


def _by_op(saved: list[torch.fx.Node]) -> dict[str, int]:
    out: dict[str, int] = {}
    for node in saved:
        value = _values(node)[0]
        key = f"{getattr(node.target, '__name__', node.target)} {tuple(value.shape)} {value.dtype}"
        out[key] = out.get(key, 0) + sum(_nbytes(v) for v in _values(node))
    return out
