"""`speedrun recipes`: the one-screen index, checked against facts from elsewhere (the record table of
docs' reference, the loop's per-step batch, the llm.c GPT-2 count), the human summary of one recipe and
the `--json` config, which must stay what `load_recipe(...).to_dict()` gives."""

import json
import sys

import pytest

from speedrun.cli import main
from speedrun.config.stages import stage_plan
from speedrun.recipes import load_recipe, recipe_names
from speedrun.recipes.index import ERAS, entry, index_lines, provenance
from speedrun.train.stages import stage_values


@pytest.fixture(scope="module")
def index() -> list[str]:
    return index_lines()


def test_the_index_fits_one_screen_with_every_recipe_once(index, capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == index and len(out) <= 45 and max(map(len, out)) <= 110
    names = [line.split()[0] for line in out[1:] if not line.startswith("--")][: len(recipe_names())]
    assert sorted(names) == recipe_names()
    assert [line[3:] for line in out if line.startswith("-- ")] == list(ERAS)
    assert out[-2].startswith("record: ") and out[-1].startswith("time: ")  # the legend


def test_a_line_holds_the_records_facts(index):
    (line,) = [x for x in index if x.startswith("record-2026-07 ")]
    assert line.split() == ["record-2026-07", "gpt2026", "2026-07-17", "#89", "1.23", "min", "8xH100",
                            "491M", "1,390", "366M"]  # fmt: skip
    (line,) = [x for x in index if x.startswith("medium-2025-12 ")]
    assert " t2 #18 " in line


def test_params_are_the_models_count():
    # llm.c's GPT-2 124M: 124,439,808 with 50,257 rows, plus 47 padded rows of 768
    assert entry("gpt2-baseline").params == 124_439_808 + 47 * 768
    # demo: 4 layers of 256 (q, k, v, o and a 4x MLP: 12·d²), untied 4,096-row embedding and head
    assert entry("demo").params == 4 * 12 * 256**2 + 2 * 4096 * 256


def test_tokens_sum_the_batch_the_loop_takes_at_every_step():
    cfg = load_recipe("record-2026-07")
    plan = stage_plan(cfg)
    per_step = sum(stage_values(s, plan).batch_tokens for s in range(plan.total_steps))
    assert per_step == 365_690_880  # 460 steps each of 131,072, 262,144, 393,216, then 10 of 393,216
    assert entry("record-2026-07").tokens == "366M"
    assert entry("gpt2-baseline").tokens == "10.3B"  # 19,560 x 524,288 = 10.26 B (README: 10.26 B)
    assert entry("demo").steps == "<=1,000"  # a budget: the steps are a cap


def test_every_bundled_recipe_has_its_provenance():
    for name in recipe_names():
        prov = provenance(name)
        assert prov["differs"], name
        assert prov.get("hardware") == "CPU" or prov["date"][:2] == "20", name
        assert "provenance" not in load_recipe(name).to_dict()


def test_recipes_name_is_a_human_summary_and_json_the_resolved_config(capsys):
    assert main(["recipes", "record-2026-07"]) == 0
    out = capsys.readouterr().out
    assert (
        out.startswith("record-2026-07 (gpt2026): record #89 of 2026-07-17, 1.23 min 8xH100\n")
        and "adds over xsa-2026-04: " in out
    )
    assert "model.mlp.fp8" in out and "still differs from its script: " in out
    assert "speedrun train --recipe demo-2026" in out and "ReLU²" not in out
    for name in ("banks-2026-01", "demo"):
        assert main(["recipes", name, "--json"]) == 0
        text = capsys.readouterr().out
        assert text == json.dumps(load_recipe(name).to_dict(), indent=2, ensure_ascii=False) + "\n"


def test_json_without_a_name_is_one_usage_line(capsys):
    assert main(["recipes", "--json"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "speedrun: error: recipes --json needs a recipe name (speedrun recipes NAME --json)"
    ]


def test_without_torch_the_params_column_says_unknown(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    e = entry("demo")
    assert e.params is None and e.steps == "<=1,000"
