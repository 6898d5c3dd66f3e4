"""CUDA costs found by simulating the GPU path on CPU: one rotary table per model, same-dtype Muon
updates (CUDA's fused multi-tensor path), the allocator setting and the process-group timeout."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from speedrun.config import TrainConfig
from speedrun.model.families import build_model
from speedrun.optim import Muon
from speedrun.recipes import load_recipe
from speedrun.train.distributed import cuda_allocator_settings
from tests.recipe_matrix import shrunk


def test_attention_layers_share_one_rotary_table():
    cfg = shrunk("record-2025-01", n_layer=4)
    model = build_model(cfg.model)
    tables = {id(b.attn.rotary.cos) for b in model.blocks if b.attn is not None}
    assert len(tables) == 1 and sum(b.attn is not None for b in model.blocks) == 3
    assert not any("rotary" in k for k in model.state_dict())  # checkpoints unchanged: not persistent
    rebuilt = build_model(cfg.model)  # each layer building its own table gives the same values
    from speedrun.model.gpt2024.model import make_rotary

    torch.testing.assert_close(rebuilt.blocks[0].attn.rotary.cos, make_rotary(cfg.model).cos, rtol=0, atol=0)


class _ForeachDtypes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[set[torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func.overloadpacket.__name__ == "_foreach_add_":
            self.calls.append({t.dtype for a in args if isinstance(a, list) for t in a})
        return func(*args, **(kwargs or {}))


def test_muon_adds_bf16_updates_to_fp32_weights_with_same_dtype_lists():
    """On CUDA a multi-tensor op over mixed dtypes runs one kernel per tensor; the bf16 update is cast
    once (exactly) to fp32 first. Values: w - lr·scale·float(update), computed here from NS itself."""
    gen = torch.Generator().manual_seed(0)
    ws = [torch.nn.Parameter(torch.randn(32, 16, generator=gen)) for _ in range(3)]
    grads = [torch.randn(32, 16, generator=gen) for _ in range(3)]
    before = [w.detach().clone() for w in ws]
    for w, g in zip(ws, grads, strict=True):
        w.grad = g.clone()
    muon = Muon(  # bf16 iterations pinned: "auto" takes fp32 on a CPU without fast bf16 (AVX2)
        ws, lr=0.1, momentum=0.0, nesterov=False, shape_scale="ratio", ns_dtype=torch.bfloat16
    )
    spy = _ForeachDtypes()
    with spy:
        muon.step()
    assert spy.calls and all(len(d) == 1 for d in spy.calls), spy.calls
    from speedrun.optim.orthogonalize import orthogonalize

    scale = max(1.0, 32 / 16) ** 0.5
    for w, w0, g in zip(ws, before, grads, strict=True):
        update = orthogonalize(g[None], "newton_schulz", 5)[0]
        assert update.dtype == torch.bfloat16
        torch.testing.assert_close(w.detach(), w0 - 0.1 * scale * update.float(), rtol=0, atol=1e-6)


def test_expandable_segments_unless_the_user_chose_an_allocator_setting():
    env: dict[str, str] = {}
    cuda_allocator_settings(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    cuda_allocator_settings(mine)
    assert mine == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}


def test_process_group_timeout_outlasts_a_full_size_checkpoint_write():
    """Rank 0 alone writes weights + optimizer state of the largest recipe while the others wait at a
    barrier; at 25 MB/s (a slow network disk) the default must still cover it."""
    cfg = load_recipe("record-2025-01")
    with torch.device("meta"):
        n = sum(p.numel() for p in build_model(cfg.model).parameters())
    checkpoint_bytes = n * 4 * 3  # fp32 weights + Adam's two moments (an upper bound for Muon's one)
    assert checkpoint_bytes > 3e9
    assert TrainConfig().dist_timeout_s >= checkpoint_bytes / 25e6
    assert load_recipe("record-2025-01", ["train.dist_timeout_s=60"]).train.dist_timeout_s == 60
