"""Process-group setup for torchrun. A plain `speedrun train` is world size 1 with no process group."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from speedrun.errors import ConfigError


@dataclass
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _pick_device(requested: str, local_rank: int) -> torch.device:
    use_cuda = requested == "cuda" or (requested == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is available")
    if local_rank >= torch.cuda.device_count():
        error = ConfigError(
            f"local rank {local_rank} has no GPU: this machine has {torch.cuda.device_count()} "
            "(use --nproc_per_node <= the number of GPUs)"
        )
        error.rank_specific = True  # rank 0 has a GPU and would say nothing
        raise error
    return torch.device("cuda", local_rank)


def setup(requested_device: str = "auto", timeout_s: float = 600.0) -> DistContext:
    """Read torchrun's environment; join the process group (NCCL on CUDA, gloo on CPU) when world > 1.

    The timeout makes every rank fail loudly instead of hanging when another rank dies.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _pick_device(requested_device, local_rank)
    if world_size > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    elif device.type == "cuda":
        torch.cuda.set_device(device)
    return DistContext(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def teardown(clean: bool = True) -> None:
    """Leave the process group. After a clean run, first wait for every rank: a rank that tears down
    while a peer's last collective is still draining its connections can abort that peer (gloo)."""
    if dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum a tensor over ranks in place (no-op on one process)."""
    if ctx.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t
