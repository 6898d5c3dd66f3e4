"""A setting that a stage plan overrides or leaves without effect is refused in one line (issue 27),
and only when it was set: its default, or a value the plan agrees with, still loads. Likewise a
document cut (data.max_doc_len) that no loader makes."""

from __future__ import annotations

import pytest

from speedrun.config.stages import stage_plan
from speedrun.recipes import load_recipe
from tests.conftest import run_speedrun

RECIPE = "stages-2025-12"


def _plan_with(old: str, new: str) -> str:
    text = load_recipe(RECIPE).train.stages
    assert old in text
    return text.replace(old, new)


@pytest.mark.parametrize(
    "override, words",
    [
        # the loader cuts documents at each stage's doc=N (train/run_data.open_loader): this one is unread
        ("data.max_doc_len=1024", "data.max_doc_len (1024) has no effect under train.stages"),
        # the plan's yarn=13 rescales a YaRN the model does not have
        ("model.yarn=false", "yarn=13 rescales YaRN for the final validation: it needs model.attn.yarn=true"),
        # every weight 0: the training loss is 0 and nothing learns
        (
            f"train.stages={_plan_with('mtp=1,0.5>1,0', 'mtp=0,0,0')}",
            "stage 2: mtp= weights must not all be 0",
        ),
        (
            f"train.stages={_plan_with('mtp=1,0.5>1,0', 'mtp=1,0.5>0,0')}",
            "stage 2: mtp= weights must not all",
        ),
        # weights for a model without multi-token prediction (model.mtp=0 reads none of them)
        (
            f"train.stages={_plan_with('mtp=1,0.5,0.25>1,0.5,0', 'mtp=0.5').replace(' mtp=1,0.5>1,0', '')}",
            "stage 1: mtp= weighs predicted tokens only with model.head.mtp >= 2 (model.head.mtp is 0)",
        ),
        # 4 rows of 49,152: the stages still train 131,072 … 393,216 tokens a step, not 196,608
        ("train.global_batch_tokens=196608", "train.global_batch_tokens (196,608) is no step's batch"),
        ("train.global_batch_tokens=786432", "train.global_batch_tokens (786,432) is no step's batch"),
    ],
)
def test_a_setting_the_plan_leaves_without_effect_is_one_line_exit_2(override, words):
    extra = ["model.head.mtp=0"] if "model.head.mtp is 0" in words else []  # the recipe's model.mtp is 3
    proc = run_speedrun("train", "--recipe", RECIPE, "--dry-run", override, *extra)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("speedrun: error: "), proc.stderr
    assert words in lines[0]


@pytest.mark.parametrize(
    "overrides",
    [
        ["data.max_doc_len=0"],  # the default, given: nothing the plan contradicts
        # 8 rows of 16,384: the first stage's batch; the later stages' rows grow as the record's do
        ["train.global_batch_tokens=131072", "train.micro_batch_tokens=16384", "train.seq_len=16384"],
        [f"train.stages={_plan_with('mtp=1,0.5>1,0', 'mtp=0,1')}"],  # t+2 only: the loss is not 0
    ],
)
def test_what_the_plan_agrees_with_still_loads(overrides):
    cfg = load_recipe(RECIPE, overrides)
    plan = stage_plan(cfg)
    assert plan is not None
    assert cfg.train.global_batch_tokens in {s.batch_tokens for s in plan.stages}


def test_every_bundled_staged_recipe_passes_the_new_rules():
    from speedrun.recipes import recipe_names

    staged = [n for n in recipe_names() if load_recipe(n).train.stages]
    assert {"yarn-2025-09", "polar-2025-09", "normuon-2025-10", RECIPE} <= set(staged)


@pytest.mark.parametrize(
    "recipe, key, why",
    [
        ("demo", "data.loader", "data.loader=tokens (it needs data.loader=documents)"),  # cuts none
        # #26's documents stream whole
        ("bos-align-2025-07", "data.doc_rule", "data.doc_rule=stream (it needs data.doc_rule=packed)"),
    ],
)
def test_a_document_cut_no_loader_makes_is_refused(recipe, key, why):
    proc = run_speedrun("train", "--recipe", recipe, "--dry-run", "data.max_doc_len=512")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"speedrun: error: data.max_doc_len=512 has no effect while {why}; set {key} or drop data.max_doc_len"
    ]
