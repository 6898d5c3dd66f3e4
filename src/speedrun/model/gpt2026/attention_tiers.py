"""Attention over packed variable-length documents (`cu_seqlens`), by hardware tier, behind one call.

`varlen_attention(q, k, v, cu_seqlens, window, scale)` on packed (T, H, D): causal, inside each document
(cu_seqlens: int32 offsets 0 … T, padded with T), keys visible while `q - k < window` (0: no window).
Tiers: `fa3`, FlashAttention-3 varlen from the optional `kernels` package (#29 on), on CUDA, from the
local Hugging Face cache only (fetch it once: `python -c "from kernels import get_kernel;
get_kernel('kernels-community/flash-attn3', version=1)"`; else the next tier runs and a log line says
why); `flex`, a block mask from cu_seqlens (other GPUs, forward-only on CPU); `blocked`, SDPA over K/V
slices per query block (CPU: memory T·window, nanochat #825). Paired heads (#58) and key offsets (#49)
only change the tensors passed in."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from speedrun.errors import first_line
from speedrun.model import attention

TIERS = ("auto", "fa3", "flex", "blocked")
FA3_REPO, FA3_VERSION = "kernels-community/flash-attn3", 1
QUERY_BLOCK = 512  # query rows per SDPA call in the blocked tier

log = logging.getLogger(__name__)


def doc_ids_from_cu(cu_seqlens: Tensor, T: int) -> Tensor:
    """(T,) int32 document index of every position (zero-length padding documents take no positions)."""
    pos = torch.arange(T, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), pos, right=True).to(torch.int32)


def _visible(q_pos: Tensor, k_pos: Tensor, docs: Tensor, window: int) -> Tensor:
    allowed = (q_pos[:, None] >= k_pos[None, :]) & (docs[q_pos][:, None] == docs[k_pos][None, :])
    if window > 0:
        allowed &= q_pos[:, None] - k_pos[None, :] < window
    return allowed


def blocked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    window: int,
    scale: float | None,
    block: int = QUERY_BLOCK,
) -> Tensor:
    """SDPA per block of queries over the only keys it can see (memory ∝ T·window)."""
    T = q.size(0)
    docs = doc_ids_from_cu(cu_seqlens, T)
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    outs = []
    for a in range(0, T, block):
        b = min(T, a + block)
        lo = max(0, a - window + 1) if window > 0 else 0
        q_pos = torch.arange(a, b, device=q.device)
        mask = _visible(q_pos, torch.arange(lo, b, device=q.device), docs, window)
        outs.append(F.scaled_dot_product_attention(qh[:, a:b], kh[:, lo:b], vh[:, lo:b], mask, scale=scale))
    return torch.cat(outs, dim=1).transpose(0, 1)


def flex_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int, scale: float | None
) -> Tensor:
    """FlexAttention with the block mask of cu_seqlens' documents and the window (T divisible by 128)."""
    T = q.size(0)
    spec = attention.MaskSpec(
        doc_ids=doc_ids_from_cu(cu_seqlens, T)[None],
        window=torch.tensor(window, device=q.device) if window > 0 else None,
        max_window=max(0, window),
    )
    mask = attention.build_block_mask(spec, T, q.device)
    out = attention.flex_attend(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, scale
    )
    return out[0].transpose(0, 1)


_fa3: list = []  # [FA3's function or None], once resolved


def load_fa3():
    """FlashAttention-3's varlen function from the local kernel cache, or None (logged once).

    Resolved eagerly, the first time it is asked outside torch.compile: dynamo cannot trace the import
    (a compiled step would fail), so GPT2026 asks when it is built on a CUDA host; inside a compiled
    graph the answer is a constant."""
    if not _fa3:
        assert not torch.compiler.is_compiling(), "load_fa3() runs once before compile (GPT2026.__init__)"
        _fa3.append(_import_fa3())
    return _fa3[0]


def _import_fa3():
    try:
        import huggingface_hub.constants as hub
        from kernels import get_kernel
    except ImportError:
        log.warning("attention: FA3 unavailable ('kernels' is not installed); using the next tier")
        return None
    offline, hub.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE, True  # the cache only: nothing downloads at run time
    try:
        return get_kernel(FA3_REPO, version=FA3_VERSION).flash_attn_varlen_func
    except Exception as e:  # no cached build for this torch/CUDA/arch, or a broken one
        log.warning("attention: FA3 unavailable (%s); using the next tier", first_line(e, 160))
        return None
    finally:
        hub.HF_HUB_OFFLINE = offline


def fa3_varlen(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, window: int, scale: float | None, max_seqlen: int
) -> Tensor:
    fn = load_fa3()
    assert fn is not None, "choose_tier picks fa3 only when it loads"
    if q.size(-1) < v.size(-1):  # #344's narrower Q/K: zero dims add nothing to a score (FA3 wants equal)
        q, k = (F.pad(t, (0, v.size(-1) - t.size(-1))) for t in (q, k))
    out = fn(
        q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen, causal=True, softmax_scale=scale,
        window_size=(window - 1 if window > 0 else -1, 0),
    )  # fmt: skip
    return out[0] if isinstance(out, tuple) else out


def on_cuda(device: torch.device) -> bool:
    """The tiers' one device test (tests trace the CUDA branches on the CPU by replacing it)."""
    return device.type == "cuda"


def choose_tier(setting: str, device: torch.device, T: int) -> str:
    """auto: fa3 on CUDA when it loads, else flex on CUDA, else blocked. A named tier that cannot run
    here falls to the next one."""
    assert setting in TIERS, setting
    cuda = on_cuda(device)
    if setting in ("auto", "fa3") and cuda and load_fa3() is not None:
        return "fa3"
    if setting in ("auto", "fa3", "flex") and cuda and T % attention.BLOCK_SIZE == 0:
        return "flex"
    return "blocked"


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    window: int = 0,
    scale: float | None = None,
    max_seqlen: int | None = None,
    tier: str = "auto",
) -> Tensor:
    """Document-causal sliding-window attention on packed (T, H, D) tensors, by the fastest tier here.
    `max_seqlen` (FA3) bounds the longest document; the chunk length when not given."""
    T = q.size(0)
    chosen = choose_tier(tier, q.device, T)
    if chosen == "fa3":
        return fa3_varlen(q, k, v, cu_seqlens, window, scale, max_seqlen or T)
    if chosen == "flex":
        return flex_varlen(q, k, v, cu_seqlens, window, scale)
    return blocked_attention(q, k, v, cu_seqlens, window, scale)
