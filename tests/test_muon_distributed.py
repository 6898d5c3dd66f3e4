"""Muon across 2 and 3 gloo processes on CPU equals Muon in one process, and its state round-trips.

The matrix counts per shape (5, 2, 8) are not divisible by 2 or 3, and with 3 ranks one rank owns
no (16, 48) block at all, so padding and empty shares are exercised.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from speedrun.optim import Muon, set_muon_split

STEPS_BEFORE_SAVE, STEPS_AFTER_LOAD = 3, 2


def _model() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(32, 16)] * 5 + [(16, 48)] * 2 + [(48, 16), (5, 16, 16)]
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]
    set_muon_split(params[7], 3)  # three (16, 16) blocks, plus the five of the stack: 8 in all
    return params


def _optimizer(params: list[torch.nn.Parameter], group: dist.ProcessGroup | None = None) -> Muon:
    groups = [
        {"params": params[:7]},
        {"params": params[7:], "backend": "polar_express", "shape_scale": "max_dim", "lr": 0.01},
    ]
    return Muon(groups, lr=0.02, weight_decay=0.1, cautious_weight_decay=True, process_group=group)


def _step(opt: Muon, params: list[torch.nn.Parameter], step: int) -> None:
    """Same (already "averaged") gradients on every rank, as the caller's all-reduce would leave them."""
    gen = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.param_groups[0]["momentum"] = 0.85 + 0.03 * step
    opt.step()


def _train(
    state_path: str | None = None, group: dist.ProcessGroup | None = None
) -> tuple[list[torch.Tensor], dict, list[torch.Tensor]]:
    """Steps, save, reload into a fresh optimizer, more steps. Returns (params at save, state, final)."""
    params = _model()
    opt = _optimizer(params, group)
    for step in range(STEPS_BEFORE_SAVE):
        _step(opt, params, step)
    saved_params = [p.detach().clone() for p in params]
    state = opt.state_dict()
    if state_path is not None:  # distributed: every rank loads rank 0's file
        if dist.get_rank() == 0:
            torch.save(state, state_path + ".tmp")
            os.replace(state_path + ".tmp", state_path)
        dist.barrier(group)
        loaded = torch.load(state_path)
    else:
        loaded = state
    opt = _optimizer(params, group)
    opt.load_state_dict(loaded)
    for step in range(STEPS_BEFORE_SAVE, STEPS_BEFORE_SAVE + STEPS_AFTER_LOAD):
        _step(opt, params, step)
    return saved_params, state, [p.detach().clone() for p in params]


def _worker(rank: int, folder: str) -> None:
    """Three processes: ranks 0 and 1 train in a group of their own, passed explicitly; then all three
    train in the default group, which Muon finds by itself. One spawn pays the imports once."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=3)
    try:
        pair = dist.new_group([0, 1])  # every rank must take part in creating it
        if rank < 2:
            torch.save(_train(f"{folder}/state2.pt", pair), f"{folder}/world2-rank{rank}.pt")
        torch.save(_train(f"{folder}/state3.pt", None), f"{folder}/world3-rank{rank}.pt")
        dist.barrier()  # no rank leaves while a peer's last all-gather may still be draining
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def distributed_results() -> dict[int, list]:
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_worker, args=(folder,), nprocs=3, join=True)
        return {w: [torch.load(f"{folder}/world{w}-rank{r}.pt") for r in range(w)] for w in (2, 3)}


@pytest.mark.slow
@pytest.mark.xdist_group("muon_spawn")  # one pytest-xdist worker runs both: one spawn
@pytest.mark.parametrize("world", [2, 3])
def test_distributed_matches_single_process_and_state_round_trips(world: int, distributed_results) -> None:
    expected_saved, expected_state, expected_final = _train()
    results = distributed_results[world]
    assert len(results) == world
    for saved, state, final in results:
        for got, want in zip(saved + final, expected_saved + expected_final, strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        # replicated state: every rank holds the whole single-process state
        assert state["state"].keys() == expected_state["state"].keys()
        for key, entry in state["state"].items():
            want = expected_state["state"][key]["momentum_buffer"]
            torch.testing.assert_close(entry["momentum_buffer"], want, atol=1e-6, rtol=0)
