"""One optimizer for the whole model, sharded over the processes without DDP (modded-nanogpt HEAD's
NorMuonAndAdam, records #22–#24, #36, #44, #61): NorMuon on the block matrices, labelled cautious
Adam on the rest, as the table (optim/table.py) says.

A step, on every rank, in a fixed order (so the collectives match across ranks):
1. reductions are launched, all asynchronous: each bank's stacked gradients (padded to a multiple of
   the world size) and each sharded Adam gradient are reduce-scattered along dim 0, every replicated
   gradient is all-reduced;
2. updates run small first (replicated Adam, sharded Adam, then the banks, largest first), each on
   this rank's shard only, and each shard's new weights are all-gathered asynchronously;
3. the gathers are waited for and written into the parameters.
Optimizer state exists only for the shard a rank owns. With one process nothing is communicated and
the shard is everything. The order is fixed up front rather than driven by backward hooks, as HEAD
does since #61: the reductions start as soon as the step begins and overlap the small updates.

Every other step Adam (``adam_every`` = 2, #39): on the skipped step its gradients are kept, not
communicated; the next step adds them in. Frozen labels (#52, ``frozen_labels``): while the schedule
sets their group's ``frozen`` (a span of steps from each schedule transition on), their gradients,
kept ones included, are dropped and they do not step; their Adam moments and step count stay as
they were, so they resume where they paused. Tied, then untied (#51, #53): while tied the embedding's
gradient is added into the head's, only the head is updated and the embedding copied from it; at the
untie step the head's Adam state is copied to the embedding.

State dicts are independent of the world size: ``state_dict`` gathers every shard (a collective:
call it on all ranks) and averages the kept Adam gradients; ``load_state_dict`` takes this rank's
slice. A run saved on 2 processes resumes on 1 or 4.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from speedrun.optim.cautious_adam import AdamLabel, adam_foreach_, cautious_adam_
from speedrun.optim.normuon import normuon_direction, second_moment_shape, stepped_weights
from speedrun.optim.table import Bank, Row, build_banks

# -2: per-label Adam step counts; NorMuon state per block (a row's blocks may sit in two banks)
STATE_FORMAT = "sharded-normuon-adam-2"
READABLE_FORMATS = ("sharded-normuon-adam-1", STATE_FORMAT)


#: torch 2.12+ names the tensor collectives `*_single` and warns (FutureWarning, once per call site and
#: process) on the old names; older torch has only the old names
Finish = Callable[[Tensor], Tensor]  # in place on a copy of gradients: what the step does after backward
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Collectives:
    """The three collectives the optimizer uses, asynchronous; a subclass counts bytes (benchmarks)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        on = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if on else 1
        self.rank = dist.get_rank(group) if on else 0

    def reduce_scatter(self, out: Tensor, inp: Tensor) -> Any:
        return _REDUCE_SCATTER(out, inp, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def all_reduce(self, t: Tensor) -> Any:
        return dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def all_gather(self, out: Tensor, inp: Tensor) -> Any:
        return _ALL_GATHER(out, inp, group=self.group, async_op=True)


class ShardedNorMuonAdam:
    """NorMuon + labelled Adam from one table; see the module docstring. ``param_groups`` has one group
    per label ({"kind": "muon"|"adam", "label", "lr", "momentum"}) for the schedule to write. A subclass
    (optim/anvil.py) replaces the matrices' direction (``_bank_direction``) and a label's Adam cadence
    (``_adam_due``, ``_adam_hyper``); the sharding, communication and state dict stay these."""

    state_format, readable_formats = STATE_FORMAT, READABLE_FORMATS

    def __init__(
        self,
        rows: list[Row],
        adam: dict[str, AdamLabel],
        muon_lr: float,
        momentum: float,
        beta2: float,
        muon_weight_decay: float,
        backend: str = "polar_express",
        ns_dtype: torch.dtype = torch.bfloat16,
        ns_steps: int = 5,
        ns_form: str = "fused",
        adam_every: int = 1,
        square_stats: str = "rows",
        frozen_labels: tuple[str, ...] = (),
        tie: tuple[Tensor, Tensor, int] | None = None,
        comms: Collectives | None = None,
    ) -> None:
        self.comms = comms or Collectives()
        # the speed layer may put its compiled NorMuon step here (perf/compiled_updates.py, train/ setup)
        self.bank_update: Callable[..., Tensor] | None = None
        self.launched: dict[int, tuple[Tensor, Any]] = {}  # reductions started early (`launch`), by id
        self.world, self.rank = self.comms.world, self.comms.rank
        self.rows = rows
        self.banks = build_banks(rows, self.world)
        self.adam_rows = [r for r in rows if r.rule == "adam"]
        self.adam = adam
        self.beta2, self.muon_wd, self.backend, self.ns_steps = beta2, muon_weight_decay, backend, ns_steps
        self.ns_form = ns_form  # Newton-Schulz op order of a record era (optim/orthogonalize.py)
        self.ns_dtype = ns_dtype  # bf16 as the records; fp32 where the device runs bf16 slowly
        self.adam_every = adam_every
        self.square_stats = square_stats  # NorMuon's statistics of square matrices (optim/normuon.py)
        self.embed, self.head, self.tie_until = tie if tie else (None, None, 0)
        self.tied = self.tie_until > 0
        self.param_groups: list[dict[str, Any]] = []
        if self.banks:
            params = [r.param for r in rows if r.rule == "normuon"]
            self.param_groups.append(
                dict(kind="muon", label="matrix", lr=muon_lr, momentum=momentum, params=params)
            )
        for label in adam:
            params = [r.param for r in self.adam_rows if r.label == label]
            if params:
                group = dict(kind="adam", label=label, lr=adam[label].lr, params=params)
                if label in frozen_labels:
                    group["frozen"] = False  # the schedule sets it (train/schedule.py, frozen_at)
                self.param_groups.append(group)
        self.steps_done = 0
        self.adam_steps = dict.fromkeys(adam, 0)  # Adam steps taken, per label
        self.kept: dict[str, Tensor] = {}  # Adam gradients carried over a skipped step (this rank's)
        self.state: dict[str, dict[str, Tensor]] = {}
        self._init_state()

    # ---- state: only what this rank owns ----
    def _init_state(self) -> None:
        for bank in self.banks:
            shape = (bank.per_rank, *bank.shape)
            moments = second_moment_shape(shape, bank.stats_rule(self.square_stats))
            st = {"momentum": torch.zeros(shape), "second_moment": torch.zeros(moments)}
            if bank.dtype == torch.bfloat16:
                st["mantissa"] = torch.zeros(shape, dtype=torch.uint16)
            device = bank.members[0][0].param.device
            self.state[self._bank_key(bank)] = {k: v.to(device) for k, v in st.items()}
        for row in self.adam_rows:
            shard = self._adam_shard(row)
            zeros = torch.zeros(shard.shape, dtype=torch.float32, device=shard.device)
            self.state[row.name] = {"exp_avg": zeros, "exp_avg_sq": zeros.clone()}

    @staticmethod
    def _bank_key(bank: Bank) -> str:
        return f"bank:{bank.shape[0]}x{bank.shape[1]}:{str(bank.dtype).removeprefix('torch.')}"

    def _row_sharded(self, row: Row) -> bool:
        return row.sharded and self.world > 1

    def _adam_shard(self, row: Row) -> Tensor:
        """The rows of an Adam parameter this rank updates (all of them when replicated)."""
        if not self._row_sharded(row):
            return row.param.data
        size = row.param.shape[0] // self.world
        return row.param.data[self.rank * size : (self.rank + 1) * size]

    def parameters(self):
        for row in self.rows:
            yield row.param

    def zero_grad(self, set_to_none: bool = True) -> None:
        for row in self.rows:
            row.param.grad = None

    def _group(self, label: str) -> dict[str, Any]:
        return next(g for g in self.param_groups if g["label"] == label)

    # ---- the step ----
    @torch.no_grad()
    def step(self) -> None:
        do_adam = self.steps_done % self.adam_every == self.adam_every - 1
        due = {label: self._adam_due(label, do_adam) for label in self.adam}
        frozen = {g["label"] for g in self.param_groups if g.get("frozen")}
        for row in self.adam_rows:
            if row.label in frozen:  # #52: this step's and any kept gradients are dropped
                row.param.grad = None
                self.kept.pop(row.name, None)
        self._carry_adam_grads(due)
        if self.tied and do_adam and self.embed.grad is not None:
            self.head.grad.add_(self.embed.grad)
            self.embed.grad = None
        active = [r for r in self.adam_rows if due[r.label] and r.param.grad is not None]
        # 1. launch every reduction, banks first (largest), in the same order on every rank; those the
        # speed layer launched from the backward's hooks (in this order too) are only collected
        started = self.launched
        self.launched = {}
        bank_work = [(bank, *(started.pop(id(bank), None) or self._reduce_bank(bank))) for bank in self.banks]
        adam_work = [(row, *(started.pop(id(row), None) or self._reduce_adam(row))) for row in active]
        assert not started, "a reduction was launched that this step does not use"
        # 2. updates, small first; gathers start as each shard is done
        for label in self.adam_steps:
            self.adam_steps[label] += due[label] and label not in frozen
        gathers = self._update_adam(adam_work)
        for bank, grads, work in bank_work:
            if work is not None:
                work.wait()
                grads.div_(self.world)
            gathers.append(self._update_bank(bank, grads))
        # 3. write the gathered weights
        for bank, gathered, work in gathers:
            if work is not None:
                work.wait()
            if bank is not None:
                self._write_bank(bank, gathered)
        if self.tied and do_adam:
            self.embed.data.copy_(self.head.data)
        self.steps_done += 1
        if self.tied and self.steps_done >= self.tie_until:
            self._untie()

    # ---- for the speed layer: reductions launched from the backward (perf/overlap.py)
    def reduction_order(self) -> list[Bank | Row]:
        """The next step's reductions that may start before it, in the order `step` launches them:
        every bank, then the Adam rows it communicates (their label's Adam step, `_adam_due`; frozen
        rows and, while tied, the embedding are not communicated) up to the head while tied (its
        gradient gains the embedding's in `step`, which launches it and the rest after it): a prefix of
        `step`'s own order."""
        if self.world == 1:
            return []
        do_adam = self.steps_done % self.adam_every == self.adam_every - 1
        frozen = {g["label"] for g in self.param_groups if g.get("frozen")}
        rows: list[Row] = []
        for row in self.adam_rows:
            if not self._adam_due(row.label, do_adam) or row.label in frozen:
                continue  # not communicated this step
            if self.tied and do_adam and row.param is self.head:
                break
            if not (self.tied and do_adam and row.param is self.embed):
                rows.append(row)
        return [*self.banks, *rows]

    def launch(self, item: Bank | Row, finish: Finish) -> None:
        """Start one reduction of `reduction_order` now, from inside the backward (its gradients are
        final); `step` collects it. `finish` does in place to a copy of the gradients what the training
        step does to them after the backward (divide, scale): they themselves are left untouched."""
        reduce = self._reduce_bank if isinstance(item, Bank) else self._reduce_adam
        self.launched[id(item)] = reduce(item, finish)

    def _update_adam(self, adam_work: list[tuple[Row, Tensor, Any]]) -> list[tuple[None, None, Any]]:
        """Adam on this rank's shards, each after its reduction, replicated tensors first: those of one
        label without decay in multi-tensor ops (the scalars), the rest one by one. Returns the sharded
        rows' gathers."""
        batched: dict[str, list[tuple[Row, Tensor, Any]]] = {}
        single, gathers = [], []
        for row, grad, work in sorted(adam_work, key=lambda w: self._row_sharded(w[0])):
            plain = not self._row_sharded(row) and not self.adam[row.label].weight_decay
            if plain and row.param.dtype == torch.float32:
                batched.setdefault(row.label, []).append((row, grad, work))
            else:
                single.append((row, grad, work))
        for label, items in batched.items():
            for *_, work in items:
                if work is not None:
                    work.wait()
            grads, st = [g for _, g, _ in items], [self.state[row.name] for row, _, _ in items]
            if self.world > 1:
                torch._foreach_div_(grads, self.world)
            weights = [row.param for row, _, _ in items]  # (no_grad)
            exp_avgs, exp_avg_sqs = [s["exp_avg"] for s in st], [s["exp_avg_sq"] for s in st]
            lr, t = self._group(label)["lr"], self.adam_steps[label]
            adam_foreach_(weights, grads, exp_avgs, exp_avg_sqs, t, lr, self._adam_hyper(label))
        for row, grad, work in single:
            if work is not None:
                work.wait()
                grad.div_(self.world)
            shard, st = self._adam_shard(row), self.state[row.name]
            lr, t = self._group(row.label)["lr"], self.adam_steps[row.label]
            cautious_adam_(shard, grad, st["exp_avg"], st["exp_avg_sq"], t, lr, self._adam_hyper(row.label))
            if self._row_sharded(row):
                gathers.append((None, None, self.comms.all_gather(row.param.data, shard.clone())))
        return gathers

    def _adam_due(self, label: str, do_adam: bool) -> bool:
        """Whether ``label``'s Adam steps this step: every ``adam_every``-th step."""
        return do_adam

    def _adam_hyper(self, label: str) -> AdamLabel:
        """``label``'s Adam hyperparameters this step: its row's."""
        return self.adam[label]

    def _carry_adam_grads(self, due: dict[str, bool]) -> None:
        """Keep Adam gradients over a skipped step (summed, as HEAD's grads that are not cleared)."""
        for row in self.adam_rows:
            p, kept = row.param, self.kept.pop(row.name, None)
            if kept is not None:
                p.grad = kept if p.grad is None else p.grad.add_(kept)
            if not due[row.label] and p.grad is not None:
                self.kept[row.name] = p.grad
                p.grad = None

    def _reduce_bank(self, bank: Bank, finish: Finish | None = None) -> tuple[Tensor, Any]:
        grads = bank.grad_rows()
        rows, cols = bank.shape
        if self.world == 1:
            return torch.cat(grads).view(bank.size, rows, cols), None
        stacked = torch.zeros((bank.padded, rows, cols), dtype=grads[0].dtype, device=grads[0].device)
        torch.cat(grads, out=stacked.view(-1, cols)[: bank.size * rows])
        if finish is not None:
            finish(stacked)
        out = torch.empty((bank.per_rank, *bank.shape), dtype=stacked.dtype, device=stacked.device)
        return out, self.comms.reduce_scatter(out, stacked)

    def _reduce_adam(self, row: Row, finish: Finish | None = None) -> tuple[Tensor, Any]:
        g = row.param.grad
        if finish is not None:  # from the backward: a copy, made as `step` makes it (+ a kept gradient)
            g = finish(g.clone())
            if row.name in self.kept:
                g.add_(self.kept[row.name])
        if self.world == 1:
            return g, None
        if not self._row_sharded(row):
            return g, self.comms.all_reduce(g)
        out = torch.empty((g.shape[0] // self.world, *g.shape[1:]), dtype=g.dtype, device=g.device)
        return out, self.comms.reduce_scatter(out, g.contiguous())

    def _update_bank(self, bank: Bank, grads: Tensor) -> tuple[Bank, Tensor, Any]:
        """NorMuon on this rank's matrices of the bank; returns (bank, new weights, gather work)."""
        group = self._group("matrix")
        st = self.state[self._bank_key(bank)]
        owned = bank.owned(self.rank)
        k = len(owned)
        new = torch.empty((bank.per_rank, *bank.shape), dtype=bank.dtype, device=grads.device)
        if k:
            mine = [bank.members[j] for j in owned]
            lr = group["lr"] * bank.lr_multiplier
            muls = [row.lr_mul for row, _ in mine]
            if any(m != 1.0 for m in muls):  # per-matrix multipliers (HEAD's c_proj ×2)
                lr = lr * torch.tensor(muls, device=grads.device).view(k, 1, 1)
            weights = torch.stack(bank.weight_views()[owned.start : owned.stop])
            mantissa = st["mantissa"][:k] if "mantissa" in st else None
            decay = self.muon_wd * group["lr"]
            if self.bank_update is not None:  # the speed layer's compiled NorMuon step
                rule = bank.stats_rule(self.square_stats)
                updated = self.bank_update(
                    grads[:k], st["momentum"][:k], st["second_moment"][:k], weights, mantissa, lr, decay,
                    group["momentum"], self.beta2, rule, self.backend, self.ns_steps, self.ns_form,
                    self.ns_dtype,
                )  # fmt: skip
            else:
                v, gate = self._bank_direction(bank, st, grads[:k].float(), group)
                updated = stepped_weights(weights, mantissa, v, lr, decay, gate)
            new[:k].copy_(updated)
        new[k:].zero_()
        if self.world == 1:
            return bank, new, None
        out = torch.empty((bank.padded, *bank.shape), dtype=bank.dtype, device=grads.device)
        return bank, out, self.comms.all_gather(out, new)

    def _bank_direction(
        self, bank: Bank, st: dict[str, Tensor], grads: Tensor, group: dict[str, Any]
    ) -> tuple[Tensor, Tensor | None]:
        """NorMuon's update direction of this rank's matrices of ``bank`` (fp32 ``grads``, overwritten),
        and what gates the cautious decay (None: the direction itself)."""
        k = grads.shape[0]
        v = normuon_direction(
            grads, st["momentum"][:k], st["second_moment"][:k], group["momentum"], self.beta2,
            bank.stats_rule(self.square_stats), self.backend, self.ns_steps, self.ns_form, self.ns_dtype,
        )  # fmt: skip
        return v, None

    @staticmethod
    def _write_bank(bank: Bank, gathered: Tensor) -> None:
        torch._foreach_copy_(bank.weight_views(), list(gathered[: bank.size].unbind(0)))

    def _untie(self) -> None:
        """The embedding continues from the head's weights and Adam state (shards align: same shape)."""
        names = {r.param: r.name for r in self.adam_rows}
        for key in ("exp_avg", "exp_avg_sq"):
            self.state[names[self.embed]][key].copy_(self.state[names[self.head]][key])
        self.tied = False

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (its shards and the replicated rows)."""
        return sum(t.numel() * t.element_size() for st in self.state.values() for t in st.values())

    def describe(self) -> str:
        sharded, matrices = sum(r.sharded for r in self.rows), sum(b.size for b in self.banks)
        return (
            f"optimizer: NorMuon on {matrices} matrices in {len(self.banks)} banks + Adam "
            f"on {len(self.adam_rows)} tensors; {sharded} of {len(self.rows)} sharded over {self.world} "
            f"processes; optimizer state {self.state_bytes():,} bytes per process"
        )

    # ---- world-size independent state ----
    def state_dict(self) -> dict[str, Any]:
        """Full (gathered) state keyed by parameter name; a collective on every rank."""
        params: dict[str, dict[str, Tensor]] = {}
        for bank in self.banks:  # NorMuon: per param, a list with one tensor per block
            full = {k: self._gather(v) for k, v in self.state[self._bank_key(bank)].items()}
            for j, (row, i) in enumerate(bank.members):
                entry = params.setdefault(row.name, {})
                for k, v in full.items():
                    entry.setdefault(k, [None] * len(row.block_rows))[i] = v[j]
        for row in self.adam_rows:
            st = self.state[row.name]
            params[row.name] = {
                k: self._gather(v) if self._row_sharded(row) else v.clone() for k, v in st.items()
            }
        kept = {}  # each rank keeps its own local gradients over a skipped step: store their mean
        for name, g in self.kept.items():  # the same names on every rank
            g = g.clone()
            if self.world > 1:
                self.comms.all_reduce(g).wait()
                g.div_(self.world)
            kept[name] = g
        return {
            "format": self.state_format,
            "steps_done": self.steps_done,
            "adam_steps": dict(self.adam_steps),
            "tied": self.tied,
            "params": params,
            "kept": kept,
        }

    def _gather(self, shard: Tensor) -> Tensor:
        if self.world == 1:
            return shard.clone()
        # the mantissa sidecars are uint16, which neither gloo nor NCCL sends: a gather copies bits, so they
        # travel as bf16 bit patterns and come back as they left
        wire = shard.view(torch.bfloat16) if shard.dtype in (torch.uint16, torch.int16) else shard
        out = torch.empty((wire.shape[0] * self.world, *wire.shape[1:]), dtype=wire.dtype, device=wire.device)
        self.comms.all_gather(out, wire.contiguous()).wait()
        return out.view(shard.dtype)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") not in self.readable_formats:
            raise ValueError(f"optimizer state is not {self.state_format}")
        params = state["params"]
        missing = sorted({r.name for r in self.rows} - set(params))
        if missing:
            raise ValueError(f"optimizer state has no entry for {missing[0]}")
        for bank in self.banks:
            st = self.state[self._bank_key(bank)]
            for k, v in st.items():  # -1 stored a stacked tensor per param, -2 a list: both index by block
                full = [params[row.name][k][i] for row, i in bank.members]
                for slot, j in enumerate(bank.owned(self.rank)):
                    v[slot].copy_(full[j])
        for row in self.adam_rows:
            st, saved = self.state[row.name], params[row.name]
            for k, v in st.items():
                size = v.shape[0]
                src = (
                    saved[k][self.rank * size : (self.rank + 1) * size]
                    if self._row_sharded(row)
                    else saved[k]
                )
                v.copy_(src)
        self.steps_done, self.tied = state["steps_done"], state["tied"]
        steps = state["adam_steps"]  # -1: one count for every label
        self.adam_steps = {label: steps if isinstance(steps, int) else steps[label] for label in self.adam}
        self.kept = {name: g.to(self._param(name).device).clone() for name, g in state["kept"].items()}

    def _param(self, name: str) -> Tensor:
        return next(r.param for r in self.rows if r.name == name)
