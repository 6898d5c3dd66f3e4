"""Calling FlexAttention: inside a compiled graph as itself, eagerly through one compiled wrapper (static
shapes; past dynamo's recompile limit it raises), never as eager flex_attention on CUDA, which
materializes every T × T score."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention


def _on_cuda(t: Tensor) -> bool:
    return t.is_cuda


#: torch's warning on eager flex_attention (it materializes the scores: what the CPU forward means to do)
EAGER_FLEX_WARNING = "flex_attention called without torch.compile"
FLEX_WRAPPER_BACKEND = "inductor"  # of the compiled wrapper for eager callers (tests: "eager")


@functools.cache
def _compiled_flex(backend: str) -> Callable[..., Tensor]:
    return torch.compile(flex_attention, backend=backend, dynamic=False, fullgraph=True)


def flex_attend(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask, scale: float | None = None) -> Tensor:
    """FlexAttention on (B, H, T, D): flex_attention itself while compiling, the compiled wrapper when
    eager on CUDA, eager flex_attention on CPU (forward only)."""
    compiling = torch.compiler.is_compiling()
    if compiling and not q.is_cuda and q.requires_grad:
        return _traced_cpu_flex(q, k, v, block_mask, scale)
    if compiling:
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale)
    if not _on_cuda(q):
        with warnings.catch_warnings():  # eager on CPU on purpose: torch's 9-line advice to compile is noise
            warnings.filterwarnings("ignore", EAGER_FLEX_WARNING, UserWarning)
            return flex_attention(q, k, v, block_mask=block_mask, scale=scale)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        return _compiled_flex(FLEX_WRAPPER_BACKEND)(q, k, v, block_mask=block_mask, scale=scale)


def _traced_cpu_flex(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask, scale: float | None) -> Tensor:
    """FlexAttention with gradients on CPU inside a torch.compile trace (the tests' stand-in for CUDA):
    its higher-order op, traced by aot_eager, trains through the reference implementation (private API)."""
    from torch._higher_order_ops.flex_attention import flex_attention as flex_hop
    from torch.nn.attention.flex_attention import _apply_kernel_options, _identity

    options = _apply_kernel_options(q, k, v, False, None, None)
    scale = scale if scale is not None else q.size(-1) ** -0.5
    return flex_hop(q, k, v, _identity, block_mask.as_tuple(), scale, options)[0]
