"""#92's terminal ships (record #92 ANVIL2, PR #360; its refactor's track_1_short/tail_average.py): fp32
accumulators of the last steps' weights, written into the weights after the last step, on the clock. The
table of ships, windows, cadences and blends is config/ships.py's docstring; ANVIL's bank tail-blend keeps
its cadence in optim/anvil.py.

The record's banks are found by label (model/labels.py), never by name: qk is the Q and K blocks of every
``qkv`` weight, vo its V block and every ``attn_out``, mlp every ``mlp_in`` and ``mlp_out``; embed, head and
value_embed are their labels' weights.

Sharded as the record, but by element: a group's weights, flattened and concatenated, are split in
``world`` equal chunks; each rank ticks its own chunk of every accumulator (fp32), and at the ship writes its
chunk into the weights and all-gathers the group. Every op is elementwise, so the shipped weights do not
depend on the world size; the decontraction's norms are taken on the gathered weights, identical on every
rank. ``state_dict`` gathers the accumulators (a collective), so a run saved on 2 processes resumes on 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from speedrun.config.ships import ShipsConfig
from speedrun.model.labels import labelled
from speedrun.optim.anvil import bank_blend_rate, bank_blends

#: the record's bank names, and those its decontraction rescales (its DECONTRACTION_LABELS)
GROUPS = ("embed", "head", "value_embed", "qk", "vo", "mlp")
DECONTRACTED = ("embed", "head", "mlp", "qk", "vo")
_WHOLE = {"embed": "embed", "head": "head", "value_embed": "value_embed", "mlp_in": "mlp", "mlp_out": "mlp"}


@dataclass(frozen=True)
class Piece:
    """Rows [lo, hi) of a parameter (hi = -1: all of them), read through ``.data`` at each use."""

    param: Tensor
    lo: int = 0
    hi: int = -1

    def view(self) -> Tensor:
        d = self.param.data
        return d if self.hi < 0 else d[self.lo : self.hi]


def bank_pieces(model: nn.Module) -> dict[str, list[Piece]]:
    """The record's banks of ``model``'s weights, by label, in parameter order (empty groups left out)."""
    out: dict[str, list[Piece]] = {g: [] for g in GROUPS}
    for _, p, lab in labelled(model):
        if lab is None:
            continue
        if lab.name in _WHOLE:
            out[_WHOLE[lab.name]].append(Piece(p))
        elif lab.name == "attn_out":
            out["vo"].append(Piece(p))
        elif lab.name == "qkv":
            assert p.ndim == 2 and len(lab.blocks) == 3, "a qkv weight names its (q, k, v) rows"
            qk = lab.blocks[0] + lab.blocks[1]
            if qk:
                out["qk"].append(Piece(p, 0, qk))
            if lab.blocks[2]:
                out["vo"].append(Piece(p, qk, qk + lab.blocks[2]))
    return {g: pieces for g, pieces in out.items() if pieces}


class Flat:
    """One group's weights as a flat vector split in ``world`` chunks; this rank's chunk as segments
    (piece index, start, end in the piece, start in the chunk)."""

    def __init__(self, pieces: list[Piece], world: int, rank: int) -> None:
        assert all(p.view().is_contiguous() for p in pieces), "a ship reads its weights flat"
        self.pieces, self.world = pieces, world
        self.sizes = [p.view().numel() for p in pieces]
        self.n = sum(self.sizes)
        self.chunk = math.ceil(self.n / world)
        lo, hi = min(rank * self.chunk, self.n), min((rank + 1) * self.chunk, self.n)
        self.lo, self.own = lo, hi - lo
        self.segments: list[tuple[int, int, int, int]] = []
        offset = 0
        for i, size in enumerate(self.sizes):
            a, b = max(lo, offset), min(hi, offset + size)
            if a < b:
                self.segments.append((i, a - offset, b - offset, a - lo))
            offset += size

    def weights(self) -> list[tuple[Tensor, slice]]:
        """This rank's weights as (flat view into a parameter, its slice of the chunk)."""
        out = []
        for i, a, b, at in self.segments:
            out.append((self.pieces[i].view().view(-1)[a:b], slice(at, at + b - a)))
        return out

    def gather(self, chunk: Tensor) -> Tensor:
        """Every rank's fp32 ``chunk`` (its own elements, padded to ``self.chunk``) as the group's vector."""
        if self.world == 1:
            return chunk[: self.n]
        full = torch.empty(self.chunk * self.world, dtype=chunk.dtype, device=chunk.device)
        dist.all_gather_into_tensor(full, chunk.contiguous())
        return full[: self.n]

    def padded(self, values: Tensor) -> Tensor:
        out = torch.zeros(self.chunk, dtype=torch.float32, device=values.device)
        out[: self.own].copy_(values)
        return out

    def write_all(self, full: Tensor) -> None:
        """Every piece from the group's vector ``full``."""
        offset = 0
        for piece, size in zip(self.pieces, self.sizes, strict=True):
            w = piece.view()
            w.copy_(full[offset : offset + size].view_as(w))
            offset += size

    def norm(self) -> Tensor:
        """The group's Frobenius norm in fp32 (a bank's ``p.float().norm()``), from its pieces' norms."""
        return torch.linalg.vector_norm(torch.stack([p.view().float().norm() for p in self.pieces]))


@dataclass
class Ship:
    """One accumulator: its groups, when it ticks (``rate(step, stepped)``: None = no tick; ``stepped``
    says whether the value embeddings' Adam stepped), and how far each group ships (None: replaced)."""

    tag: str
    groups: tuple[str, ...]
    rate: Callable[[int, bool], float | None]
    blend: dict[str, float | None]
    acc: dict[str, Tensor] = field(default_factory=dict)
    seeded: set[str] = field(default_factory=set)


def tail_ema_rate(step: int, total: int, window: int) -> float | None:
    """#92's tail EMA, ticked on odd (Adam) steps: two per-step updates at r = 2/(window + 1) fold into one
    at 1 − (1 − r)²; an even step ticks only where the window starts (seeding), the last step at r."""
    if step < total - window:
        return None
    r = 2.0 / (window + 1)
    if step % 2 == 0:
        return r if step == total - window else None
    return r if step == total - 1 else -math.expm1(2.0 * math.log1p(-r))


def record_ships(s: ShipsConfig, total: int) -> list[Ship]:
    """The configured ships in the record's ship order (the bank blend last)."""
    ships = []
    if s.tail_ema_window:
        blend = s.tail_ema_blend

        def ema(step: int, _: bool, w: int = s.tail_ema_window) -> float | None:
            return tail_ema_rate(step, total, w)

        ships.append(Ship("tail-ema", ("head", "embed"), ema, {"head": blend, "embed": blend}))
    if s.tail_avg_window:

        def avg(
            step: int, _: bool, w: int = s.tail_avg_window, every: int = s.tail_avg_every
        ) -> float | None:
            return s.tail_avg_rate if step >= total - w and (total - 1 - step) % every == 0 else None

        ships.append(Ship("tail-avg", ("vo", "mlp"), avg, {"vo": None, "mlp": None}))
    if s.value_embed_window:

        def values(step: int, stepped: bool, w: int = s.value_embed_window) -> float | None:
            return s.value_embed_rate if step >= total - w and stepped else None

        ships.append(Ship("value-embed-avg", ("value_embed",), values, {"value_embed": None}))
    if s.bank_blend_window:

        def bank(
            step: int, _: bool, w: int = s.bank_blend_window, every: int = s.bank_blend_every
        ) -> float | None:
            return bank_blend_rate(step, total, w, every)

        blends: dict[str, float | None] = dict(bank_blends(s.bank_blend, s.bank_blend_richardson))
        ships.append(Ship("bank-blend", ("qk", "vo", "mlp"), bank, blends))
    return ships


def accumulator_bytes(model: nn.Module, s: ShipsConfig, total: int, world: int) -> int:
    """The fp32 accumulators one process of `world` holds for the configured ships (rank 0's chunks, the
    largest): what `Ships` allocates, counted without allocating (the memory estimate's share)."""
    flats = {g: Flat(pieces, world, 0) for g, pieces in bank_pieces(model).items()}
    return sum(4 * flats[g].own for ship in record_ships(s, total) for g in ship.groups if g in flats)


class Ships:
    """The run's ships over ``model``'s weights; ``after_step(s)`` after optimizer step s (0-based),
    ``ship()`` once after the last. ``value_embed_steps``: a count the value embeddings' Adam raises when it
    steps (the table optimizer's ``adam_steps`` of their group); None: they step every step."""

    def __init__(self, model: nn.Module, s: ShipsConfig, total: int) -> None:
        on = dist.is_available() and dist.is_initialized()
        world, rank = (dist.get_world_size(), dist.get_rank()) if on else (1, 0)
        self.flats = {g: Flat(pieces, world, rank) for g, pieces in bank_pieces(model).items()}
        self.decontract = s.decontract
        self.ships = record_ships(s, total)
        for ship in self.ships:  # allocated now: a first tick allocating would land on the clock
            ship.groups = tuple(g for g in ship.groups if g in self.flats)
            for g in ship.groups:
                ship.acc[g] = torch.zeros(
                    self.flats[g].own, dtype=torch.float32, device=_device(self.flats[g])
                )
        self.value_embed_steps: Callable[[], int] | None = None
        self._before: int | None = None

    def before_step(self) -> None:
        self._before = self.value_embed_steps() if self.value_embed_steps is not None else None

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        """Fold the weights after optimizer step ``step`` into every accumulator that ticks there."""
        stepped = self.value_embed_steps is None or self.value_embed_steps() != self._before
        for ship in self.ships:
            rate = ship.rate(step, stepped)
            if rate is None:
                continue
            for g in ship.groups:
                acc = ship.acc[g]
                for w, at in self.flats[g].weights():
                    if g in ship.seeded:
                        acc[at].lerp_(w.float(), rate)
                    else:
                        acc[at].copy_(w)
                ship.seeded.add(g)

    @torch.no_grad()
    def ship(self) -> None:
        """Write the accumulators into the weights in ship order, gather, then decontract."""
        kept = [g for g in DECONTRACTED if g in self.flats] if self.decontract else []
        before = torch.stack([self.flats[g].norm() for g in kept]) if kept else None
        shipped: list[str] = []
        for ship in self.ships:
            for g in ship.groups:
                assert g in ship.seeded, f"the {ship.tag} ship never ticked {g} (its window is too short)"
                b, acc = ship.blend[g], ship.acc[g]
                for w, at in self.flats[g].weights():
                    new = acc[at] if b is None else torch.lerp(w.float(), acc[at], b)
                    w.copy_(new.to(w.dtype))
                if g not in shipped:
                    shipped.append(g)
        for g in shipped:  # each rank wrote its own chunk: one gather per shipped group
            flat = self.flats[g]
            if flat.world > 1:
                mine = [w.float() for w, _ in flat.weights()]
                device = _device(flat)
                own = torch.cat(mine) if mine else torch.zeros(0, device=device)
                flat.write_all(flat.gather(flat.padded(own)))
        if before is not None:
            after = torch.stack([self.flats[g].norm() for g in kept])
            # Python floats, so each product rounds to the weight's dtype once, on the store (as the record)
            ratios = torch.where(after > 0, before / after, torch.ones_like(after)).tolist()
            for g, ratio in zip(kept, ratios, strict=True):
                for piece in self.flats[g].pieces:
                    piece.view().mul_(ratio)

    def describe(self) -> str:
        """One log line: the ships in order with their banks, and the accumulators' bytes on this process."""
        parts = [f"{ship.tag} ({', '.join(ship.groups)})" for ship in self.ships]
        parts += ["decontraction"] if self.decontract else []
        held = sum(a.numel() * 4 for ship in self.ships for a in ship.acc.values())
        return f"ships after the last step, on the clock: {', '.join(parts)}; {held:,} bytes per process"

    def state_dict(self) -> dict[str, object]:
        """The accumulators whole (a collective: every rank calls it) and which are seeded."""
        acc = {
            ship.tag: {
                g: self.flats[g].gather(self.flats[g].padded(ship.acc[g])).clone() for g in ship.groups
            }
            for ship in self.ships
        }
        return {"accumulators": acc, "seeded": {ship.tag: sorted(ship.seeded) for ship in self.ships}}

    def load_state_dict(self, state: dict[str, object]) -> None:
        acc, seeded = state["accumulators"], state["seeded"]
        assert {s.tag for s in self.ships} == set(acc), "ships state of another configuration"
        for ship in self.ships:
            for g in ship.groups:
                flat = self.flats[g]
                ship.acc[g].copy_(acc[ship.tag][g][flat.lo : flat.lo + flat.own])
            ship.seeded = set(seeded[ship.tag])


def _device(flat: Flat) -> torch.device:
    return flat.pieces[0].param.device
