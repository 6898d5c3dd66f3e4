"""One optimizer step: the function the loop, the benchmarks and the tests all call. It never reads a
value back from the device; the caller decides when to wait (at log points)."""

from __future__ import annotations

import contextlib
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


def train_step(
    model: torch.nn.Module,
    optimizer: RunOptimizer,
    next_batch: Callable[[], Batch],
    accumulation_steps: int,
    dtype: torch.dtype | None = torch.bfloat16,
    grad_clip: float = 0.0,
    grad_scale: float = 1.0,
) -> Tensor:
    """Accumulate gradients over `accumulation_steps` micro-batches, step, zero; return the mean loss.

    `model` is the GPT, its compiled form or a DDP wrapper (all-reducing only on the last micro-batch). As
    the records, each micro-batch back-propagates its own mean loss and the sum is divided by the count,
    then multiplied by the schedule's `grad_scale` after the backward (the FP8 head's fixed scales assume a
    mean loss). The loss is a 0-dim device tensor, never read here."""
    loss_sum: Tensor | None = None
    # the speed layer's backward hooks (perf/overlap.py): on the last micro-batch they start each finished
    # reduction inside the backward, on a copy scaled as below; never with clipping (it needs them all)
    overlap = getattr(optimizer, "overlap", None) if grad_clip <= 0 else None
    graphs = getattr(optimizer, "step_graphs", None)
    for micro in range(accumulation_steps):
        x, y, *cu_seqlens = next_batch()
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
