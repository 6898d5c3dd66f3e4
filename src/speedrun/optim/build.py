"""One optimizer object per run, built from the labels of the model's parameters (optim/rules.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from speedrun.config import TABLE_OPTIMIZERS, Config
from speedrun.config.families import model_facts
from speedrun.config.labels import SCALAR_LIKE, label_table
from speedrun.errors import ConfigError
from speedrun.hardware import fast_bf16
from speedrun.model.labels import label_of
from speedrun.optim import Muon, set_muon_split
from speedrun.optim.anvil import Rails, ShardedAnvilAdam
from speedrun.optim.cautious_adam import AdamLabel
from speedrun.optim.ema_nesterov import EmaNesterov
from speedrun.optim.pinned_muon import PinnedMuon
from speedrun.optim.plain_adam import PlainAdam
from speedrun.optim.rules import (
    MUON_GROUPS,
    Entry,
    LabelRule,
    adam_groups,
    muon_parts,
    param_rules,
)
from speedrun.optim.sharded import ShardedNorMuonAdam
from speedrun.optim.ships import Ships
from speedrun.optim.table import build_rows
from speedrun.optim.table_rows import TableRows, table_part
from speedrun.optim.tail_ema import TailEMA


class RunOptimizer:
    """The optimizers of a run behind one `step()`, `zero_grad()` and state dict. Each param group carries
    its `kind` ("adam" | "muon": what the schedule sets) and peak `initial_lr`; parts step in insertion
    order (Adam, then Muon, as the records), and the "table" part (optim/sharded.py) tags its own groups;
    #92's row-sharded n-gram table is the "ngram_rows" part (optim/table_rows.py), last."""

    def __init__(
        self,
        parts: dict[str, torch.optim.Optimizer | ShardedNorMuonAdam],
        tail: TailEMA | None = None,
        nesterov: EmaNesterov | None = None,
        ships: Ships | None = None,
    ):
        self.parts = parts
        self.tail, self.steps = tail, 0  # track 3's Tail-EMA readout, folded in after each step
        self.nesterov = nesterov  # track 3's EMA-Nesterov lookahead, made after each step
        # #92's terminal ships (optim/ships.py): ticked after each step here, shipped by the loop at the end
        self.ships = ships
        self.overlap = None  # the speed layer's reductions from backward hooks (perf/overlap.py), if any
        for kind, opt in parts.items():
            for group in opt.param_groups:
                group.setdefault("kind", kind)
                group["initial_lr"] = group["lr"]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for opt in self.parts.values() for group in opt.param_groups]

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        for group in self.param_groups:
            yield from group["params"]

    @torch.no_grad()
    def step(self) -> None:
        if self.ships is not None:
            self.ships.before_step()
        for opt in self.parts.values():
            opt.step()
        if self.ships is not None:
            self.ships.after_step(self.steps)
        if self.tail is not None:
            self.tail.after_step(self.steps)
        if self.nesterov is not None:  # the lookahead's LR ratio: the first Adam group's (#46's embedding)
            first = self.param_groups[0]
            self.nesterov.after_update(first["lr"] / first["initial_lr"])
        self.steps += 1

    @contextlib.contextmanager
    def readout(self) -> Iterator[None]:
        """The weights validation evaluates: without a pending EMA-Nesterov lookahead, then the Tail-EMA
        blend (optim.tail_ema_tau), else the weights."""
        with self.nesterov.readout() if self.nesterov is not None else contextlib.nullcontext():
            with self.tail.readout() if self.tail is not None else contextlib.nullcontext():
                yield

    @property
    def feeders(self) -> list[Any]:
        """The parts that hand the model inputs from outside its graph (#92's pulled table rows)."""
        return [opt for opt in self.parts.values() if hasattr(opt, "pull_around")]

    def feed(self, compiled: torch.nn.Module) -> None:
        """The feeders do it before each call of the compiled model, outside its graph (a compiled model
        traces its parts' hooks)."""
        for opt in self.feeders:
            opt.pull_around(compiled)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.parts.values():
            opt.zero_grad(set_to_none=set_to_none)

    def describe(self) -> str:
        """A log line about the optimizer when it has one to say (the sharded table does)."""
        lines = [opt.describe() for opt in self.parts.values() if hasattr(opt, "describe")]
        return "\n".join(lines + ([self.ships.describe()] if self.ships is not None else []))

    def state_dict(self) -> dict[str, Any]:
        out = {kind: opt.state_dict() for kind, opt in self.parts.items()}
        if self.tail is not None:
            out["tail_ema"] = {"steps": self.steps, **self.tail.state_dict()}
        if self.nesterov is not None:
            out["ema_nesterov"] = self.nesterov.state_dict()
        if self.ships is not None:
            out["ships"] = {"steps": self.steps, **self.ships.state_dict()}
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.ships is not None and isinstance(state, dict) and "ships" in state:
            state = dict(state)
            ships = dict(state.pop("ships"))
            self.steps = ships.pop("steps")
            self.ships.load_state_dict(ships)
        if self.nesterov is not None and isinstance(state, dict) and "ema_nesterov" in state:
            state = dict(state)
            self.nesterov.load_state_dict(state.pop("ema_nesterov"))
        if self.tail is not None and isinstance(state, dict) and "tail_ema" in state:
            state = dict(state)
            tail = dict(state.pop("tail_ema"))
            self.steps = tail.pop("steps")
            self.tail.load_state_dict(tail)
        if not isinstance(state, dict) or set(state) != set(self.parts):
            found = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"optimizer state holds {found}, this run has {sorted(self.parts)}")
        for kind, opt in self.parts.items():
            opt.load_state_dict(state[kind])


def model_rules(model: torch.nn.Module, cfg: Config) -> list[Entry]:
    """The model's parameters with their labels and the recipe's rule for each (optim/rules.py)."""
    return param_rules(model, _table(cfg.optim, model.cfg), user_rows(cfg))  # the model's own shapes


def user_rows(cfg: Config) -> list[str]:
    """The stated rows the user gave (command line, own recipe file): a row of theirs that no parameter
    carries is refused. Rows a bundled base states stay quiet when a switch removes their parameters, so
    turning a part off (ablate, a derived recipe) needs no second key to take its row back."""
    keys = [k.split(".") for k in cfg.fixed if k == "optim.labels" or k.startswith("optim.labels.")]
    return [lab for lab in cfg.optim.labels if any(len(k) == 2 or k[2] == lab for k in keys)]


def run_rules(cfg: Config) -> dict[str, LabelRule]:
    """The recipe's label table: every label's row (config_labels.label_table), the Adam groups' source."""
    return _table(cfg.optim, cfg.model)


def _table(o, m) -> dict[str, LabelRule]:
    """#80's Q/K blocks are heads of Q/K rows: #344's narrower width where set."""
    return label_table(o, model_facts(m).qk_head_dim)


def build_optimizer(model: torch.nn.Module, cfg: Config) -> RunOptimizer:
    """AdamW alone (baseline), or Muon on block matrices + Adam on embeddings, head and scalars, or the
    NorMuon table. Raises LabelError when a parameter has no label or its label no rule."""
    o = cfg.optim
    entries = model_rules(model, cfg)
    rows = ngram_rows_part(model, cfg, entries)  # takes the table's entry out of `entries`
    tail = (
        TailEMA(model, o.tail_ema_start, o.tail_ema_end, o.tail_ema_tau, o.tail_ema_lambda)
        if o.tail_ema_tau
        else None
    )
    nesterov = (
        EmaNesterov(
            list(model.parameters()), o.ema_nesterov_step, o.ema_nesterov_beta, o.ema_nesterov_start,
            o.ema_nesterov_end,
        )
        if o.ema_nesterov_step
        else None
    )  # fmt: skip
    ships = Ships(model, o.ships, cfg.train.steps) if o.ships.on() else None
    if o.name in TABLE_OPTIMIZERS:
        table = build_table_optimizer(model, cfg, entries)
        if ships is not None:
            ships.value_embed_steps = value_embed_steps(table)
        return RunOptimizer({"table": table} | rows, tail, ships=ships)
    groups: dict[str, list[torch.nn.Parameter]] = {g: [] for g in MUON_GROUPS}
    for e in entries:  # after MUON_GROUPS, the Adam groups of stated rows (optim.labels)
        groups.setdefault(e.rule.group, []).append(e.param)
    fused = {"fused": True} if next(model.parameters()).is_cuda else {}
    if o.name == "adamw":
        params = [p for group in groups.values() for p in group]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        adamw = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, **fused)
        return RunOptimizer({"adam": adamw} | rows, tail, ships=ships)
    hyper = adam_groups(run_rules(cfg), set(groups))
    power_c = dict(zip(MUON_GROUPS, o.power_cool_c, strict=True)) if o.power_cool_end else {}
    adam_params = {  # embed, head, scalar (the saved order), then the groups stated rows made
        g: {"params": groups[g], "lr": h.lr, "betas": h.betas, "eps": h.eps, "weight_decay": h.weight_decay}
        | ({"power_c": power_c.get(g, power_c["scalar"])} if power_c else {})  # stated groups: the scalars'
        for g, h in sorted(hyper.items(), key=lambda gh: gh[0] not in MUON_GROUPS)
        if groups[g]
    }
    # #46: the scalars (gains, biases: every group of a scalar-like label) in Adam without bias correction,
    # a part of their own
    plain = [] if o.scalar_bias_correction else [adam_params.pop(g) for g in SCALAR_LIKE if g in adam_params]
    for e in entries:
        if e.rule.rule == "muon" and e.param.ndim == 2:
            set_muon_split(e.param, muon_parts(e))
    ns_dtype = muon_ns_dtype(o.muon_ns_dtype, groups["matrix"][0].device if groups["matrix"] else None)
    muon = (
        pinned_muon(entries, o, ns_dtype)
        if pinned(o)
        else Muon(
            groups["matrix"],
            shape_scale=o.muon_shape_scale,
            momentum_form=o.muon_momentum_form,
            scale_in_update_dtype=o.muon_scale_in_bf16,
            **muon_settings(o, ns_dtype),
        )
    )
    for group in muon.param_groups if power_c else []:
        group["power_c"] = power_c["matrix"]
    adam = torch.optim.Adam(list(adam_params.values()), decoupled_weight_decay=True, **fused)  # AdamW's decay
    parts = {"adam": adam, "muon": muon}
    if plain:
        assert not plain[0]["weight_decay"], "config checks: #46's aux Adam has no decay"
        parts["scalar"] = PlainAdam(plain, lr=plain[0]["lr"], betas=plain[0]["betas"], eps=plain[0]["eps"])
    return RunOptimizer(parts | rows, tail, nesterov, ships)


def value_embed_steps(table: ShardedNorMuonAdam) -> Any:
    """The Adam step count of the value embeddings' group (#92's ship ticks when it rises), or None."""
    group = next(
        (r.label for r in table.adam_rows if getattr(label_of(r.param), "name", "") == "value_embed"), None
    )
    return None if group is None else lambda: table.adam_steps[group]


def ngram_rows_part(model: torch.nn.Module, cfg: Config, entries: list[Entry]) -> dict[str, TableRows]:
    """#92's n-gram table, where the model has one: sharded by rows over the processes and trained by its
    label's row in RowAdam (optim/table_rows.py) on any number of processes; its entry leaves `entries`."""
    part = table_part(model)
    if part is None:
        return {}
    (entry,) = [e for e in entries if e.param is part.table]
    entries.remove(entry)
    if cfg.optim.grad_clip > 0:  # the clip would see only the pulled rows of this process
        raise ConfigError(
            "optim.grad_clip with model.ngram.rows: the row-sharded table is not clipped; set 0"
        )
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if world > 1 and cfg.train.sample_every > 0:  # rank 0 samples alone; a pull is a collective
        raise ConfigError(
            "train.sample_every with model.ngram.rows on several processes: the table's rows live on every "
            "process and samples are drawn on rank 0 alone; set train.sample_every=0"
        )
    if part.rows % world:
        lower = part.rows // (2 * world) * 2 * world
        raise ConfigError(
            f"model.ngram.rows={part.rows:,} does not split evenly over {world} processes (each holds rows/"
            f"{world}): model.ngram.rows={lower:,} does"
        )
    r, o = entry.rule, cfg.optim
    hyper = AdamLabel(r.lr, tuple(r.betas), r.wd, r.eps)
    every4 = o.value_embed_every4_from if o.name == "anvil" else 0
    adam_every = o.adam_every if o.name in TABLE_OPTIMIZERS else 1
    return {"ngram_rows": TableRows(part, hyper, adam_every, every4)}


def pinned(o: Any) -> bool:
    """Whether the recipe's Muon takes one of track 3's #46 switches (optim/pinned_muon.py)."""
    return bool(
        o.muon_soap or o.muon_radius_pin or o.muon_uw_floor or o.muon_post_pin_cwd or o.muon_hyperball
    )


def pinned_muon(entries: list[Entry], o: Any, ns_dtype: torch.dtype) -> PinnedMuon:
    """#46's Muon over the Muon-rule matrices, grouped by how SOAP treats them: the attention output
    through the trust gate, Q/K/V blended at gate 1, the rest preconditioned plainly."""
    gates = {"attn_out": "trust", "qkv": "blend"}
    groups: dict[str, list[torch.Tensor]] = {}
    for e in entries:
        if e.rule.group == "matrix":
            groups.setdefault(gates.get(e.label.name, "none"), []).append(e.param)
    return PinnedMuon(
        [{"params": ps, "gate": gate} for gate, ps in groups.items()],
        soap=o.muon_soap,
        soap_beta2=o.muon_soap_beta2,
        uw_floor=o.muon_uw_floor,
        row_floor=o.muon_row_floor,
        pin=o.muon_radius_pin,
        cwd=o.muon_post_pin_cwd,
        hyperball=o.muon_hyperball,
        **muon_settings(o, ns_dtype),
    )


def muon_settings(o: Any, ns_dtype: torch.dtype) -> dict[str, Any]:
    """What Muon and #46's PinnedMuon both take from the recipe: step size, momentum (its warm-up's start
    where it warms up), decay and the orthogonalization."""
    return dict(
        lr=o.muon_lr,
        momentum=o.muon_momentum_start if o.muon_momentum_warmup_steps else o.muon_momentum,
        weight_decay=o.muon_weight_decay,
        backend=o.muon_backend,
        ns_steps=o.muon_ns_steps,
        ns_form=o.muon_ns_form,
        ns_coefficients=tuple(o.muon_ns_coefficients),
        ns_dtype=ns_dtype,
    )


def sharded_optimizer(cfg: Config) -> bool:
    """Whether the run's optimizer communicates itself (no DDP around the model)."""
    return cfg.optim.name in TABLE_OPTIMIZERS


def build_table_optimizer(
    model: torch.nn.Module, cfg: Config, entries: list[Entry] | None = None
) -> ShardedNorMuonAdam:
    """The 2025–26 optimizer from the model's parameter table (optim/table.py) and the recipe (NorMuon, or
    #92's ANVIL under optim.name = "anvil"); with `optim.tie_until` the embedding starts as a copy of the
    head (HEAD: embed = lm_headᵀ)."""
    o = cfg.optim
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rows = build_rows(entries or model_rules(model, cfg), world)
    adam = adam_groups(run_rules(cfg), {r.label for r in rows if r.rule == "adam"})
    tie = None
    if o.tie_until:
        embed, head = model.wte.weight, model.lm_head.weight
        assert embed.shape == head.shape, "config checks guarantee one shape"
        with torch.no_grad():
            embed.copy_(head)
        tie = (embed, head, o.tie_until)
    start = o.muon_momentum_start if o.muon_momentum_warmup_steps else o.muon_momentum
    ns_dtype = muon_ns_dtype(o.muon_ns_dtype, model.lm_head.weight.device)
    frozen = ("scalar",) if o.scalar_freeze_steps else ()
    if o.name == "anvil":
        rails = Rails(
            o.anvil_slow_beta, o.anvil_fast_beta, o.anvil_fast_weight, o.anvil_engage_step, o.anvil_margin,
            o.anvil_eps,
        )  # fmt: skip
        return ShardedAnvilAdam(
            rows, adam, muon_lr=o.muon_lr, momentum=start, beta2=o.normuon_beta2,
            muon_weight_decay=o.muon_weight_decay, rails=rails, ns_dtype=ns_dtype, adam_every=o.adam_every,
            every4_from=o.value_embed_every4_from, square_stats=o.normuon_square_stats, frozen_labels=frozen,
            tie=tie,
        )  # fmt: skip
    return ShardedNorMuonAdam(
        rows,
        adam,
        muon_lr=o.muon_lr,
        momentum=start,
        beta2=o.normuon_beta2,
        muon_weight_decay=o.muon_weight_decay,
        backend=o.muon_backend,
        ns_steps=o.muon_ns_steps,
        ns_dtype=ns_dtype,
        ns_form=o.muon_ns_form,
        adam_every=o.adam_every,
        square_stats=o.normuon_square_stats,
        frozen_labels=frozen,
        tie=tie,
    )


def muon_ns_dtype(asked: str, device: torch.device | None) -> torch.dtype:
    """Precision of Muon's iterations: bf16 as the records, unless `auto` finds that the device runs
    bf16 matmuls slowly (a CPU without bf16 instructions: ~100x slower than fp32)."""
    if asked == "auto":
        asked = "bf16" if device is None or fast_bf16(device.type)[0] else "fp32"
    return torch.bfloat16 if asked == "bf16" else torch.float32
