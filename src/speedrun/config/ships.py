"""#92's terminal ships (`[optim.ships]`, record #92 ANVIL2, PR #360; track_1_short/tail_average.py of its
refactor, PR #373). Torch-free. optim/ships.py is the part.

After every optimizer step, fp32 accumulators follow the weights over the last steps of the run; after the
last step, inside the timed region, each is "shipped" into its weights, and the final validation (the only
one: `train.val_every = 0`) evaluates the shipped weights. Each ship is switched on by its window (the
steps before the end it follows; 0 = off). The weights are named by the record's banks, found by label:
qk (the Q and K blocks of `qkv`), vo (the V block of `qkv` and `attn_out`), mlp (`mlp_in`, `mlp_out`),
embed, head, value_embed.

- tail EMA on embed, head: ticks for s ≥ N − W, odd s at 1 − (1 − r)² with r = 2/(W + 1), an even s only
  at N − W (it seeds), the last step at r; shipped as lerp(w, ema, blend).
- tail average on vo, mlp: ticks for s ≥ N − W with (N − 1 − s) % every = 0, at `rate`; replaces them.
- value-embedding ship on value_embed: ticks for s ≥ N − W where the label's Adam stepped, at `rate`;
  replaces them.
- bank tail-blend on qk, vo, mlp: ticks for s ≥ N − W with s % every = 1 or s ≥ N − 2, at
  2/(W // every + 1); shipped as lerp(w, ema, b).
- decontraction of embed, head, mlp, qk, vo: each bank × ‖before the ships‖ / ‖after‖.

Step s of N counts from 0; W is the ship's window. The first tick of an accumulator copies the weights
(seeds it); later ones lerp towards them. Ship order: tail EMA, tail average, value embeddings, bank
blend (on vo and mlp it blends into the tail average), then decontraction. b = `bank_blend` on qk;
`bank_blend − bank_blend_richardson` on vo and mlp (the record's Richardson correction of the EMA's lag:
(1 − B)·A + B·X + w·(A − X) = lerp(A, X, B − w)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from speedrun.config.types import Fraction, Range
from speedrun.errors import ConfigError

Window = Annotated[int, Range(0)]
Every = Annotated[int, Range(1)]


@dataclass(frozen=True)
class ShipsConfig:
    # tail EMA (#92: window 298, blend 0.65) on embed and head
    tail_ema_window: Window = 0
    tail_ema_blend: Fraction = 0.65
    # tail average (#92: window 250, every 4th step from the end, rate 4/53 ≈ 0.0755) on vo and mlp
    tail_avg_window: Window = 0
    tail_avg_every: Every = 4
    tail_avg_rate: Fraction = 4.0 / 53.0
    # the value-embedding ship (#92: window 250, rate 4/53) on value_embed, at its Adam steps
    value_embed_window: Window = 0
    value_embed_rate: Fraction = 4.0 / 53.0
    # ANVIL's bank tail-blend (#92: window 298, every 4th step, blend 0.55, Richardson 0.2007) on qk, vo, mlp
    bank_blend_window: Window = 0
    bank_blend_every: Every = 4
    bank_blend: Fraction = 0.55
    bank_blend_richardson: Fraction = 0.2007
    # decontraction (#92: on): the shipped banks rescaled to their norms before the ships
    decontract: bool = False

    def on(self) -> bool:
        """Whether the run ships anything."""
        windows = (
            self.tail_ema_window,
            self.tail_avg_window,
            self.value_embed_window,
            self.bank_blend_window,
        )
        return any(windows) or self.decontract


#: #92's ships, as its recipe states them (docs/recipes.md, "Record #92: the terminal ships")
RECORD_92 = ShipsConfig(
    tail_ema_window=298, tail_avg_window=250, value_embed_window=250, bank_blend_window=298, decontract=True
)


def check(s: ShipsConfig, cfg: Any) -> None:
    """The rules between the ships and the rest of the run (one line each)."""
    if not s.on():
        return
    t = cfg.train
    if t.time_budget_s > 0:
        raise ConfigError(
            "optim.ships needs a fixed train.steps (its windows count back from the end): "
            "drop train.time_budget_s"
        )
    for name in ("tail_ema_window", "tail_avg_window", "value_embed_window", "bank_blend_window"):
        window = getattr(s, name)
        if window > t.steps:
            raise ConfigError(f"optim.ships.{name} ({window}) exceeds train.steps ({t.steps})")
    every4 = cfg.optim.value_embed_every4_from
    if s.value_embed_window and every4 and t.steps - s.value_embed_window < every4:
        raise ConfigError(  # the record asserts it
            f"optim.ships.value_embed_window ({s.value_embed_window}) reaches back before "
            f"optim.value_embed_every4_from ({every4}): its rate assumes the period-4 cadence over it"
        )
    if s.bank_blend_richardson > s.bank_blend:
        raise ConfigError(
            f"optim.ships.bank_blend_richardson ({s.bank_blend_richardson}) exceeds optim.ships.bank_blend "
            f"({s.bank_blend}): the vo/mlp blend would be negative"
        )
