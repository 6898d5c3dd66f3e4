"""Muon: momentum SGD whose update for each weight matrix is orthogonalized (G → ≈UVᵀ).

One class serves one device and many: with a process group, each rank orthogonalizes a round-robin
share of the matrices and the results are exchanged with asynchronous all-gathers; without one the
same code runs with no communication. See ``Muon`` for the update rule and the distributed contract.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from speedrun.optim.orthogonalize import BACKENDS, NS_COEFFICIENTS, NS_FORMS, orthogonalize

#: Names accepted by ``Muon(shape_scale=...)``.
SHAPE_SCALES: tuple[str, ...] = ("ratio", "max_dim", "rms", "none")

#: Names accepted by ``Muon(momentum_form=...)``: "ema" (lerp, 12-08 on) or "sgd" (m·buf + g, to 12-04).
MOMENTUM_FORMS: tuple[str, ...] = ("ema", "sgd")

_SPLIT_ATTR = "_muon_split"


def set_muon_split(param: Tensor, parts: int) -> Tensor:
    """Declare a 2-D weight as ``parts`` matrices stacked along dim 0, orthogonalized separately.

    A fused QKV weight (3·d, d) holds three (d, d) maps; orthogonalizing it whole would mix them.
    Tensors with ndim >= 3 need no declaration: they are always treated as stacks over leading dims.
    The declaration is an attribute of the Parameter object: it survives ``module.to()``,
    ``to_empty()`` and ``torch.save``, but ``copy.deepcopy`` drops it, so declare it again on copies.
    Muon reads it at every step. Returns ``param`` so it can wrap a constructor call.
    """
    if param.ndim != 2:
        raise ValueError(f"set_muon_split expects a 2-D weight, got shape {tuple(param.shape)}")
    if parts < 1 or param.shape[0] % parts:
        raise ValueError(
            f"cannot split a weight of shape {tuple(param.shape)} into {parts} parts along dim 0"
        )
    setattr(param, _SPLIT_ATTR, int(parts))
    return param


def muon_split(param: Tensor) -> int:
    """How many dim-0 blocks ``set_muon_split`` declared for ``param`` (1 if none)."""
    return getattr(param, _SPLIT_ATTR, 1)


def _blocks(t: Tensor, like: Tensor) -> Tensor:
    """View ``t`` (shaped like param ``like``) as (count, rows, cols): the matrices Muon orthogonalizes."""
    if like.ndim == 2:
        parts = muon_split(like)
        return t.unsqueeze(0) if parts == 1 else t.view(parts, like.shape[0] // parts, like.shape[1])
    return t.view(-1, *like.shape[-2:])


def _shape_scale(kind: str, update: Tensor) -> float | Tensor:
    """Multiplier for an update of shape (count, rows, cols); a per-block tensor for "rms"."""
    rows, cols = update.shape[-2:]
    if kind == "ratio":
        return math.sqrt(max(1.0, rows / cols))
    if kind == "max_dim":
        return math.sqrt(max(rows, cols))
    if kind == "rms":
        norms = torch.linalg.matrix_norm(update, keepdim=True)
        return math.sqrt(rows * cols) / norms.clamp_min(1e-12)
    return 1.0


def _momentum_dtype(param: Tensor) -> torch.dtype:
    """Keep momentum in fp32 for low-precision weights (small gradients would vanish in bf16)."""
    return torch.float32 if param.dtype in (torch.bfloat16, torch.float16) else param.dtype


@dataclass
class _Bucket:
    """Same-shape matrices of one param group, orthogonalized in one batched call.

    Built once and reused while the set of parameters with gradients, their splits and their momentum
    buffers stay the same, so a step does no Python planning and no re-viewing of the weights.
    """

    group: dict[str, Any]
    group_index: int
    shape: tuple[int, int]
    items: list[tuple[Tensor, int]] = field(default_factory=list)  # (param, block index)
    params: list[Tensor] = field(default_factory=list)  # params with >= 1 block here, in order
    weight_blocks: list[Tensor] = field(default_factory=list)  # (rows, cols) view of every block
    plain: bool = True  # every param is one unsplit 2-D matrix (stack the directions directly)


class Muon(torch.optim.Optimizer):
    """Muon for matrix-shaped weights (hidden layers); use Adam/AdamW for embeddings, heads and 0-D/1-D.

    Per parameter, each step (hyperparameters are read from the param group every step, so a
    scheduler or the trainer may change ``group["lr"]`` and ``group["momentum"]`` between steps)::

        buf ← lerp(buf, g, 1 - momentum)                      # momentum_form "ema" (default)
        d   ← lerp(g, buf, momentum) if nesterov else buf
        buf ← momentum·buf + g                                # momentum_form "sgd" (records to 12-04)
        d   ← g + momentum·buf if nesterov else buf
        U   ← orthogonalize(d) per block                      # backend, ns_steps, ns_form, ns_coefficients
        p   ← p · (1 - lr·weight_decay)                       # only where sign(U) == sign(p) if cautious
        p   ← p - lr · shape_scale(block) · U                 # scale_in_update_dtype: (scale·U) rounded
                                                              # to U's dtype first (10-17 … 12-04)

    The two momentum forms differ by the factor (1 - momentum), which the orthogonalization removes
    while the momentum is constant; under a momentum warmup they point in different directions.

    Blocks: a 2-D weight is one matrix unless ``set_muon_split`` declared parts; a tensor with
    ndim >= 3 is a stack of matrices over its leading dims. Each block is orthogonalized and
    shape-scaled on its own; blocks of equal shape within a group share one batched iteration.

    Backends (``BACKENDS``): "newton_schulz" (quintic, bf16; ``ns_form`` picks a record's op order),
    "polar_express" (bf16), "svd" (exact, fp32). Shape scales (``SHAPE_SCALES``), for a block of shape
    (rows, cols): "ratio" = sqrt(max(1, rows/cols)) (the 2024-11 records and torch.optim.Muon),
    "max_dim" = sqrt(max(rows, cols)) (2024-10 records), "rms" = sqrt(rows·cols)/‖U‖_F (unit-RMS
    update), "none" = 1 (the first seed, 2024-10-04).

    Distribution: with ``process_group`` (or the default group when torch.distributed is
    initialized), rank r orthogonalizes blocks r, r+W, ... of each bucket; updates travel by async
    all-gather while the next bucket is computed. Gradients must already be averaged across ranks by
    the caller (DDP or an explicit all-reduce): every rank then keeps the same momentum, so the
    optimizer state is *replicated*, not sharded. ``state_dict()`` on any rank is complete and
    independent of the world size; load it on every rank.

    ``params`` may be tensors, (name, tensor) pairs (names appear in errors) or param-group dicts.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[tuple[str, Tensor]] | Iterable[dict[str, Any]],
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        cautious_weight_decay: bool = False,
        backend: str = "newton_schulz",
        ns_steps: int = 5,
        shape_scale: str = "ratio",
        process_group: dist.ProcessGroup | None = None,
        momentum_form: str = "ema",
        ns_form: str = "fused",
        scale_in_update_dtype: bool = False,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        ns_dtype: torch.dtype | None = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            cautious_weight_decay=cautious_weight_decay,
            backend=backend,
            ns_steps=ns_steps,
            shape_scale=shape_scale,
            momentum_form=momentum_form,
            ns_form=ns_form,
            scale_in_update_dtype=scale_in_update_dtype,
            ns_coefficients=tuple(ns_coefficients),
        )
        self._process_group = process_group
        self.orthogonalize = orthogonalize  # the speed layer may put a compiled twin here (train/ setup)
        self._comm_buffers: dict[tuple, tuple[Tensor, Tensor]] = {}
        self._cached_plan: tuple[tuple, list[_Bucket]] | None = None
        super().__init__(params, defaults)
        if ns_dtype is None:  # as train.dtype=auto: the records' bf16 only where the device runs it fast
            from speedrun.hardware import fast_bf16

            device = next((p.device for g in self.param_groups for p in g["params"]), torch.device("cpu"))
            ns_dtype = torch.bfloat16 if fast_bf16(device.type)[0] else torch.float32
        self.ns_dtype = ns_dtype  # the iterations' precision: bf16 (the records), fp32 where bf16 is slow

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group after checking its options and that every tensor is a matrix or stack."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        index = len(self.param_groups) - 1
        _check_options(group, index)
        names = group.get("param_names")
        for i, p in enumerate(group["params"]):
            what = f"parameter {names[i]!r}" if names else f"parameter {i} of param group {index}"
            if p.ndim < 2:
                raise ValueError(
                    f"Muon cannot optimize {what} of shape {tuple(p.shape)}: it needs a matrix (ndim >= 2); "
                    "give 0-D/1-D parameters to Adam/AdamW"
                )
            if p.is_complex() or not p.is_floating_point():
                raise ValueError(f"Muon cannot optimize {what}: dtype {p.dtype} is not a real floating type")

    def _world(self) -> tuple[dist.ProcessGroup | None, int, int]:
        group = self._process_group
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        if group is None:
            return None, 0, 1
        return group, dist.get_rank(group), dist.get_world_size(group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One update of every parameter that has a gradient; returns the closure's loss if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pg, rank, world = self._world()
        directions = self._momentum()
        pending = None
        for bucket in self._plan(world):
            launched = self._launch(bucket, directions, pg, rank, world)
            if pending is not None:
                self._finish(*pending)  # overlaps with the all-gather just launched
            pending = (bucket, *launched)
        if pending is not None:
            self._finish(*pending)
        return loss

    def _momentum(self) -> dict[Tensor, Tensor]:
        """Update every momentum buffer (on every rank: state is replicated); return the directions
        to orthogonalize, per param. One multi-tensor op per group and stage where dtypes allow."""
        directions: dict[Tensor, Tensor] = {}
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            bufs = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, dtype=_momentum_dtype(p))
                bufs.append(state["momentum_buffer"])
            grads = [p.grad.to(b.dtype) for p, b in zip(params, bufs, strict=True)]  # no copy if same
            m = group["momentum"]
            if group["momentum_form"] == "sgd":
                torch._foreach_mul_(bufs, m)
                torch._foreach_add_(bufs, grads)
                out = torch._foreach_add(grads, bufs, alpha=m) if group["nesterov"] else bufs
            else:
                torch._foreach_lerp_(bufs, grads, 1 - m)
                out = torch._foreach_lerp(grads, bufs, m) if group["nesterov"] else bufs
            directions.update(zip(params, out, strict=True))
        return directions

    def _plan(self, world: int) -> list[_Bucket]:
        """Group blocks by shape; rebuilt only when the params with gradients or their state change."""
        key = (
            world,
            tuple(
                (id(p), p.data_ptr(), muon_split(p), id(self.state[p].get("momentum_buffer")))
                for group in self.param_groups
                for p in group["params"]
                if p.grad is not None
            ),
        )
        if self._cached_plan is not None and self._cached_plan[0] == key:
            return self._cached_plan[1]
        buckets: list[_Bucket] = []
        for index, group in enumerate(self.param_groups):
            by_shape: dict[tuple[int, int], _Bucket] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                blocks = _blocks(p.detach(), p)
                bucket = by_shape.setdefault(tuple(blocks.shape[1:]), _Bucket(group, index, blocks.shape[1:]))
                bucket.items.extend((p, i) for i in range(blocks.shape[0]))
                bucket.params.append(p)
                bucket.weight_blocks.extend(blocks.unbind(0))
                bucket.plain = bucket.plain and p.ndim == 2 and blocks.shape[0] == 1
            buckets.extend(by_shape.values())
        self._cached_plan = (key, buckets)
        return buckets

    def _stacked_directions(
        self, bucket: _Bucket, directions: dict[Tensor, Tensor], rank: int, world: int
    ) -> Tensor | None:
        """(count, rows, cols) directions of this rank's blocks of the bucket (None: it has none)."""
        if world == 1:
            dirs = [directions[p] for p in bucket.params]
            if bucket.plain:
                return torch.stack(dirs)
            return torch.cat([_blocks(d, p) for d, p in zip(dirs, bucket.params, strict=True)])
        mine = bucket.items[rank::world]
        if not mine:
            return None
        return torch.stack([_blocks(directions[p], p)[i] for p, i in mine])

    def _launch(
        self,
        bucket: _Bucket,
        directions: dict[Tensor, Tensor],
        pg: dist.ProcessGroup | None,
        rank: int,
        world: int,
    ) -> tuple[Tensor, Any]:
        """Orthogonalize this rank's blocks; start the all-gather. Returns (gathered, work handle)."""
        group = bucket.group
        stacked = self._stacked_directions(bucket, directions, rank, world)
        out_dtype = _output_dtype(group["backend"], bucket.items[0][0], self.ns_dtype)
        rows, cols = bucket.shape
        mine = None
        if stacked is not None:
            ns = (group["backend"], group["ns_steps"], group["ns_form"], self.ns_dtype)
            coefficients = group.setdefault("ns_coefficients", NS_COEFFICIENTS)
            mine = self.orthogonalize(stacked, *ns, coefficients=coefficients).to(out_dtype)
        if world == 1:
            return mine, None
        per_rank = math.ceil(len(bucket.items) / world)
        key = (bucket.group_index, bucket.shape, per_rank, world, out_dtype, bucket.items[0][0].device)
        if key not in self._comm_buffers:
            size = per_rank * rows * cols
            send = torch.empty(size, dtype=out_dtype, device=key[-1])
            self._comm_buffers[key] = (send, torch.empty(world * size, dtype=out_dtype, device=key[-1]))
        send, recv = self._comm_buffers[key]
        send3 = send.view(per_rank, rows, cols)
        count = 0 if mine is None else mine.shape[0]
        if mine is not None:
            send3[:count].copy_(mine)
        send3[count:].zero_()  # padding when the block count is not divisible by the world size
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        work = gather(recv, send, group=pg, async_op=True)
        return recv.view(world, per_rank, rows, cols), work

    def _finish(self, bucket: _Bucket, ordered: Tensor, work: Any) -> None:
        """Wait for the bucket's updates and apply them (weight decay, shape scale, lr): the update is
        added with the scale folded into alpha, after one exact cast to the weights' wider dtype."""
        if work is not None:
            work.wait()
        if ordered.ndim == 4:  # gathered (world, per_rank, ...): block j came from rank j % world
            world, per_rank = ordered.shape[:2]
            ordered = ordered.transpose(0, 1).reshape(world * per_rank, *bucket.shape)
        group = bucket.group
        lr, wd = group["lr"], group["weight_decay"]
        weights = bucket.weight_blocks
        ordered = ordered[: len(weights)]
        updates = list(ordered.unbind(0))
        if wd != 0:
            if group["cautious_weight_decay"]:
                for w, u in zip(weights, updates, strict=True):
                    w.sub_(w * (u * w > 0), alpha=lr * wd)
            else:
                torch._foreach_mul_(weights, 1 - lr * wd)
        if group["shape_scale"] == "rms":  # one factor per block, computed in full precision
            full = ordered.to(torch.promote_types(weights[0].dtype, torch.float32))
            scaled = full * _shape_scale("rms", full)
            torch._foreach_add_(weights, list(scaled.unbind(0)), alpha=-lr)
        else:
            scale = _shape_scale(group["shape_scale"], ordered)
            if group.get("scale_in_update_dtype") and scale != 1:  # 10-17 … 12-04: g *= scale in bf16
                ordered, scale = ordered * scale, 1.0
            wide = weights[0].dtype
            if ordered.dtype != wide and torch.promote_types(ordered.dtype, wide) == wide:
                ordered = ordered.to(wide)  # exact; CUDA fuses same-dtype lists, mixed: one per tensor
            torch._foreach_add_(weights, list(ordered.unbind(0)), alpha=-lr * scale)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Like torch's, but keep fp32 momentum for bf16/fp16 weights (torch casts it to the param dtype)."""
        saved = {k: v.get("momentum_buffer") for k, v in state_dict["state"].items()}
        super().load_state_dict(state_dict)
        self._cached_plan = None
        params = [p for group in self.param_groups for p in group["params"]]
        for index, buf in saved.items():
            if isinstance(buf, Tensor):
                p = params[index]
                self.state[p]["momentum_buffer"] = buf.to(
                    device=p.device, dtype=_momentum_dtype(p), copy=True
                )


def _output_dtype(backend: str, param: Tensor, ns_dtype: torch.dtype) -> torch.dtype:
    """dtype of the orthogonalized update, fixed per backend so all ranks allocate the same buffers."""
    if backend == "svd":
        return torch.float64 if param.dtype == torch.float64 else torch.float32
    return ns_dtype


def _check_options(group: dict[str, Any], index: int) -> None:
    where = f"param group {index}"
    choices = {
        "backend": BACKENDS,
        "shape_scale": SHAPE_SCALES,
        "momentum_form": MOMENTUM_FORMS,
        "ns_form": NS_FORMS,
    }
    for key, names in choices.items():
        if group[key] not in names:
            raise ValueError(f"{where}: unknown {key} {group[key]!r}; choose one of {', '.join(names)}")
    if not isinstance(group["ns_steps"], int) or group["ns_steps"] < 1:
        raise ValueError(f"{where}: ns_steps must be a positive integer, got {group['ns_steps']!r}")
    if not 0.0 <= group["momentum"] < 1.0:
        raise ValueError(f"{where}: momentum must be in [0, 1), got {group['momentum']!r}")
    if group["lr"] < 0 or group["weight_decay"] < 0:
        raise ValueError(f"{where}: lr and weight_decay must be >= 0")
