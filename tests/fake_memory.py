"""Peak memory of a recipe's training step at full size, measured with fake tensors on the CPU.

Under FakeTensorMode no tensor owns memory, so a 65,536-token recipe's forward, backward and optimizer
step run in seconds on any machine; a dispatch mode above it sees every op's outputs and follows each
storage until it is freed (a weakref on the storage), so the live bytes and their peak are those a
caching allocator would be asked for. The CUDA path is mirrored where it differs: the attention is a
stand-in with FlexAttention's memory contract (output and log-sum-exp saved with q, k, v; dq, dk, dv
in the backward), as FlexAttention has no fake CPU path here, and RMSNorm one with the fused CUDA
kernel's (input and an fp32 rstd saved; the CPU composite saves an fp32 copy of its input).
Compiled runs are not measured (that needs the compiler's own buffers); train/plan/memory.py states how
they differ.
"""

from __future__ import annotations

import warnings
import weakref
from contextlib import contextmanager
from unittest import mock

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from speedrun.config import Config
from speedrun.model import contexts
from speedrun.model.families import build_model
from speedrun.optim.build import build_optimizer
from speedrun.train.schedule import apply_schedule, schedule_at
from speedrun.train.step import autocast, autocast_dtype, train_step


class LiveStorage(TorchDispatchMode):
    """Bytes of the storages alive now and at most since `reset_peak` (each storage counted once)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)  # the storage's Python object lives exactly as long as the storage
        if key in self._seen:
            return
        nbytes = storage.nbytes()
        self._seen.add(key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def reset_peak(self) -> None:
        self.peak = self.live


class _FlexLike(torch.autograd.Function):
    """FlexAttention's memory: saves q, k, v, the output and an fp32 log-sum-exp (B, H, T); the
    backward returns dq, dk, dv (and allocates a (B, H, T) fp32 delta)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        delta = torch.empty_like(lse)
        del delta
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _flex_like_attend(q, k, v, mask=None, scale=None, kernel="auto"):
    return _FlexLike.apply(q, k, v)


class _FusedRmsNormLike(torch.autograd.Function):
    """CUDA's fused RMSNorm (`aten._fused_rms_norm`): saves the input and an fp32 rstd per row; the
    CPU composite would save an fp32 copy of the input instead."""

    @staticmethod
    def forward(ctx, x):
        rstd = x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)
        ctx.save_for_backward(x, rstd)
        return torch.empty_like(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.empty_like(grad)


def _rms_norm_like(x, normalized_shape, weight=None, eps=None):
    assert weight is None, "the model's RMSNorm is parameter-free"
    return _FusedRmsNormLike.apply(x)


@contextmanager
def _cuda_like_kernels():
    """Attention and RMSNorm with the memory contracts of their CUDA kernels."""
    with mock.patch.object(contexts, "attend", _flex_like_attend):
        with mock.patch.object(F, "rms_norm", _rms_norm_like):
            yield


def fake_peak_bytes(cfg: Config) -> dict[str, int]:
    """Peak live bytes of one training step of `cfg` on one process (accumulation as the config says)
    with fake tensors, after an optimizer step on zero gradients has created the optimizer state."""
    assert cfg.train.dtype != "auto", "resolve train.dtype first (fp32 or bf16)"
    t = cfg.train
    accum = t.global_batch_tokens // t.micro_batch_tokens
    rows = t.micro_batch_tokens // t.seq_len
    tracker = LiveStorage()
    with FakeTensorMode(), tracker, _cuda_like_kernels(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*data pointer of FakeTensor.*")  # Muon's plan key
        torch.manual_seed(0)
        model = build_model(cfg.model)
        optimizer = build_optimizer(model, cfg)
        weights = tracker.live
        for p in optimizer.parameters():
            p.grad = torch.zeros(p.shape, dtype=p.dtype)  # zeros_like: fp32 for 0-dim bf16 fakes
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        state = tracker.live - weights

        def next_batch():
            x = torch.randint(0, cfg.model.vocab_size, (rows, t.seq_len))
            return x, torch.randint(0, cfg.model.vocab_size, (rows, t.seq_len))

        apply_schedule(schedule_at(t.steps // 2, cfg), optimizer, model)
        tracker.reset_peak()
        train_step(model, optimizer, next_batch, accum, autocast_dtype(cfg), cfg.optim.grad_clip)
        peak = tracker.peak
        tracker.reset_peak()
        with torch.no_grad(), autocast(torch.device("cpu"), autocast_dtype(cfg) if t.val_autocast else None):
            model.eval()  # as train/evaluate.py: one row of val_seq_len tokens, or a micro-batch
            row = t.val_seq_len or t.seq_len
            rows = (t.val_seq_len or t.micro_batch_tokens) // row
            tokens = torch.randint(0, cfg.model.vocab_size, (rows, row))
            model(tokens, tokens, reduction="none")
        return {"weights": weights, "state": state, "peak": peak, "validation": tracker.peak}
