"""Muon across 2 gloo processes on CPU equals Muon in one process, and its state round-trips.

The matrix counts per shape (5, 2, 1, 8): 5 is not divisible by 2 (padding) and rank 1 owns no
(24, 16) matrix at all (an empty share). The two ranks run in tests/two_processes.py's one torchrun
launch: first in a group passed explicitly, then in the default group, which Muon finds by itself.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from speedrun.optim import Muon, set_muon_split
from tests.two_processes import SHARED

STEPS_BEFORE_SAVE, STEPS_AFTER_LOAD = 3, 2


def _model() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(32, 16)] * 5 + [(16, 48)] * 2 + [(24, 16)] + [(48, 16), (5, 16, 16)]
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen)) for s in shapes]
    set_muon_split(params[8], 3)  # three (16, 16) blocks, plus the five of the stack: 8 in all
    return params


def _optimizer(params: list[torch.nn.Parameter], group: dist.ProcessGroup | None = None) -> Muon:
    groups = [
        {"params": params[:8]},
        {"params": params[8:], "backend": "polar_express", "shape_scale": "max_dim", "lr": 0.01},
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


def on_two_ranks(rank: int, folder: Path) -> None:
    """Run by tests/library_checks.py on each of 2 ranks: train in an explicitly passed group, then in the
    default group; each rank saves (params at save, state, final params) of both into `folder`."""
    explicit = dist.new_group([0, 1])
    for name, group in (("explicit", explicit), ("default", None)):
        result = _train(str(folder / f"muon-{name}-state.pt"), group)
        torch.save(result, folder / f"muon-{name}-rank{rank}.pt")
        dist.barrier()  # no rank leaves while a peer's last all-gather may still be draining


@pytest.mark.slow
@SHARED
@pytest.mark.parametrize("group", ["explicit", "default"])
def test_distributed_matches_single_process_and_state_round_trips(group: str, library_results) -> None:
    expected_saved, expected_state, expected_final = _train()
    folder = Path(library_results["folder"])
    results = [torch.load(folder / f"muon-{group}-rank{rank}.pt") for rank in range(2)]
    for saved, state, final in results:
        for got, want in zip(saved + final, expected_saved + expected_final, strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        # replicated state: every rank holds the whole single-process state
        assert state["state"].keys() == expected_state["state"].keys()
        for key, entry in state["state"].items():
            want = expected_state["state"][key]["momentum_buffer"]
            torch.testing.assert_close(entry["momentum_buffer"], want, atol=1e-6, rtol=0)
