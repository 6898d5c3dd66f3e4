"""Process-group setup for torchrun. A plain `speedrun train` is world size 1 with no process group."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from speedrun.errors import ConfigError, SpeedrunError


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


def _env_int(name: str, default: int, low: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low:
        raise _launch_error(f"{name}={text!r} must be an integer >= {low}")
    return value


def _launch_error(problem: str) -> ConfigError:
    error = ConfigError(
        f"environment variable {problem}; launch with torchrun (or unset WORLD_SIZE, RANK and LOCAL_RANK)"
    )
    error.rank_specific = True  # RANK itself may be the problem: every process says what it saw
    return error


def launch_env() -> tuple[int, int, int]:
    """(rank, local rank, world size) from torchrun's environment, checked before anything runs (a garbled
    or partial one would train silently as a non-zero rank or fail inside torch.distributed)."""
    world_size = _env_int("WORLD_SIZE", 1, 1)
    rank = _env_int("RANK", 0, 0)
    local_rank = _env_int("LOCAL_RANK", 0, 0)
    if ("RANK" in os.environ) != ("WORLD_SIZE" in os.environ):
        given, missing = ("RANK", "WORLD_SIZE") if "RANK" in os.environ else ("WORLD_SIZE", "RANK")
        raise _launch_error(f"{given} is set but {missing} is not")
    if rank >= world_size:
        raise _launch_error(f"RANK={rank} must be below WORLD_SIZE={world_size}")
    if world_size > 1:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(name):
                raise _launch_error(f"{name} is not set but WORLD_SIZE={world_size}")
    return rank, local_rank, world_size


def cuda_allocator_settings(env: dict[str, str] | None = None) -> None:
    """`expandable_segments:True` (as the records set it: less fragmentation when shapes vary, e.g.
    training and evaluation), unless the user set PYTORCH_CUDA_ALLOC_CONF. Before CUDA allocates."""
    env = os.environ if env is None else env
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def setup(requested_device: str = "auto", timeout_s: float = 1800.0) -> DistContext:
    """Read torchrun's environment; join the process group (NCCL on CUDA, gloo on CPU) when world > 1,
    with `train.dist_timeout_s` so a dead rank fails the others instead of hanging them."""
    rank, local_rank, world_size = launch_env()
    device = _pick_device(requested_device, local_rank)
    if device.type == "cuda":
        cuda_allocator_settings()
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    return DistContext(rank=rank, local_rank=local_rank, world_size=world_size, device=device)


def teardown(clean: bool = True) -> None:
    """Leave the process group. After a clean run, first wait for every rank: a rank that tears down
    while a peer's last collective is still draining its connections can abort that peer (gloo)."""
    if dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


#: what gloo and NCCL say when a peer process died or left: its socket closed, reset or timed out
_PEER_GONE = (
    "connection reset by peer", "connection closed by peer", "broken pipe", "connection refused",
    "timed out", "timeout", "communicator was aborted", "nccl error", "socket",
)  # fmt: skip


def lost_peer(e: BaseException) -> bool:
    """Whether `e`, raised in a collective, says another process of the run is gone."""
    if isinstance(e, dist.DistError):
        return True
    return isinstance(e, RuntimeError) and any(k in str(e).lower() for k in _PEER_GONE)


class PeerLost(SpeedrunError):
    """Another process of a multi-process run died or left mid-step: one line on the survivors, naming the
    collective's error, the newest checkpoint and the command that goes on (torchrun's summary names the
    process that failed first)."""

    exit_code = 1
    rank_specific = True  # every survivor says it: the one that died may be rank 0, which speaks for all

    @classmethod
    def of(cls, e: BaseException, run_dir, newest) -> PeerLost:
        said = " ".join(str(e).split())
        said = said.split("] ", 1)[-1].split(". ", 1)[0]  # gloo's `[file:line] Read error [addr]: reason`
        saved = (
            f"the newest checkpoint is {newest}"
            if newest is not None
            else "no checkpoint yet: it starts over"
        )
        return cls(
            f"another process of this run stopped ({said}; torchrun's summary names it); {saved}; "
            f"resume with: speedrun train --resume {run_dir}"
        )


def all_reduce_sum(t: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum a tensor over ranks in place (no-op on one process)."""
    if ctx.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t
