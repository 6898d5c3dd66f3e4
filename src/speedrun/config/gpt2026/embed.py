"""The token embeddings' storage and what joins them: #62's bigram hash table with #83's sign rows,
#34's smear gate (`[model.embed]`). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from speedrun.errors import ConfigError


@dataclass(frozen=True)
class EmbedConfig:
    dtype: Literal["fp32", "bf16"] = "bf16"
    pad: bool = True  # token/value embedding rows padded like the head
    smear: int = 0  # #34: input dims of the smear gate (12); 0 none
    bigram_rows: int = 0  # #62
    bigram_sign_rows: int = 0  # #83: rows of the ±1 sign table (8192); 0 none
    bigram_dim: int = 0  # #89's script: the rows are this wide, added to the stream's first dims; 0 = n_embd
    # #89's script adds layer 0's bigram share to x0 itself (in place, on the tensor x and x0 share): every
    # later x0 term and the skip gate read it; #82 adds it to x only
    bigram_in_x0: bool = False

    FLAT: ClassVar[dict[str, str]] = {"dtype": "embed_dtype", "pad": "pad_embeddings"}


def check(p: EmbedConfig, m: Any) -> None:
    if p.bigram_sign_rows and not p.bigram_rows:
        raise ConfigError("model.embed.bigram_sign_rows (#83) needs model.embed.bigram_rows")
    if p.bigram_dim and not (p.bigram_rows and 0 < p.bigram_dim <= m.n_embd):
        raise ConfigError(
            f"model.embed.bigram_dim {p.bigram_dim} needs model.embed.bigram_rows and is 1..model.n_embd"
        )
    if p.bigram_rows and not 2 <= p.bigram_rows <= 2**31:
        raise ConfigError("model.embed.bigram_rows (#62) must be 2..2^31 hash buckets")
    if p.smear > m.n_embd:
        raise ConfigError(
            f"model.embed.smear ({p.smear}) must not exceed model.n_embd ({m.n_embd}) input dims"
        )
