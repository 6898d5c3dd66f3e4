"""One optimizer step: the function the loop, the benchmarks and the tests all call. It never reads a
value back from the device; the caller decides when to wait (at log points)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from speedrun.config import Config
from speedrun.optim.build import RunOptimizer

Batch = tuple[Tensor, ...]  # inputs, targets (and cu_seqlens with model.attention=varlen)


def autocast_dtype(cfg: Config) -> torch.dtype | None:
    """The autocast dtype of the recipe's forward passes (None = full precision); `cfg` is a run's
    effective config, its `train.dtype` resolved for the device by train/plan/precision.py."""
    assert cfg.train.dtype != "auto", "train.dtype=auto must be resolved first (precision.effective_config)"
    return torch.bfloat16 if cfg.train.dtype == "bf16" else None


def autocast_label(cfg: Config) -> str:
    """How the forward computes, for log lines: `train.dtype=fp32` means no autocast, so each op runs
    in its inputs' dtype (bf16 for the records that store their weights in bf16)."""
    return "bf16 autocast" if autocast_dtype(cfg) is not None else "no autocast"


def autocast(device: torch.device, dtype: torch.dtype | None):
    """Autocast on `device` to `dtype`, or nothing when dtype is None."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(device_type=device.type, dtype=dtype)


_SLOT_PARTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def micro_slot_parts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The parts that keep state per micro-batch slot (a `micro_slot` index buffer: #89's delayed FP8
    activation scales, model/gpt2026/fp8_mlp.py), found once per model or wrapper."""
    if model not in _SLOT_PARTS:
        _SLOT_PARTS[model] = [m for m in model.modules() if hasattr(m, "set_micro_slots")]
    return _SLOT_PARTS[model]


def size_micro_slots(model: torch.nn.Module, slots: int) -> None:
    """Give the slotted parts `slots` = processes x accumulation steps slots (the micro-batches of one
    optimizer step, all processes together; slot c is the step's chunk c, which the loaders give to
    rank c % world as its micro-step c // world): before a checkpoint is loaded, before any forward."""
    for part in micro_slot_parts(model):
        part.set_micro_slots(slots)


def _point_slots(parts: list[torch.nn.Module], slot: int) -> None:
    """The next forward is micro-batch slot `slot`: an in-place write of a 0-d index (no recompile),
    skipped where it already holds it (one micro-batch per process: set once)."""
    for part in parts:
        if getattr(part, "_slot_held", None) != slot:
            part.micro_slot.fill_(slot)
            part._slot_held = slot


def share_micro_slots(model: torch.nn.Module, rank: int, world: int) -> None:
    """Every process ends with every slot's state: each keeps the slots it ran (rank, rank + world, ...),
    zeroes the others, and one all-reduce (sum) of all parts' slots together fills them in. Run before a
    checkpoint is written, so the saved state is the same for any number of processes."""
    parts = micro_slot_parts(model)
    if not parts or world == 1:
        return
    flat = torch.stack([p.act_scale for p in parts])  # (parts, slots)
    mine = torch.zeros_like(flat)
    mine[:, rank::world] = flat[:, rank::world]
    torch.distributed.all_reduce(mine)
    for p, row in zip(parts, mine, strict=True):
        p.act_scale.copy_(row)


def train_step(
    model: torch.nn.Module,
    optimizer: RunOptimizer,
    next_batch: Callable[[], Batch],
    accumulation_steps: int,
    dtype: torch.dtype | None = torch.bfloat16,
    grad_clip: float = 0.0,
    grad_scale: float = 1.0,
    slot_of: tuple[int, int] = (0, 1),
) -> Tensor:
    """Accumulate gradients over `accumulation_steps` micro-batches, step, zero; return the mean loss.

    `model` is the GPT, its compiled form or a DDP wrapper (all-reducing only on the last micro-batch). As
    the records, each micro-batch back-propagates its own mean loss and the sum is divided by the count,
    then multiplied by the schedule's `grad_scale` after the backward (the FP8 head's fixed scales assume a
    mean loss). The loss is a 0-dim device tensor, never read here. `slot_of` = (rank, world size) numbers
    the micro-batches across processes for the parts with per-slot state: micro-step k is the step's
    chunk k x world + rank, as the loaders read it."""
    loss_sum: Tensor | None = None
    # the speed layer's backward hooks (perf/overlap.py): on the last micro-batch they start each finished
    # reduction inside the backward, on a copy scaled as below; never with clipping (it needs them all)
    overlap = getattr(optimizer, "overlap", None) if grad_clip <= 0 else None
    graphs = getattr(optimizer, "step_graphs", None)
    slotted = micro_slot_parts(model)
    if slotted and slotted[0].act_scale.numel() < accumulation_steps * slot_of[1]:  # unsized (benchmarks,
        size_micro_slots(model, accumulation_steps * slot_of[1])  # tests): the loop sizes before a resume
    for micro in range(accumulation_steps):
        x, y, *cu_seqlens = next_batch()
        if slotted:
            _point_slots(slotted, micro * slot_of[1] + slot_of[0])
        if graphs is not None:  # the speed layer's CUDA graphs (perf/graphs.py; one process, no hooks)
            loss = graphs.forward_backward((x, y, *cu_seqlens), dtype)
            loss_sum = loss if loss_sum is None else loss_sum + loss
            continue
        last = micro == accumulation_steps - 1
        defer_sync = isinstance(model, DistributedDataParallel) and not last
        with model.no_sync() if defer_sync else contextlib.nullcontext():
            with autocast(x.device, dtype):
                loss = model(x, y, *cu_seqlens)
            hooks = overlap.last_backward(accumulation_steps, grad_scale) if overlap and last else None
            with hooks or contextlib.nullcontext():
                loss.backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    if accumulation_steps > 1 or grad_scale != 1.0:
        grads = [p.grad for p in optimizer.parameters() if p.grad is not None]
        if accumulation_steps > 1:
            torch._foreach_div_(grads, accumulation_steps)
        if grad_scale != 1.0:
            torch._foreach_mul_(grads, grad_scale)
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(optimizer.parameters(), grad_clip, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    assert loss_sum is not None, "accumulation_steps must be at least 1"
    return loss_sum / accumulation_steps
