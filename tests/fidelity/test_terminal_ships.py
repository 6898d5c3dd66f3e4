"""#92's terminal ships (optim/ships.py, config/ships.py, optim/anvil.py's bank tail-blend) against the
record's formulas, transcribed here from its refactor's track_1_short/tail_average.py (PR #373 of record
#92, PR #360): each ship across its start step, the ships in order on a small labelled model,
decontraction, the state dict, and 1 against 2 gloo processes."""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from speedrun.config.ships import RECORD_92, ShipsConfig
from speedrun.errors import ConfigError
from speedrun.model.labels import label
from speedrun.optim.ships import Ships
from speedrun.recipes import load_recipe

N = 1194  # #92: 1,122 scheduled + 52 grown + 20 extension steps
# #92's ships with the windows scaled to a 60-step run
ALL_ON = ShipsConfig(
    tail_ema_window=29, tail_avg_window=25, value_embed_window=25, bank_blend_window=29, decontract=True
)


# ---- the record's formulas, transcribed (tail_average.py, ngram_table.is_update_step) ----
def record_tail_ema_rate(step: int, total: int, window: int = 298) -> float | None:
    r = 2.0 / (window + 1)
    if step % 2 == 0:
        return r if step == total - window else None
    return r if step == total - 1 else 1.0 - (1.0 - r) ** 2


def record_is_update_step(step: int) -> bool:
    return step % 4 == 3 if step >= 336 else step % 2 == 1


def record_rates(total: int, window: dict[str, int]) -> dict[str, callable]:
    """tag -> rate(step) as TailAverages builds them (None: no tick), the window checked first."""
    rules = {
        "tail-ema": lambda s: record_tail_ema_rate(s, total, window["tail-ema"]),
        "tail-avg": lambda s: 4.0 / 53.0 if (total - 1 - s) % 4 == 0 else None,
        "value-embed-avg": lambda s: 4.0 / 53.0 if record_is_update_step(s) else None,
        "bank-blend": lambda s: (
            2.0 / (window["bank-blend"] // 4 + 1) if s % 4 == 1 or s >= total - 2 else None
        ),
    }
    return {tag: (lambda s, tag=tag: None if s < total - window[tag] else rules[tag](s)) for tag in window}


RECORD_LABELS = {  # tag -> {record bank: blend (None = replaced)}, in the record's ship order
    "tail-ema": {"lm_head": 0.65, "embed": 0.65},
    "tail-avg": {"vo_bank": None, "mlp_bank": None},
    "value-embed-avg": {"value_embeds": None},
    "bank-blend": {"qk_bank": 0.55, "vo_bank": 0.55 - 0.2007, "mlp_bank": 0.55 - 0.2007},
}
DECONTRACTION_LABELS = ("embed", "lm_head", "mlp_bank", "qk_bank", "vo_bank")


class Labelled(nn.Module):
    """Every weight a ship reads, labelled as the gpt2026 parts label them: two layers of fused QKV with
    (q, k, v) blocks, attention output, MLP in/out; embedding, head, value embeddings; a scalar no ship
    reads."""

    def __init__(self, dtype: torch.dtype = torch.float32, d: int = 8, qk: int = 4, vocab: int = 12) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)

        def p(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=g).to(dtype))

        self.qkv = nn.ParameterList([label(p(2 * qk + d, d), "qkv", blocks=(qk, qk, d)) for _ in range(2)])
        self.out = nn.ParameterList([label(p(d, d), "attn_out") for _ in range(2)])
        self.mlp_in = nn.ParameterList([label(p(4 * d, d), "mlp_in") for _ in range(2)])
        self.mlp_out = nn.ParameterList([label(p(d, 4 * d), "mlp_out") for _ in range(2)])
        self.embed = label(p(vocab, d), "embed")
        self.head = label(p(vocab, d), "head")
        self.ve = label(p(3 * vocab, d), "value_embed")
        self.gain = label(p(d), "scalar")
        self.qk = qk

    def banks(self) -> dict[str, torch.Tensor]:
        """The record's banks as one flat fp64 vector each (independent of optim/ships.py's pieces)."""
        q = self.qk
        cat = lambda ts: torch.cat([t.detach().double().reshape(-1) for t in ts])  # noqa: E731
        return {
            "qk_bank": cat([w[: 2 * q] for w in self.qkv]),
            "vo_bank": cat([w[2 * q :] for w in self.qkv] + list(self.out)),
            "mlp_bank": cat(list(self.mlp_in) + list(self.mlp_out)),
            "embed": cat([self.embed]),
            "lm_head": cat([self.head]),
            "value_embeds": cat([self.ve]),
        }


def drive(model: Labelled, ships: Ships | None, total: int, ref: dict | None = None, start: int = 0) -> None:
    """Fake optimizer steps `start`..`total` - 1: each moves every weight (the value embeddings only at their
    Adam steps, the rest of Adam's only on odd steps, as #92), then ticks the ships and the record's
    reference."""
    counter = [sum(record_is_update_step(s) for s in range(start))]
    if ships is not None:
        ships.value_embed_steps = lambda: counter[0]
    for s in range(start, total):
        if ships is not None:
            ships.before_step()
        g = torch.Generator().manual_seed(100 + s)
        with torch.no_grad():
            for name, w in model.named_parameters():
                step = torch.randn(w.shape, generator=g).to(w.dtype) * 0.05
                moves = {"ve": record_is_update_step(s), "embed": s % 2 == 1, "head": s % 2 == 1}
                if moves.get(name, True):
                    w.add_(step)
        if record_is_update_step(s):
            counter[0] += 1
        if ships is not None:
            ships.after_step(s)
        if ref is not None:
            record_tick(ref, model, s)


def record_tick(ref: dict, model: Labelled, step: int) -> None:
    """TailAverages.tick in fp64: the first tick copies, later ones lerp."""
    banks = model.banks()
    for tag, rate in ref["rates"].items():
        r = rate(step)
        if r is None:
            continue
        for lab in RECORD_LABELS[tag]:
            bufs = ref["bufs"].setdefault(tag, {})
            bufs[lab] = banks[lab].clone() if lab not in bufs else bufs[lab] + r * (banks[lab] - bufs[lab])


def record_ship(ref: dict, banks: dict[str, torch.Tensor], decontract: bool) -> dict[str, torch.Tensor]:
    """TailAverages.ship in fp64: ship order, then every bank rescaled to its norm before the ships."""
    out = dict(banks)
    before = {lab: out[lab].norm() for lab in DECONTRACTION_LABELS}
    for tag in RECORD_LABELS:
        if tag not in ref["rates"]:
            continue
        for lab, b in RECORD_LABELS[tag].items():
            avg = ref["bufs"][tag][lab]
            out[lab] = avg.clone() if b is None else (1 - b) * out[lab] + b * avg
    if decontract:
        for lab in DECONTRACTION_LABELS:
            out[lab] = out[lab] * (before[lab] / out[lab].norm())
    return out


def run_both(cfg: ShipsConfig, total: int, window: dict[str, int]) -> tuple[dict, dict]:
    model = Labelled()
    ships = Ships(model, cfg, total)
    ref = {"rates": record_rates(total, window), "bufs": {}}
    drive(model, ships, total, ref)
    expected = record_ship(ref, model.banks(), cfg.decontract)
    ships.ship()
    return model.banks(), expected


def assert_close(got: dict, want: dict) -> None:
    for lab in want:
        err = (got[lab] - want[lab]).abs().max().item() / want[lab].abs().max().item()
        assert err < 2e-6, (lab, err)


# ---- cadences at #92's size ----
def test_tick_steps_at_92s_size_are_the_records():
    """Each ship's tick steps over #92's 1,194 steps equal the record's (windows 298/250/250/298)."""
    ships = Ships(Labelled(), RECORD_92, N)
    rates = record_rates(N, {"tail-ema": 298, "tail-avg": 250, "value-embed-avg": 250, "bank-blend": 298})
    for ship in ships.ships:
        for s in range(N):
            want = rates[ship.tag](s)
            got = ship.rate(s, record_is_update_step(s))
            same = got is None or math.isclose(got, want, rel_tol=1e-12)
            assert (got is None) == (want is None) and same, (
                ship.tag, s, got, want,
            )  # fmt: skip
    ticks = {
        ship.tag: [s for s in range(N) if ship.rate(s, record_is_update_step(s)) is not None]
        for ship in ships.ships
    }
    assert ticks["tail-ema"][:2] == [896, 897] and ticks["tail-ema"][-1] == 1193  # seeds on an even step
    assert ticks["tail-avg"][0] == 945 and ticks["tail-avg"][-1] == 1193 and len(ticks["tail-avg"]) == 63
    assert ticks["value-embed-avg"][0] == 947 and ticks["value-embed-avg"][-1] == 1191
    assert ticks["bank-blend"][0] == 897 and ticks["bank-blend"][-3:] == [1189, 1192, 1193]


# ---- each ship alone, across its start step ----
@pytest.mark.parametrize("total", [40, 41, 42, 43])  # the window's start on each step parity / residue
@pytest.mark.parametrize(
    "tag,cfg,window",
    [
        ("tail-ema", ShipsConfig(tail_ema_window=15), 15),
        ("tail-ema", ShipsConfig(tail_ema_window=14), 14),
        ("tail-avg", ShipsConfig(tail_avg_window=13), 13),
        ("value-embed-avg", ShipsConfig(value_embed_window=13), 13),
        ("bank-blend", ShipsConfig(bank_blend_window=15), 15),
    ],
)
def test_each_ship_equals_the_records_formula(tag, cfg, window, total, monkeypatch):
    monkeypatch.setitem(globals(), "record_is_update_step", _short_cadence)  # #92's cadence, 336 → 20
    got, want = run_both(cfg, total, {tag: window})
    assert_close(got, want)
    untouched = set(want) - set(RECORD_LABELS[tag])
    for lab in untouched:  # no other weight moved at the ship
        assert torch.equal(got[lab], want[lab]), lab


def _short_cadence(step: int) -> bool:
    return step % 4 == 3 if step >= 20 else step % 2 == 1


# ---- all four in order, then decontraction ----
def test_ships_in_order_with_decontraction_equal_the_record():
    """#92's ships together on 60 steps (windows scaled down): the bank blend lerps vo and mlp from the tail
    average already shipped, then every bank is rescaled to its norm before the ships."""
    cfg = ALL_ON
    got, want = run_both(cfg, 60, {"tail-ema": 29, "tail-avg": 25, "value-embed-avg": 25, "bank-blend": 29})
    assert_close(got, want)


def test_bank_blend_after_tail_average_differs_from_the_other_order():
    """The order matters (so the test above can fail on it): shipping the blend before the average gives
    other vo weights."""
    cfg = ShipsConfig(tail_avg_window=25, bank_blend_window=29)
    got, _ = run_both(cfg, 60, {"tail-avg": 25, "bank-blend": 29})
    model = Labelled()
    ships = Ships(model, cfg, 60)
    drive(model, ships, 60)
    ships.ships.reverse()
    ships.ship()
    assert (model.banks()["vo_bank"] - got["vo_bank"]).abs().max() > 1e-3


def test_bf16_weights_ship_through_one_rounding():
    """bf16 weights (#92's banks): the accumulators are fp32, each shipped weight rounds once."""
    model = Labelled(torch.bfloat16)
    cfg = ShipsConfig(tail_avg_window=9)
    ships = Ships(model, cfg, 20)
    drive(model, ships, 20)
    acc = ships.ships[0].acc
    ships.ship()
    assert torch.equal(model.mlp_in[0].detach(), acc["mlp"][: model.mlp_in[0].numel()].view(32, 8).bfloat16())


def test_state_dict_round_trip_continues_exactly():
    cfg = ShipsConfig(tail_ema_window=15, bank_blend_window=15, decontract=True)
    a, b = Labelled(), Labelled()
    sa, sb = Ships(a, cfg, 30), Ships(b, cfg, 30)
    drive(a, sa, 30)
    drive(b, sb, 22)
    sb.load_state_dict(sa.state_dict())  # a's accumulators into b, then b's weights made a's
    b.load_state_dict(a.state_dict())
    sa.ship()
    sb.ship()
    for (n, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(x, y), n


# ---- every key acts ----


def _shipped(cfg: ShipsConfig) -> list[torch.Tensor]:
    model = Labelled()
    ships = Ships(model, cfg, 60)
    drive(model, ships, 60)
    ships.ship()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("key", [f.name for f in dataclasses.fields(ShipsConfig)])
def test_every_ships_key_changes_the_shipped_weights(key):
    value = getattr(ALL_ON, key)
    other = (not value) if isinstance(value, bool) else value - 2 if isinstance(value, int) else value * 0.9
    before, after = _shipped(ALL_ON), _shipped(dataclasses.replace(ALL_ON, **{key: other}))
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)), key


# ---- config ----
def test_config_keys_and_their_checks():
    fixed = ["train.time_budget_s=0", "train.steps=100"]
    cfg = load_recipe("demo-2026", [*fixed, "optim.ships.tail_avg_window=10", "optim.ships.decontract=true"])
    assert cfg.optim.ships.tail_avg_window == 10 and cfg.optim.ships.on()
    assert not load_recipe("demo-2026").optim.ships.on()
    with pytest.raises(ConfigError, match="optim.ships.bank_blend_window"):
        load_recipe("demo-2026", [*fixed, "optim.ships.bank_blend_window=300"])
    with pytest.raises(ConfigError, match="bank_blend_richardson"):
        load_recipe("demo-2026", [*fixed, "optim.ships.bank_blend_window=30", "optim.ships.bank_blend=0.1"])
    anvil = ["optim.name=anvil", "optim.value_embed_every4_from=60"]
    with pytest.raises(ConfigError, match="value_embed_every4_from"):
        load_recipe("demo-2026", [*fixed, *anvil, "optim.ships.value_embed_window=41"])
    load_recipe("demo-2026", [*fixed, *anvil, "optim.ships.value_embed_window=40"])
    with pytest.raises(ConfigError, match="time_budget_s"):
        load_recipe("demo-2026", ["optim.ships.decontract=true"])


# ---- 1 against 2 gloo processes ----
def _two_process_worker(rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model = Labelled(torch.bfloat16, d=6, qk=2, vocab=7)  # flats that the world size does not divide
        cfg = ALL_ON
        ships = Ships(model, cfg, 60)
        drive(model, ships, 40)
        state = ships.state_dict()  # gathered: the same on every rank
        drive(model, ships, 60, start=40)
        ships.ship()
        if rank == 0:
            torch.save({"weights": model.state_dict(), "state": state}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_processes_ship_the_weights_of_one():
    """Each rank ticks its chunk of every accumulator and gathers at the ship: the shipped weights on 2
    processes equal 1 process's bit for bit, and the gathered state too (so a save on 2 resumes on 1)."""
    model = Labelled(torch.bfloat16, d=6, qk=2, vocab=7)
    cfg = ALL_ON
    ships = Ships(model, cfg, 60)
    drive(model, ships, 40)
    state = ships.state_dict()
    drive(model, ships, 60, start=40)
    ships.ship()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pt")
        mp.spawn(_two_process_worker, args=(2, f"file://{tmp}/init", out), nprocs=2)
        two = torch.load(out)
    for name, w in model.state_dict().items():
        assert torch.equal(w, two["weights"][name]), name
    for tag, groups in state["accumulators"].items():
        for g, acc in groups.items():
            assert torch.equal(acc, two["state"]["accumulators"][tag][g]), (tag, g)
    resumed = Labelled(torch.bfloat16, d=6, qk=2, vocab=7)
    rs = Ships(resumed, cfg, 60)
    drive(resumed, None, 40)
    rs.load_state_dict(two["state"])
    drive(resumed, rs, 60, start=40)
    rs.ship()
    for name, w in model.state_dict().items():
        assert torch.equal(w, resumed.state_dict()[name]), name


# ---- the loop: ticked after each step, shipped on the clock, one validation at the end ----
@pytest.mark.slow  # ~30 s on a busy 2-core host: two 12-step runs
def test_the_loop_ships_after_the_last_step_and_validates_once(text_data, tmp_path):
    """demo-2026 shrunk, ANVIL, every ship (windows scaled to 12 steps), `train.val_every=0`: one validation,
    at the end, of the shipped weights (its loss differs from the same run without ships; the steps before
    it are the same), and the ship's seconds are training time."""
    import json

    from speedrun.train import loop

    eot = json.loads((text_data / "meta.json").read_text())["eot_id"]
    over = [f"data.dir={text_data}", "data.tokenizer=bpe:512", "model.vocab_size=512", f"model.eot_id={eot}",
            "model.n_embd=64", "model.n_head=2", "model.bigram_rows=2048", "model.bigram_sign_rows=64",
            "model.max_seq_len=1024", "model.window=256", "train.seq_len=1024",
            "train.micro_batch_tokens=1024", "train.global_batch_tokens=1024", "train.steps=12",
            "train.warmdown_steps=4", "train.val_every=0", "train.val_tokens=2048", "train.time_budget_s=0",
            "train.budget_min_steps=0", "train.timing_warmup_steps=0", "train.dtype=fp32",
            "train.log_every=1", "optim.name=anvil", "optim.anvil_engage_step=3",
            "optim.value_embed_every4_from=4"]  # fmt: skip
    ships = ["optim.ships.tail_ema_window=6", "optim.ships.tail_avg_window=5",
             "optim.ships.value_embed_window=8", "optim.ships.bank_blend_window=6",
             "optim.ships.decontract=true"]  # fmt: skip
    runs = {}
    ships.append("train.checkpoint_at_end=true")
    for name, extra in (("plain", []), ("ships", ships)):
        loop.train(load_recipe("demo-2026", [*over, *extra]), tmp_path / name)
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        runs[name] = [json.loads(x) for x in lines]
    val = {k: [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r] for k, recs in runs.items()}
    assert [s for s, _ in val["ships"]] == [12] and [s for s, _ in val["plain"]] == [12]
    assert math.isfinite(val["ships"][0][1]) and val["ships"][0][1] != val["plain"][0][1]
    train = {k: [r["train_loss"] for r in recs if "train_loss" in r] for k, recs in runs.items()}
    assert train["ships"] == train["plain"]  # the ships never touch the training steps
    last_step_time = [r["time_s"] for r in runs["ships"] if "train_loss" in r][-1]
    assert val["ships"] and [r["time_s"] for r in runs["ships"] if "val_loss" in r][0] > last_step_time
    log = (tmp_path / "ships" / "log.txt").read_text()
    assert "ships after the last step, on the clock: tail-ema (head, embed), tail-avg (vo, mlp)" in log
    # killed during the ship or the validation: the end's checkpoint holds the pre-ship weights and the
    # accumulators, so the resumed run ships again and validates the same weights
    metrics = tmp_path / "ships" / "metrics.jsonl"
    metrics.write_text("".join(x + "\n" for x in metrics.read_text().splitlines() if "val_loss" not in x))
    loop.train(load_recipe("demo-2026", [*over, *ships]), tmp_path / "ships", resume=True)
    again = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [(r["step"], r["val_loss"]) for r in again if "val_loss" in r] == val["ships"]
