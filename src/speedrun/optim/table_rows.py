"""#92's n-gram table as one part of the run's optimizer: row-sharded, pulled per forward, stepped by RowAdam.

Each process keeps rows/world of the table (optim/row_shard.py `shard_part`). A forward pre-hook on the
model part, installed here (around the model: the part itself communicates nothing), pulls the rows its
tokens hash to into a compact leaf the part reads (`part.pulled`); a compiled model is pulled for before its
call instead (`pull_around`), so its graph holds no collective and no host sync. In a training forward that
leaf joins this part's param group, so the training step (train/step.py) divides and scales its gradient
with the others' and zeroes it; `step()` pushes each micro-batch's row gradients to their owners (the mean
over processes) and keeps them; on the table's update steps the kept gradients of the cycle are summed per
row and one RowAdam step runs on exactly those rows (optim/row_adam.py: a dense Adam over every row,
computed on the touched ones).

The cadence and rule are the record's (track_1_short/ngram_table.py): the table steps with the other Adam
labels, every `adam_every`-th step (#92: odd steps), then from `every4_from` (#92: 336) on steps ≡ 3 (mod 4),
where one update stands for two steps: β2 squared and the decay doubled (5 → 10). Its row: LR ×70 of the
embedding's (scheduled), β1 = 0, one second moment per row. The bias correction counts its updates.

Saved state is world-size free: `state_dict` gathers the table and its state on rank 0 (a collective),
`load_state_dict` takes this process's rows of one saved on any number of processes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from speedrun.model.gpt2026.ngram import NgramEmbed, ngram_rows
from speedrun.optim.cautious_adam import AdamLabel
from speedrun.optim.row_adam import RowAdam
from speedrun.optim.row_shard import Pulled, shard_part

STATE_FORMAT = "ngram-rows-1"


class TableRows:
    """The n-gram part's rows, their exchanges and their Adam; one param group (`kind` adam, label ngram)
    whose `lr` the schedule writes and whose `params` are the step's pulled leaves."""

    def __init__(self, part: NgramEmbed, hyper: AdamLabel, adam_every: int = 1, every4_from: int = 0):
        assert not getattr(part.table, "row_sharded", False), "one TableRows per model: sharded once"
        assert hyper.betas[0] == 0.0, "#92's table Adam has no first moment (config: the ngram row's betas)"
        self.part, self.hyper = part, hyper
        self.adam_every, self.every4_from = adam_every, every4_from
        self.rows = shard_part(part)  # this process's rows; the part's table is now its shard
        part.table.row_sharded = True  # checkpoints save it gathered (train/run/checkpoint.py)
        self.adam = RowAdam(self.rows.shard, beta1=0.0, eps=hyper.eps, row_moment=True)
        self.param_groups = [dict(kind="adam", label="ngram", lr=hyper.lr, params=[])]
        self.pulls: list[Pulled] = []  # this step's training forwards' pulls, in order
        self.kept: list[tuple[Tensor, Tensor]] = []  # pushed (local rows, gradients) since the last update
        self.steps_done = 0
        part.register_forward_pre_hook(self._pull, with_kwargs=True)

    def _pull(self, part: nn.Module, args: tuple, kwargs: dict) -> None:
        """Before each forward of the part: its tokens' rows from their owners (a collective). A compiled
        model traces its parts' hooks: there the rows were pulled around it (`pull_around`)."""
        if torch.compiler.is_compiling():
            return
        idx, *rest = args
        start = kwargs.get("start", rest[1] if len(rest) > 1 else 0)
        if start > 0:  # cached decoding: the part calls itself on the whole window, pulled then
            return
        self.pull(idx)

    def pull(self, idx: Tensor) -> None:
        """The rows tokens `idx` (B, T) read, set as the part's `pulled`; in a training forward their leaf
        joins this part's param group."""
        pulled = self.rows.pull(ngram_rows(idx, self.part.rows))
        self.part.pulled = pulled
        if torch.is_grad_enabled():
            self.pulls.append(pulled)
            self.param_groups[0]["params"].append(pulled.cache)

    def pull_around(self, compiled: nn.Module) -> None:
        """Pull before each call of the compiled model (its first argument is the tokens), outside its graph:
        the graph reads the pulled rows as an input of fixed shape and communicates nothing."""

        def before(_: nn.Module, args: tuple) -> None:  # returns None: the call's arguments stay as given
            self.pull(args[0])

        compiled.register_forward_pre_hook(before)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.pulls.clear()
        self.param_groups[0]["params"].clear()
        self.part.pulled = None

    def due(self) -> tuple[bool, float, float]:
        """(whether the table steps now, its β2, its decay): the record's is_update_step and multipliers."""
        b2, wd = self.hyper.betas[1], self.hyper.weight_decay
        if self.every4_from and self.steps_done >= self.every4_from:
            return self.steps_done % 4 == 3, b2 * b2, 2 * wd
        return self.steps_done % self.adam_every == self.adam_every - 1, b2, wd

    @torch.no_grad()
    def step(self) -> None:
        """Push this step's row gradients (collectives, the same count on every process), keep them, and on
        an update step run RowAdam on the cycle's summed rows."""
        for pulled in self.pulls:
            self.kept.append(self.rows.push(pulled))
        due, beta2, wd = self.due()
        if due:
            rows = torch.cat([r for r, _ in self.kept]) if self.kept else self.rows.shard.new_empty(0).long()
            grads = torch.cat([g for _, g in self.kept]) if self.kept else self.rows.shard.new_empty(0, 1)
            self.adam.step(rows, grads, self.param_groups[0]["lr"], beta2, wd)
            self.kept = []
        self.steps_done += 1

    def state_dict(self) -> dict[str, Any] | None:
        """The table, its RowAdam state and the kept gradients, gathered on rank 0 (None elsewhere): a
        collective. Each row's state is saved as it stands with the step it is current to (replayed on use).
        The table itself goes to the checkpoint's weights (train/run/checkpoint.py)."""
        kept = torch.zeros_like(self.rows.shard, dtype=torch.float32)
        for rows, grads in self.kept:
            kept.index_add_(0, rows, grads.float())
        state = self.rows.full_state({**self.adam.state_dict(), "kept": kept})
        if state is not None:
            state |= {"format": STATE_FORMAT, "steps_done": self.steps_done}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"n-gram table state of format {state.get('format')!r}, expected {STATE_FORMAT}")
        mine = self.rows.load_full_state(state)
        self.adam.load_state_dict(mine)
        self.steps_done = state["steps_done"]
        kept = mine["kept"]
        touched = kept.abs().sum(1).nonzero().flatten()
        self.kept = [(touched, kept[touched].to(self.rows.shard.dtype))] if touched.numel() else []

    def describe(self) -> str:
        r = self.rows
        return (
            f"n-gram table: {r.per_rank:,} of {r.num_rows:,} rows on each of {r.world} process(es), pulled "
            f"per forward; {self.state_bytes():,} bytes per process with their RowAdam state"
        )

    def state_bytes(self) -> int:
        """Bytes this process holds for the table: its rows and their Adam state."""
        a = self.adam
        held = [self.rows.shard, a.exp_avg_sq, a.current] + ([a.exp_avg] if a.exp_avg is not None else [])
        return sum(t.numel() * t.element_size() for t in held)


def table_part(model: nn.Module) -> NgramEmbed | None:
    """The model's n-gram part, if it has one."""
    return next((m for m in model.modules() if isinstance(m, NgramEmbed)), None)
