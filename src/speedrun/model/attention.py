"""Attention masks and backends behind one call, `attend(q, k, v, mask, scale)`.

One mask definition, `mask_rule`: a key is visible when it is not in the future, lies in the query's
document (one starts at each end-of-text token) and is less than `window` tokens back. It feeds every
backend: FlexAttention on CUDA (a hand-built 128-token `BlockMask`, as 2024-12-08, with a 0-d window
tensor so a growing window reuses compiled code); dense SDPA with its boolean mask on CPU and wherever
flex cannot run (query chunks above `DENSE_CHUNK`, never a T×T mask; per document on CPU); and
`is_causal` SDPA when nothing beyond causal is needed."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask

from speedrun.config.types import BLOCK_SIZE
from speedrun.model.flex import _on_cuda, flex_attend  # its own binding here: tests patch each

DENSE_CHUNK = 1024  # query rows per dense SDPA call when the sequence is longer than this


def document_ids(tokens: Tensor, eot_id: int) -> Tensor:
    """(B, T) int32 document index of every position of (B, T) `tokens`: a new document starts at each
    end-of-text token (a leading partial document is document 0 as well)."""
    return (tokens == eot_id).cumsum(dim=-1, dtype=torch.int32)


def mask_rule(
    q_idx: Tensor,
    kv_idx: Tensor,
    doc_q: Tensor | None,
    doc_kv: Tensor | None,
    window: Tensor | int | None,
    block_window: bool = False,
    block_list: bool = False,
) -> Tensor:
    """The one mask definition (FlexAttention's mask_mod and the dense mask builder; arguments broadcast):
    causal, same document (with doc ids) and `q_idx - kv_idx < window`, or with `block_window` (Sub3Min)
    the distance between their 128-token blocks below `window`. `block_list` (2024-12-08) also skips key
    blocks with `q_block - kv_block >= ceil(window / 128)`, as the record's block listing does."""
    allowed, bs = q_idx >= kv_idx, BLOCK_SIZE
    if doc_q is not None:
        allowed = allowed & (doc_q == doc_kv)
    if window is not None:
        if block_window:
            distance = (q_idx // bs - kv_idx // bs) * bs
        else:
            distance = q_idx - kv_idx
        allowed = allowed & (distance < window)
        if block_list:
            allowed = allowed & (q_idx // bs - kv_idx // bs < (window + bs - 1) // bs)
    return allowed


@dataclass(frozen=True)
class MaskSpec:
    """What attention must respect beyond causality, for every backend: `doc_ids` (B, T) or None, `window`
    a 0-d tensor (changes every step without recompiling) or None, `max_window` a Python bound on it
    (0 = unknown) that lets the dense path skip keys without reading the tensor."""

    doc_ids: Tensor | None = None
    window: Tensor | None = None
    block_window: bool = False
    max_window: int = 0
    block_list: bool = False


#: What a layer receives: None (plain causal), a dense boolean mask, a MaskSpec or a BlockMask.
AttentionMask = Tensor | MaskSpec | BlockMask | None


def spec_dense_mask(
    spec: MaskSpec, q_start: int, q_end: int, k_start: int, k_end: int, device: torch.device | str | None
) -> Tensor:
    """Boolean (B or 1, 1, q_end-q_start, k_end-k_start) mask for query rows × key columns of `spec`."""
    q_idx = torch.arange(q_start, q_end, device=device)[:, None]
    kv_idx = torch.arange(k_start, k_end, device=device)[None, :]
    doc_q = doc_kv = None
    if spec.doc_ids is not None:
        doc_q, doc_kv = spec.doc_ids[:, q_start:q_end, None], spec.doc_ids[:, None, k_start:k_end]
    allowed = mask_rule(q_idx, kv_idx, doc_q, doc_kv, spec.window, spec.block_window, spec.block_list)
    return (allowed if allowed.dim() == 3 else allowed[None])[:, None]


def _dense_attend(q: Tensor, k: Tensor, v: Tensor, spec: MaskSpec, scale: float | None) -> Tensor:
    """SDPA with `spec`'s mask: per document when eager on CPU with document ids (no work on pairs across
    documents), else (CUDA, or compiling: static shapes) in query chunks over the whole row."""
    if spec.doc_ids is not None and not q.is_cuda and not torch.compiler.is_compiling():
        return _per_document(q, k, v, spec, scale)  # data-dependent splits: eager only
    return _chunked(q, k, v, spec, scale, 0)


def _chunked(q: Tensor, k: Tensor, v: Tensor, spec: MaskSpec, scale: float | None, offset: int) -> Tensor:
    """Masked SDPA over positions offset..offset+len of a row (nothing before `offset` visible), in query
    chunks of DENSE_CHUNK rows, each with the keys back to `max_window` (plus a block for block windows)
    or, without a bound, all earlier keys: memory chunk × T, never T × T."""
    n = q.size(-2)
    if n <= DENSE_CHUNK:
        mask = spec_dense_mask(spec, offset, offset + n, offset, offset + n, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    lookback = spec.max_window if spec.window is not None and spec.max_window > 0 else None
    if lookback is not None and spec.block_window:
        lookback += BLOCK_SIZE  # a block window reaches back to the start of the oldest block
    outs = []
    for a, qc in zip(range(0, n, DENSE_CHUNK), q.split(DENSE_CHUNK, dim=-2), strict=True):
        b = a + qc.size(-2)
        lo = 0 if lookback is None else max(0, a - lookback)
        mask = spec_dense_mask(spec, offset + a, offset + b, offset + lo, offset + b, q.device)
        outs.append(
            F.scaled_dot_product_attention(qc, k[..., lo:b, :], v[..., lo:b, :], attn_mask=mask, scale=scale)
        )
    return torch.cat(outs, dim=-2)


def _window_bites(spec: MaskSpec, start: int, end: int) -> bool:
    """Whether the window hides any causal pair inside positions start..end (reads the window value)."""
    if spec.window is None:
        return False
    w, bs = int(spec.window), BLOCK_SIZE
    blocks = (end - 1) // bs - start // bs
    if spec.block_window:
        return blocks * bs >= w
    return end - start > w or (spec.block_list and blocks >= (w + bs - 1) // bs)


def _per_document(q: Tensor, k: Tensor, v: Tensor, spec: MaskSpec, scale: float | None) -> Tensor:
    """Attention row by row, document by document (CPU): causal SDPA where the window does not cut, else
    masked; cost ∝ Σ len². Splits the inputs, so the backward concatenates gradients once."""
    T, rows = q.size(-2), []
    for r, (qr, kr, vr) in enumerate(zip(q.split(1), k.split(1), v.split(1), strict=True)):
        ids = spec.doc_ids[r]
        bounds = [0, *(torch.nonzero(ids[1:] != ids[:-1]).flatten() + 1).tolist(), T]
        lengths = [e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
        row = dataclasses.replace(spec, doc_ids=spec.doc_ids[r : r + 1])
        outs = []
        splits = (qr.split(lengths, -2), kr.split(lengths, -2), vr.split(lengths, -2))
        for s, qs, ks, vs in zip(bounds[:-1], *splits, strict=True):
            e = s + qs.size(-2)
            if e - s <= DENSE_CHUNK and not _window_bites(row, s, e):
                outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale))
            else:
                outs.append(_chunked(qs, ks, vs, row, scale, s))
        rows.append(torch.cat(outs, dim=-2))
    return torch.cat(rows, dim=0)


# ---------------------------------------------------------------------------------------------------
# FlexAttention block masks


def _dense_blocks_to_lists(blocks: Tensor) -> tuple[Tensor, Tensor]:
    """(B, nq, nk) booleans → (B, 1, nq) counts and (B, 1, nq, nk) kv-block indices, listed ones first."""
    counts = blocks.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[:, None].contiguous(), order[:, None].contiguous()


def block_structure(
    spec: MaskSpec, seq_len: int, device: torch.device | None = None
) -> tuple[Tensor, Tensor]:
    """Which (query block, key block) pairs FlexAttention must visit for `spec`: (partial, full), each
    (B, nq, nk), from each block's first and last document id (ids never decrease), the block distance and
    the window tensor: O((T/128)²) work, no T×T mask. In full blocks the kernel skips the mask_mod."""
    doc_ids, window, bs = spec.doc_ids, spec.window, BLOCK_SIZE
    nb = seq_len // bs
    device = doc_ids.device if doc_ids is not None else device
    blk = torch.arange(nb, device=device, dtype=torch.int32)
    dist = blk[:, None] - blk[None, :]  # query block - key block
    any_ok, all_ok = dist >= 0, dist > 0
    if doc_ids is not None:
        low, high = doc_ids[:, ::bs], doc_ids[:, bs - 1 :: bs]
        overlap = (low[:, :, None] <= high[:, None, :]) & (low[:, None, :] <= high[:, :, None])
        single = (low == high)[:, :, None] & (low == high)[:, None, :] & (low[:, :, None] == low[:, None, :])
        any_ok, all_ok = any_ok & overlap, all_ok & single
    if window is not None:
        if spec.block_window:
            inside = dist * bs < window
            any_ok, all_ok = any_ok & inside, all_ok & inside
        else:  # nearest pair: q at its block start, kv at its block end; farthest pair: the reverse
            any_ok = any_ok & (dist * bs - (bs - 1) < window)
            all_ok = all_ok & (dist * bs + (bs - 1) < window)
            if spec.block_list:  # 12-08: blocks beyond ceil(window / block) are never visited
                listed = dist < (window + bs - 1) // bs
                any_ok, all_ok = any_ok & listed, all_ok & listed
    if any_ok.dim() == 2:
        any_ok, all_ok = any_ok[None], all_ok[None]
    return any_ok & ~all_ok, all_ok


def build_block_mask(spec: MaskSpec, seq_len: int, device: torch.device | None = None) -> BlockMask:
    """FlexAttention BlockMask for `spec` over a (B, T) sequence; T must be a multiple of the block size."""
    assert seq_len % BLOCK_SIZE == 0, "flex_usable() decides"
    partial, full = block_structure(spec, seq_len, device)
    where = spec.doc_ids.device if spec.doc_ids is not None else device
    assert spec.window is None or where is None or spec.window.device.type == torch.device(where).type, (
        "the window tensor must live on the attention's device: a CPU scalar captured by a CUDA mask_mod "
        "fails in Triton ('Unsupported ptr type int32')"
    )
    kv_num, kv_idx = _dense_blocks_to_lists(partial)
    full_num, full_idx = _dense_blocks_to_lists(full)
    docs, window = spec.doc_ids, spec.window

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        doc_q = docs[b, q_idx] if docs is not None else None
        doc_kv = docs[b, kv_idx] if docs is not None else None
        return mask_rule(q_idx, kv_idx, doc_q, doc_kv, window, spec.block_window, spec.block_list)

    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE, mask_mod, seq_lengths=(seq_len, seq_len)
    )


# ---------------------------------------------------------------------------------------------------
# Backend choice and the one attention call


def flex_usable(device: torch.device, seq_len: int, needs_grad: bool) -> bool:
    """FlexAttention runs compiled on CUDA; on CPU without gradients (no eager CPU backward kernel), or
    inside a torch.compile trace, whose backend (aot_eager, inductor) provides the backward."""
    if seq_len % BLOCK_SIZE:
        return False
    return device.type == "cuda" or not needs_grad or torch.compiler.is_compiling()


def choose_backend(
    setting: str, device: torch.device, seq_len: int, needs_mask: bool, needs_grad: bool
) -> str:
    """'flex', 'dense' (SDPA with a boolean mask) or 'causal' (SDPA is_causal) for one forward. auto: flex on
    CUDA when a mask is needed; sdpa: never flex; flex: wherever it can run, dense elsewhere."""
    if not needs_mask:
        return "causal"
    if setting == "sdpa":
        return "dense"
    if setting in ("auto", "varlen") and device.type != "cuda":  # varlen: forwards without cu_seqlens
        return "dense"
    return "flex" if flex_usable(device, seq_len, needs_grad) else "dense"


SDPA_KERNELS = dict(
    cudnn="CUDNN_ATTENTION", flash="FLASH_ATTENTION", efficient="EFFICIENT_ATTENTION", math="MATH"
)


def sdpa_context(kernel: str, q: Tensor) -> contextlib.AbstractContextManager:
    """The SDPA backend a recipe forces (11-03 … 11-24: cuDNN only), applied on CUDA; a no-op for "auto"
    and on CPU, where only the math and CPU-flash kernels exist."""
    if kernel == "auto" or not _on_cuda(q):
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend

    return sdpa_kernel([getattr(SDPBackend, SDPA_KERNELS[kernel])])


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | MaskSpec | BlockMask | None = None,
    scale: float | None = None,
    kernel: str = "auto",
) -> Tensor:
    """Causal attention on (B, H, T, D); `mask`: None (plain causal), a dense boolean mask, a MaskSpec
    (dense SDPA, chunked) or a BlockMask; `kernel` (SDPA_KERNELS or "auto") forces the CUDA SDPA backend."""
    if isinstance(mask, BlockMask):
        return flex_attend(q, k, v, mask, scale)
    with sdpa_context(kernel, q):
        if isinstance(mask, MaskSpec):
            return _dense_attend(q, k, v, mask, scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)


def short_window(window: Tensor, block_window: bool) -> Tensor:
    """The "short" window of a long/short layer pattern: half the long one (Sub3Min: half the blocks,
    at least one block), computed on the tensor so the schedule never leaves the device."""
    if block_window:
        return torch.clamp_min(window // BLOCK_SIZE // 2, 1) * BLOCK_SIZE
    return torch.clamp_min(window // 2, 1)
