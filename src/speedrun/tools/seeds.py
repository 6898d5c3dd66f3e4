"""The seeds a research command runs: `--seeds 1,2,3` (those) or `--seeds N` (1..N)."""

from __future__ import annotations

from speedrun.errors import ConfigError

#: The most seeds one command plans (docs/research.md): far beyond any study on one machine, and small
#: enough that a typo of a few more digits is refused before any memory is spent.
MOST_SEEDS = 1000


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--seeds {text!r}: expected comma-separated integers, e.g. 1,2,3") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds {text!r}: expected distinct comma-separated integers, e.g. 1,2,3")
    if len(seeds) > MOST_SEEDS:
        raise ConfigError(f"--seeds: {len(seeds):,} seeds; at most {MOST_SEEDS:,}")
    return seeds


def parse_seed_count(text: str) -> list[int]:
    """`N` is the seeds 1..N; `S1,S2,...` is those seeds (train --seeds' parser)."""
    if "," in text:
        return parse_seeds(text)
    try:
        n = int(text)
    except ValueError:
        raise ConfigError(
            f"--seeds {text!r}: expected a count N or seeds S1,S2,..., e.g. 3 or 1,2,3"
        ) from None
    if not 1 <= n <= MOST_SEEDS:
        raise ConfigError(f"--seeds {text!r}: expected a count in 1..{MOST_SEEDS:,}")
    return list(range(1, n + 1))
