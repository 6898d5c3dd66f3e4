"""How the records' training loops drive YaRN, written once: each time the long window changes, the loop
calls `apply_yarn(old, new)` on the rotary tables and multiplies the attention scale by 0.2·ln(new/old) + 1
(#31 on). The tables themselves are #31's `RecordYarn` (fidelity/test_yarn_recipe.py)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence


def windows_passed(first: int, long_window_at: Callable[[int], int], last_step: int) -> list[int]:
    """The long windows a loop has passed to YaRN by `last_step`: the first, then each change in turn."""
    seen = [first]
    for s in range(last_step + 1):
        if long_window_at(s) != seen[-1]:
            seen.append(long_window_at(s))
    return seen


def yarn_through(yarn, windows: Sequence[int], scale: float = 0.1) -> float:
    """Apply each change of `windows` to `yarn` (a RecordYarn) as a loop does; the attention scale after."""
    for old, new in zip(windows[:-1], windows[1:], strict=True):
        yarn.apply_yarn(old, new)
        scale *= 0.2 * math.log(new / old) + 1
    return scale
