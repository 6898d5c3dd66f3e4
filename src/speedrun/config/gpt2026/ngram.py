"""#92's hashed n-gram table (`[model.ngram]`, record #92 ANVIL2, 2026-08-30, PR #360). Torch-free.

One table of `rows` rows: the first half holds a bigram channel (hash of the previous and current
token), the second half a trigram channel (hash of the two previous tokens and the current one); each
looked-up row is multiplied by a ±1 row of a shared `sign_rows` pool chosen by an independent hash, and
the two signed rows are summed into the one input that #62's bigram rows fed (the layers' bigram shares
or #85's bigram gates scale it). The record: 84,602,880 rows × 768, sign pool 8,192, zero init, bf16,
sharded by rows over the processes, trained by a row-compacted Adam (β1 = 0, one second moment per row,
LR ×70, decay ×5). model/gpt2026/ngram.py is the part; optim/row_adam.py and optim/row_shard.py train it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from speedrun.errors import ConfigError

#: #92's table Adam (track_1_short/ngram_table.py): LR and decay multipliers on the embedding's Adam, betas
LR_MUL, WD_MUL, BETAS = 70.0, 5.0, (0.0, 0.95)
#: bytes of optimizer state per row of the compacted Adam at β1 = 0: one fp32 second moment and the int32
#: step it is current to (optim/row_adam.py)
STATE_BYTES_PER_ROW = 4 + 4


@dataclass(frozen=True)
class NgramConfig:
    rows: int = 0  # table rows, both channels (#92: 84,602,880); 0: no n-gram table
    sign_rows: int = 8192  # the shared ±1 sign pool (a power of two)
    dim: int = 0  # row width, added to the stream's first dims; 0 = n_embd (#92: 768)
    dtype: Literal["fp32", "bf16"] = "bf16"  # the table's storage (#92: bf16)

    FLAT: ClassVar[dict[str, str | None]] = {"rows": None, "sign_rows": None, "dim": None, "dtype": None}


def row_bytes(p: NgramConfig, n_embd: int) -> int:
    """Bytes per table row held by its owner: the row and its optimizer state."""
    return (p.dim or n_embd) * (2 if p.dtype == "bf16" else 4) + STATE_BYTES_PER_ROW


def label_rows(adam: Any, embed_lr: float, wd: float) -> dict[str, Any]:
    """The row of the table's label: `adam(group, lr, betas, wd)` makes one (#92: the embedding's Adam
    LR ×70, β1 = 0, decay ×5)."""
    return {"ngram": adam("ngram", embed_lr * LR_MUL, BETAS, wd * WD_MUL)}


def check(p: NgramConfig, m: Any) -> None:
    if not p.rows:
        return
    if p.rows < 4 or p.rows % 2 or p.rows >= 2**31:
        raise ConfigError(
            f"model.ngram.rows {p.rows:,}: even, 4 up to below 2^31 (half bigram, half trigram rows)"
        )
    if p.sign_rows < 1 or p.sign_rows & (p.sign_rows - 1):
        raise ConfigError(f"model.ngram.sign_rows {p.sign_rows}: a power of two (#92: 8192)")
    if not 0 <= p.dim <= m.n_embd:
        raise ConfigError(f"model.ngram.dim {p.dim} must be 0 (= model.n_embd) .. model.n_embd ({m.n_embd})")
    if m.embed.bigram_rows:
        raise ConfigError(
            "model.ngram.rows and model.embed.bigram_rows both feed the bigram input: set one (#92 replaced "
            "#62's table by the n-gram table)"
        )
