"""The record code's own per-GPU step times (anchors.toml, the one table of them) and how `bench` sets
its figures beside them: time per token, ours over the record's, on the same stage."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

TABLE = Path(__file__).with_name("anchors.toml")


@dataclass(frozen=True)
class Anchor:
    recipe: str
    stage: int  # 1-based stage of train.stages; 0: a recipe without stages
    gpu: str  # the GPU the figure is for, as it appears in torch.cuda.get_device_name ("H100")
    ms: float  # one GPU's milliseconds per optimizer step of `tokens` tokens
    tokens: int
    source: str
    bound: bool = False  # an upper bound (an 8-GPU step x 8), not a one-GPU measurement
    peak_mib: int | None = None  # the record's peak allocated memory (whole run, MiB), where published

    def ratio(self, step_ms: float, tokens: int) -> float:
        """Our time per token over the record's (below 1: faster than the record)."""
        return (step_ms / tokens) / (self.ms / self.tokens)

    def describe(self, device: str) -> str:
        """The figure with where it comes from, and whether it is like for like with `device`."""
        alike = "" if self.gpu.lower() in device.lower() else f"; this is {device}, not like for like"
        bound = "<= " if self.bound else ""
        return f"{bound}{self.ms:,.1f} ms per {self.tokens:,} tokens on one {self.gpu} ({self.source}{alike})"


def load_anchors(path: Path = TABLE) -> list[Anchor]:
    """Every row of the table (a file we ship: a bad row is a programmer error, not a user's)."""
    with open(path, "rb") as f:
        return [Anchor(**row) for row in tomllib.load(f)["anchor"]]


def find_anchor(anchors: list[Anchor], recipe: str, stage: int) -> Anchor | None:
    """The row for `recipe`'s `stage` (0: unstaged), if the record published one."""
    return next((a for a in anchors if a.recipe == recipe and a.stage == stage), None)
