"""The recipe's label table, `[optim.labels]` (issue 25; modded-nanogpt's param_table): stated rows
over the rows derived from the flat `[optim]` fields. A table equal to the derived one builds the same
optimizer for every bundled recipe and trains bit for bit the same; banks-2026-01's stated table is
record #65's param_table; every mistake in a table is one line and exit 2."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from speedrun.cli import main
from speedrun.config.checks import validate
from speedrun.config.families import model_facts
from speedrun.config.files import set_value
from speedrun.config.labels import RULE_KEYS, derived_rows, format_table, label_table
from speedrun.model.families import build_model
from speedrun.optim.build import build_optimizer, model_rules, run_rules
from speedrun.optim.table import build_rows
from speedrun.recipes import load_recipe, recipe_names
from speedrun.train.schedule import apply_schedule, schedule_at
from speedrun.train.step import autocast_dtype, train_step
from tests.recipe_matrix import STEPS, batch, rows, shrink

#: the recipes whose optimizer trains by label (an AdamW recipe refuses a table: tested below)
LABELLED = [n for n in recipe_names() if load_recipe(n).optim.name != "adamw"]


def _stated_as_derived(cfg, model) -> str:
    """`optim.labels` as JSON: the derived row of every label the model carries, every key written."""
    table = derived_rows(cfg.optim, model_facts(cfg.model).qk_head_dim)  # #344: Q/K's own width
    carried = {e.label.name for e in model_rules(model, dataclasses.replace(cfg, optim=_without_table(cfg)))}
    return json.dumps(
        {lab: {k: getattr(table[lab], k) for k in RULE_KEYS[table[lab].rule]} for lab in sorted(carried)}
    )


def _without_table(cfg):
    return dataclasses.replace(cfg.optim, labels={})


def _pair(name: str, *extra: str):
    """The shrunk recipe without a stated table (every row derived) and with one equal to the derived."""
    cfg = load_recipe(name, [*shrink(name), *extra])
    derived = dataclasses.replace(cfg, optim=_without_table(cfg))
    stated = dataclasses.replace(cfg, optim=_without_table(cfg))
    with torch.device("meta"):
        set_value(stated, "optim.labels", _stated_as_derived(cfg, build_model(cfg.model)))
    validate(stated)
    return derived, stated


def _same(a, b, where: str = "") -> None:
    """Two state dicts (or parts) equal: tensors bit for bit, everything else by ==."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.parametrize("name", LABELLED)
def test_a_stated_table_equal_to_the_derived_one_builds_the_same_optimizer(name):
    derived, stated = _pair(name)
    assert stated.optim.labels and not derived.optim.labels
    built = []
    for cfg in (derived, stated):
        torch.manual_seed(0)
        model = build_model(cfg.model)
        names = {id(p): n for n, p in model.named_parameters()}
        opt = build_optimizer(model, cfg)
        groups = [{k: [names[id(p)] for p in v] if k == "params" else v for k, v in g.items()}
                  for g in opt.param_groups]  # fmt: skip
        entries = [(e.name, e.label, e.rule) for e in model_rules(model, cfg)]
        table = opt.parts.get("table")
        extra = (
            [(r.name, r.rule, r.label, r.sharded, r.block_rows, r.lr_mul, r.gate_rows) for r in table.rows]
            if table
            else []
        )
        built.append((entries, groups, extra, table.adam if table else None, opt.state_dict()))
    for what, a, b in zip(
        ("rows", "param groups", "table rows", "adam groups", "state"), *built, strict=True
    ):
        _same(a, b, f"{name} {what}")


def _train(cfg) -> dict[str, torch.Tensor]:
    """STEPS training steps of a shrunk config through the run's step; the weights after them."""
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)
    opt = build_optimizer(model, cfg)
    for step in range(STEPS):
        sched = schedule_at(step, cfg)
        apply_schedule(sched, opt, model)
        x, y = batch(step, cfg)
        it = iter(range(x.shape[0]))

        def next_batch(it=it, x=x, y=y):
            i = next(it)
            return rows(cfg, x[i : i + 1], y[i : i + 1])

        train_step(model, opt, next_batch, x.shape[0], autocast_dtype(cfg), 0.0, sched.grad_scale)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


#: banks-2026-01 on the CPU, as fidelity/test_banks_recipe.py shrinks it (fp32 storage, a small bigram table)
BANKS_CPU = ("model.embed_dtype=fp32", "model.fp8_head=false", "optim.muon_ns_dtype=fp32",
             "optim.tie_until=2", "model.bigram_rows=300", "model.block_dtype=fp32")  # fmt: skip


@pytest.mark.parametrize("name", ["banks-2026-01", "record-2025-01"])  # NorMuon table, Muon + Adam
def test_three_steps_with_a_stated_table_equal_to_the_derived_one_are_bit_for_bit(name):
    """banks-2026-01 trains with its own stated table and without it (every row derived): equal rows,
    equal weights after 3 steps; record-2025-01 (Muon) with and without a table written from its rows."""
    extra = BANKS_CPU if name == "banks-2026-01" else ()
    derived, stated = _pair(name, *extra)
    if name == "banks-2026-01":  # its own table, as the recipe states it
        stated = load_recipe(name, [*shrink(name), *extra])
        assert len(stated.optim.labels) == 13
    plain, table = _train(derived), _train(stated)
    assert plain.keys() == table.keys()
    moved = 0
    for n in plain:
        assert torch.equal(plain[n], table[n]), n
        moved += 1
    assert moved > 10


#: Record #65's param_table (records/track_1_short/2026-01-30_VeFused, TrainingManager), transcribed:
#: label -> (optim, adam_betas, lr_mul, wd_mul); adam_defaults lr 0.008, eps 1e-10, weight_decay 0.005;
#: normuon_defaults lr 0.023, weight_decay 1.2.
PARAM_TABLE_65 = {
    "attn": ("normuon", None, 1.0, 1.0),
    "mlp": ("normuon", None, 1.0, 1.0),
    "scalars": ("adam", (0.9, 0.99), 5.0, 0.0),
    "value_embed": ("adam", (0.75, 0.95), 75.0, 5.0),
    "bigram_embed": ("adam", (0.75, 0.95), 75.0, 5.0),
    "smear_gate": ("adam", (0.9, 0.99), 0.01, 0.0),
    "skip_gate": ("adam", (0.9, 0.99), 0.05, 0.0),
    "attn_gate_bank": ("adam", (0.9, 0.99), 1.0, 1.0),
    "ve_gate_bank": ("adam", (0.9, 0.99), 1.0, 1.0),
    "x0_lambdas": ("adam", (0.65, 0.95), 5.0, 0.0),
    "lm_head": ("adam", (0.5, 0.95), 1.0, 150.0),
    "embed": ("adam", (0.5, 0.95), 1.0, 150.0),
}
#: the record's label -> ours (its banks hold what our labels split: Q/K/V and O, c_fc and c_proj)
OURS_65 = {"attn": ("qkv", "attn_out"), "mlp": ("mlp_in", "mlp_out"), "scalars": ("scalar",),
           "value_embed": ("value_embed",), "bigram_embed": ("bigram",), "smear_gate": ("smear_gate",),
           "skip_gate": ("skip_gate",), "attn_gate_bank": ("gate",), "ve_gate_bank": ("gate",),
           "x0_lambdas": ("x0",), "lm_head": ("head",), "embed": ("embed",)}  # fmt: skip
#: each NorMuon matrix's whole LR multiplier in #65: shape_mult of the bank's (rows, cols) times the mlp
#: bank's per_matrix_lr_mul (2 on c_proj): attn (768, 768) x1; mlp (3072, 768) x2, c_proj x2 again
NORMUON_MUL_65 = {"qkv": 1.0, "attn_out": 1.0, "mlp_in": 2.0, "mlp_out": 4.0}


def test_banks_2026_01_states_record_65s_param_table():
    cfg = load_recipe("banks-2026-01")
    o = cfg.optim
    table = label_table(o, cfg.model.n_embd // cfg.model.n_head)
    ours = {lab for labs in OURS_65.values() for lab in labs}
    assert set(o.labels) == ours  # one stated row per label the record's table covers, no other
    for label, (optim, betas, lr_mul, wd_mul) in PARAM_TABLE_65.items():
        for lab in OURS_65[label]:
            row = table[lab]
            assert row.rule == optim, lab
            if optim == "adam":
                assert math.isclose(row.lr, 0.008 * lr_mul, rel_tol=1e-12), lab
                assert math.isclose(row.wd, 0.005 * wd_mul, rel_tol=1e-12), lab
                assert row.betas == betas and row.eps == 1e-10, lab
    assert (o.muon_lr, o.muon_weight_decay) == (0.023, 1.2)
    with torch.device("meta"):
        model = build_model(cfg.model)
    labels = {e.name: e.label.name for e in model_rules(model, cfg)}
    for r in build_rows(model_rules(model, cfg), 1):
        if r.rule == "normuon":  # our stored shape's multiplier times the row's lr_mul = the record's
            muls = {math.sqrt(max(1.0, rows / r.param.shape[-1])) * r.lr_mul for rows in r.block_rows}
            assert muls == {NORMUON_MUL_65[labels[r.name]]}, r.name


def test_a_stated_row_changes_only_its_label_and_a_group_follows_its_owner():
    cfg = load_recipe("stages-2025-12", ['optim.labels.value_embed={"lr": 0.1, "betas": [0.8, 0.9]}',
                                         "optim.labels.mlp_out.lr_mul=3"])  # fmt: skip
    head_dim = cfg.model.n_embd // cfg.model.n_head
    table, derived = label_table(cfg.optim, head_dim), derived_rows(cfg.optim, head_dim)
    assert table["value_embed"] == dataclasses.replace(derived["value_embed"], lr=0.1, betas=(0.8, 0.9))
    assert table["bigram"] == table["value_embed"]  # #65: the bigram table trains in value_embed's group
    assert table["mlp_out"].lr_mul == 3.0 and table["mlp_out"].split == derived["mlp_out"].split
    assert {k for k in table if table[k] != derived[k]} == {"value_embed", "bigram", "embed2", "mlp_out"}
    own = load_recipe("stages-2025-12", ["optim.labels.bigram.lr=0.1"])  # (its model has none: at build)
    row = run_rules(own)["bigram"]
    assert (row.group, row.lr, row.betas) == ("bigram", 0.1, run_rules(own)["value_embed"].betas)  # own group


S = "stages-2025-12"
REFUSED = [
    (S, ["optim.labels.bigrm.lr=1"], "optim.labels: unknown label 'bigrm' (did you mean bigram?)"),
    (S, ["optim.labels.qkv.rule=sgd"], "optim.labels.qkv.rule: 'sgd' is not one of adam, muon, normuon"),
    (S, ["optim.labels.qkv.lrr=1"], "optim.labels.qkv: unknown key 'lrr' (did you mean lr?)"),
    (S, ["optim.labels.embed.lr=fast"], "optim.labels.embed.lr: expected a number, got 'fast'"),
    (S, ["optim.labels.embed.betas=[0.9]"], "optim.labels.embed.betas: expected 2"),
    (S, ["optim.labels.embed.betas=[0.9,1]"], "optim.labels.embed.betas must be"),
    (S, ["optim.labels.embed=3"], "optim.labels.embed: expected a table"),
    (S, ["optim.labels.qkv.lr=0.1"], "optim.labels.qkv.lr: a row of rule normuon takes only"),
    (S, ["optim.labels.qkv.rule=muon"], "optim.labels.qkv.rule: muon needs optim.name = muon"),
    (S, ["optim.labels.qkv.rule=adam"], "optim.labels.qkv: moving it from normuon to adam needs lr"),
    (S, ['optim.labels.bigram={"group": "value_embed", "lr": 0.1}'],
     "optim.labels.bigram.lr: 0.1 differs from its Adam group value_embed's 0.6"),
    (S, ["optim.labels.value_embed.rule=normuon"], "optim.labels.bigram: its Adam group value_embed"),
    ("gpt2-baseline", ["optim.labels.embed.lr=1"], "optim.labels: optim.name = adamw trains every"),
    ("banks-2026-01", ["optim.head_lr=0.01"], "optim.head_lr does not reach the rows optim.labels states"),
    # at the model: a row no parameter uses, a matrix rule on vectors
    (S, ["optim.labels.bigram.lr=0.1"], "optim.labels.bigram: no parameter of this model has label"),
    (S, ["optim.labels.scalar.rule=normuon"], "has label 'scalar', whose rule normuon trains matrices"),
]  # fmt: skip


@pytest.mark.parametrize("recipe, overrides, message", REFUSED)
def test_a_bad_table_is_one_line_and_exit_2(recipe, overrides, message, capsys):
    assert main(["train", "--dry-run", "--recipe", recipe, *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("speedrun: error: ") and message in err[0], err


def test_a_recipe_file_states_rows_and_a_bad_one_names_its_key(tmp_path, capsys):
    good = tmp_path / "mine.toml"
    good.write_text('base = "stages-2025-12"\n[optim.labels]\nhead = { lr = 0.02, betas = [0.8, 0.95] }\n')
    cfg = load_recipe(str(good))
    assert (run_rules(cfg)["head"].lr, run_rules(cfg)["head"].betas) == (0.02, (0.8, 0.95))
    bad = tmp_path / "bad.toml"
    bad.write_text('base = "stages-2025-12"\n[optim.labels]\nhead = { lr = 0.02, beta = [0.8, 0.95] }\n')
    assert main(["train", "--dry-run", "--recipe", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["speedrun: error: optim.labels.head: unknown key 'beta' (did you mean betas?) "
                   "(keys: rule, group, lr, betas, wd, eps, lr_mul, split, gate_rows, qk_rows)"]  # fmt: skip


def test_recipes_and_dry_run_print_the_resolved_table(capsys):
    assert main(["recipes", "banks-2026-01", "--json"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out)["optim"]["labels"]["mlp_out"] == {"rule": "normuon", "lr_mul": 4.0}  # JSON alone
    cfg = load_recipe("banks-2026-01")
    lines = format_table(cfg.optim, label_table(cfg.optim, cfg.model.n_embd // cfg.model.n_head)).splitlines()
    assert lines[0] == "optimizer labels (13 stated in optim.labels: *):" and lines[1].split()[:4] == [
        "label", "rule", "group", "lr"]  # fmt: skip
    assert lines[2 + 3].split() == ["mlp_out*", "normuon", "matrix", "0.092", "1.2", "lr_mul=4"]
    assert main(["train", "--dry-run", "--recipe", "banks-2026-01"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("optimizer labels") :].splitlines()[2:]
    cfg = load_recipe("banks-2026-01")
    with torch.device("meta"):
        model = build_model(cfg.model)
    counts: dict[str, int] = {}
    for e in model_rules(model, cfg):
        counts[e.label.name] = counts.get(e.label.name, 0) + e.param.numel()
    shown = {line.split()[0].rstrip("*"): line.split() for line in table}
    assert set(shown) == set(counts)  # only the labels the model carries, each with its parameters
    for lab, cells in shown.items():
        assert f"{counts[lab]:,d}" in cells, lab
    assert shown["bigram"][:7] == ["bigram*", "adam", "value_embed", "0.6", "0.025", "0.75/0.95", "1e-10"]


def test_a_stated_row_under_muon_gets_an_adam_group_of_its_own():
    """record-2025-01 (Muon + one Adam): value embeddings at their own LR leave the embedding's group."""
    cfg = load_recipe("record-2025-01", [*shrink("record-2025-01"), 'optim.labels.value_embed={"lr": 0.1}'])
    model = build_model(cfg.model)
    adam = build_optimizer(model, cfg).parts["adam"]
    ve = {id(e.param) for e in model_rules(model, cfg) if e.label.name == "value_embed"}
    groups = [(g["lr"], {id(p) for p in g["params"]}) for g in adam.param_groups]
    assert ve and (0.1, ve) in groups  # after embed, head and scalar, in the state's saved order
    assert [lr for lr, _ in groups[:3]] == [cfg.optim.embed_lr, cfg.optim.head_lr, cfg.optim.scalar_lr]
    assert all(g["betas"] == tuple(cfg.optim.betas) for g in adam.param_groups)  # the rest kept


def test_a_stated_table_survives_config_json():
    """A run's config.json keeps the stated rows; reading it back gives the same table, nothing changed."""
    from speedrun.config.files import changed_keys, config_from_dict

    cfg = load_recipe("banks-2026-01", ["optim.labels.mlp_out.lr_mul=3"])
    back = config_from_dict(json.loads(json.dumps(cfg.to_dict())), "config.json")
    assert changed_keys(cfg, back) == [] and run_rules(back) == run_rules(cfg)
    assert run_rules(back)["mlp_out"].lr_mul == 3.0


def test_an_empty_row_takes_a_stated_row_back():
    """Switching a part off in a recipe that states its row: the row goes with `{}` (the derived one is
    back), and the flat field that feeds it then acts again."""
    off = ["model.skip_gate=0", "optim.skip_gate_lr=0"]
    assert main(["train", "--dry-run", "--recipe", "banks-2026-01", *off]) == 2  # the row would shadow it
    cfg = load_recipe("banks-2026-01", [*off, "optim.labels.skip_gate={}"])
    assert "skip_gate" not in cfg.optim.labels and len(cfg.optim.labels) == 12
    assert run_rules(cfg)["skip_gate"] == derived_rows(cfg.optim, 128)["skip_gate"]
    with torch.device("meta"):
        model = build_model(cfg.model)
    assert "skip_gate" not in {e.label.name for e in model_rules(model, cfg)}  # and no row without one
    assert load_recipe("banks-2026-01", ["optim.labels={}"]).optim.labels == {}
