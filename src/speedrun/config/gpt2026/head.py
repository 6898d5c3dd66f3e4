"""The LM head and its loss: softcap, FP8 matmul, MTP, #88's prefix loss, #92's sampled softmax in
training, #350's validation mask and the head's init (`[model.head]`). Torch-free."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from speedrun.errors import ConfigError


@dataclass(frozen=True)
class HeadConfig:
    softcap: float = 15.0
    softcap_divisor: float = 0.0
    softcap_offset: float = 0.0  # #54
    softcap_in_bf16: bool = False
    ce_bf16: bool = False  # #37
    fp8: bool = True
    mtp: int = 0  # #53
    canonical_val_mask: bool = False  # #350: validation drops pairs GPT-2 never emits (a 316 MB buffer)
    # where the mask applies the cap runs in fp32 (#350: the logits cast first) or as the head's (#92)
    mask_cap: Literal["fp32", "head"] = "fp32"
    prefix_loss_weight: float = 0.0  # #88: weight of the prefix-token loss in training (0.25); 0 none
    # #92: the stride of the negatives' sweep k·stride mod V (20011); 0: no sampled softmax. The candidate
    # counts P come from the stage plan (train.stages sampled=P[,P...]); validation is the full softmax
    sampled_stride: int = 0
    zero_init: bool = True
    init_std: float = 0.0  # #51/#53

    FLAT: ClassVar[dict[str, str | None]] = {
        "mask_cap": None,
        "softcap": "logit_softcap",
        "fp8": "fp8_head",
        "zero_init": "zero_init_head",
        "init_std": "head_init_std",
    }


def check(p: HeadConfig, m: Any) -> None:
    if p.canonical_val_mask and p.softcap <= 0:
        raise ConfigError(
            "model.head.canonical_val_mask (#350) needs model.head.softcap > 0 (-60 lies below capped logits)"
        )
    if p.softcap_offset and p.softcap <= 0:
        raise ConfigError("model.head.softcap_offset needs model.head.softcap > 0")
    if p.sampled_stride:
        vocab = -(-m.vocab_size // m.pad_vocab_to) * m.pad_vocab_to  # the head's rows (model/vocab.py)
        if p.softcap <= 0:
            raise ConfigError(
                "model.head.sampled_stride (#92) needs model.head.softcap > 0: its fixed-max LSE takes the "
                "cap's bound as the max"
            )
        if math.gcd(p.sampled_stride, vocab) != 1:
            raise ConfigError(
                f"model.head.sampled_stride ({p.sampled_stride}) must be coprime with the head's {vocab} "
                "rows, so k·stride mod V visits every class (#92: 20011)"
            )
    if p.init_std > 0 and p.zero_init:
        raise ConfigError("model.head.init_std > 0 needs model.head.zero_init=false")
