"""Bad inputs and faults of recipes, overrides, stage plans and their messages (docs/bad-inputs.md): each
ends in one stderr line and exit 1 or 2, or works; nothing we do not own is lost, nothing is silently
wrong."""

from __future__ import annotations

import json

import pytest

from speedrun.config.types import FP32_MAX, MAX_SEQ_LEN
from speedrun.errors import ConfigError
from speedrun.recipes import load_recipe
from tests.bad_input_runs import EXT, SHORT, error_line, one_line, plan
from tests.conftest import TINY, run_speedrun


@pytest.mark.parametrize(
    ("stages", "words"),
    [
        # a fraction bypassed the finite, >= 0 check: nan and inf reached round() as a traceback
        (f"tokens=128 windows=1/1 frac=1e400/1e400; {EXT}", "frac must be a finite number >= 0"),
        (f"tokens=128 windows=1/1 frac=inf/1; {EXT}", "frac must be a finite number >= 0"),
        (f"tokens=128 windows=1/1 frac=-1/2; tokens=128 windows=1/1 frac=3/2; {EXT}", "finite number >= 0"),
        # a key given twice: the later one silently won
        (f"tokens=128 windows=1/1 frac=0.5 frac=1; {EXT}", "frac is given twice"),
        # windows beyond int32 positions: an OverflowError in the first step's mask
        (f"tokens=128 windows=1/{2**70} frac=1; {EXT}", "windows must be at most"),
        (f"tokens=128 windows=1/1 frac=1; {EXT} val={(MAX_SEQ_LEN - 1) // 128 + 1}", "val must be at most"),
        # an LR multiplier beyond fp32: a traceback in Adam's update
        (f"tokens=128 windows=1/1 frac=1 lr=1e39; {EXT}", "lr must be at most"),
        # fractions off 1 by more than rounding: accepted when they rounded to the step count
        (f"tokens=128 windows=1/1 frac=0.5; tokens=128 windows=1/1 frac=0.53; {EXT}", "add up to 1.03"),
        (f"tokens=128 windows=1/1 frac=0.5; tokens=128 windows=1/1 frac=0.47; {EXT}", "add up to 0.97"),
    ],
)
def test_a_stage_plan_that_cannot_run_as_written_is_one_config_error(stages, words):
    with pytest.raises(ConfigError, match="train.stages") as err:
        plan(stages)
    assert words in str(err.value)


def test_stage_plan_limits_are_what_torch_holds():
    """The largest window (int32 positions of blocks·128 + 1 tokens) and LR multiplier (fp32) still parse,
    and fractions that add up to 1 in floating point (0.6 + 0.3 + 0.1, thirds) are one."""
    blocks = (MAX_SEQ_LEN - 1) // 128
    p = plan(f"tokens=128 windows=1/{blocks} frac=1 lr={FP32_MAX!r}; {EXT} val={blocks}")
    assert p.stages[0].windows == (1, blocks) and blocks * 128 + 1 <= MAX_SEQ_LEN
    assert p.stages[0].lr_mul == FP32_MAX and p.val_long_window == blocks
    tenths = "; ".join(f"tokens=128 windows=1/1 frac={f}" for f in (0.6, 0.3, 0.1))
    assert [s.duration for s in plan(f"{tenths}; {EXT}", 22).stages[:3]] == [0.6, 0.3, 0.1]
    thirds = "; ".join(["tokens=128 windows=1/1 frac=1/3"] * 3)
    assert plan(f"{thirds}; {EXT}").scheduled_steps == 12


def test_an_extension_stage_without_steps_is_described_as_such():
    """ext=0: the extension stage trains no step (its windows serve the final validation); the log said
    `steps 14-13`."""
    from speedrun.train.stages import describe_stages, stage_bounds

    p = plan(f"tokens=128 windows=1/1 frac=1; {EXT.replace('ext=2', 'ext=0')}")
    assert stage_bounds(p)[-1] == (14, 14)
    line = describe_stages(p, 1, 1)
    assert "steps 0-13: 128 tokens" in line and "; no steps (ext=0: final validation only): 128" in line


def test_a_blank_stage_plan_in_a_recipe_file_is_no_plan(tmp_path):
    """`stages = "  "` in a recipe file (an override strips it; a file does not) is unset, as stage_plan
    reads it; the config check took it for a plan and failed its assert (a traceback)."""
    from speedrun.config.stages import stage_plan

    recipe = tmp_path / "blank.toml"
    recipe.write_text('base = "demo"\n[train]\nstages = " \\n\\t "\n')
    cfg = load_recipe(str(recipe), TINY)
    assert cfg.train.stages.strip() == "" and stage_plan(cfg) is None
    assert stage_plan(load_recipe("demo", TINY)) is None  # what an unset plan gives


def test_misattributed_config_messages(tmp_path):
    """`model.n_layer=10000000000` blamed `model.max_seq_len=64 needs a 76,294 GiB position table` (the
    rotary tables are per layer); `--recipe FOLDER` said `recipe file not found`; a run folder whose lock
    file is a folder said `cannot write run directory RUN: Is a directory`, not which file."""
    got = run_speedrun("train", "--dry-run", *TINY, "model.n_layer=10000000000")
    error_line(got, 2, "model.max_seq_len=64 and model.n_layer=10000000000 (a rotary table per layer)")
    got = run_speedrun("train", "--dry-run", "--recipe", str(tmp_path))
    error_line(got, 2, f"recipe file {tmp_path} is a directory, not a .toml file")
    run = tmp_path / "run"
    (run / ".speedrun.lock").mkdir(parents=True)
    got = run_speedrun("train", "--out", str(run), *TINY, *SHORT)
    error_line(got, 1, f"cannot write run directory {run}/.speedrun.lock")


def test_an_empty_recipe_name_is_not_the_default():
    one_line(run_speedrun("train", "--dry-run", "--recipe", ""), 2, "unknown recipe ''")
    one_line(run_speedrun("recipes", ""), 2, "unknown recipe ''")


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("optim.lr=1e300", "optim.lr must be at most 3.403e+38"),  # finite, but not in fp32
        ("model.window=100000000000000000000", "model.window must be at most 9,223,372,036,854,775,807"),
        ("train.steps=9223372036854775808", "train.steps must be at most"),
    ],
)
def test_numbers_beyond_what_torch_holds_are_config_errors(override, fragment):
    """Python takes these, torch did not: an overflow traceback inside the first step."""
    one_line(run_speedrun("train", "--dry-run", override), 2, fragment)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["model.window_warmup=floor", "model.window_unit=256"], "model.window_unit (256) must not exceed"),
        (["model.window_warmup=ceil", "model.window_unit=256"], "model.window_unit (256) must not exceed"),
        (["model.window_warmup=floor", "model.window_warmup_start=1000"], "window_warmup_start (1000)"),
    ],
)
def test_a_window_warmup_that_would_exceed_the_window(overrides, fragment):
    """The first window would be larger than model.window: a ValueError at step 0 before."""
    proc = run_speedrun("train", "--dry-run", "model.window=128", *overrides)
    one_line(proc, 2, fragment)


def test_a_recipe_file_saved_with_a_byte_order_mark(tmp_path):
    """Windows editors start UTF-8 files with a BOM, which tomllib calls an invalid statement."""
    recipe = tmp_path / "mine.toml"
    recipe.write_bytes(b"\xef\xbb\xbf" + b'base = "demo"\n[model]\nn_layer = 3\n')
    proc = run_speedrun("train", "--dry-run", "--recipe", str(recipe))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout[: proc.stdout.index("\n}\n") + 2])["model"]["n_layer"] == 3


# --- issue 46: a setting accepted and ignored ---------------------------------------------------------------


def test_a_key_under_its_flat_and_its_table_name_in_one_table_is_refused(tmp_path):
    """Before: the one that came last won and the other was dropped without a word."""
    recipe = tmp_path / "twice.toml"
    recipe.write_text('base = "demo-2026"\n[model]\nattn_scale = 0.10\n[model.attn]\nscale = 0.12\n')
    with pytest.raises(
        ConfigError, match=r"model\.attn\.scale twice, as model\.attn_scale and as model\.attn\.scale"
    ):
        load_recipe(str(recipe))
    with pytest.raises(ConfigError, match="the command line gives model.attn.scale twice"):
        load_recipe("demo-2026", ["model.attn_scale=0.1", "model.attn.scale=0.12"])
    # one spelling twice on a command line is the shell's last-one-wins; one spelling in a file is kept
    assert (
        load_recipe("demo-2026", ["model.attn.scale=0.1", "model.attn.scale=0.12"]).model.attn.scale == 0.12
    )
    recipe.write_text('base = "demo-2026"\n[model]\nattn_scale = 0.11\n')
    assert load_recipe(str(recipe)).model.attn.scale == 0.11


@pytest.mark.parametrize(
    "recipe, overrides, key",
    [
        ("demo-2026", ["model.attn.window_unit=64"], "model.attn.window_unit"),
        ("demo-2026", ["model.attn.window_warmup_start=32"], "model.attn.window_warmup_start"),
        (
            "bos-align-2025-07",
            ["model.head.softcap=0", "model.head.softcap_divisor=2"],
            "model.head.softcap_divisor",
        ),
        (
            "bos-align-2025-07",
            ["model.head.softcap=0", "model.head.softcap_in_bf16=true"],
            "model.head.softcap_in_bf16",
        ),
    ],
)
def test_a_gpt2026_sub_key_while_its_switch_is_off_is_refused(recipe, overrides, key):
    """Before: accepted, and the run trained bit-identical losses (nothing reads the key)."""
    from speedrun.config.checks import validate

    with pytest.raises(ConfigError, match=rf"^{key}=\S+ has no effect while"):
        validate(load_recipe(recipe, overrides))


def test_every_recipe_still_loads_with_the_gpt2026_sub_key_rows():
    from speedrun.config.checks import validate
    from speedrun.recipes import recipe_names

    for name in recipe_names():
        validate(load_recipe(name))


# --- issue 46: a refusal naming the wrong cause -------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "-1"])
def test_gate_lr_mul_at_zero_or_below_is_refused_by_its_range(value):
    """Before: 0 got "must be > 0; it scales the gates ..." and -1 "must be >= 0" (which 0 is)."""
    with pytest.raises(ConfigError, match=rf"^optim\.gate_lr_mul must be > 0, got {float(value)}$"):
        load_recipe("demo-2026", [f"optim.gate_lr_mul={value}"])


def test_gate_lr_mul_that_nothing_reads_names_why():
    """Before: "must be > 0" for a value of 0.5: the cause was that Adam trains the gates (optim.gate_lr)."""
    from speedrun.config.checks import validate

    with pytest.raises(
        ConfigError, match=r"gate_lr_mul=0.5 has no effect: .* optim.gate_lr=\S+ gives them to Adam"
    ):
        validate(load_recipe("demo-2026", ["optim.gate_lr_mul=0.5"]))


@pytest.mark.parametrize(
    "recipe, cause",
    [("demo", "the warm-down (2, train.warmdown_frac 0.3)"), ("demo-2026", "Muon's momentum cool-down (50")],
)
def test_a_budget_that_cannot_act_names_its_cause_and_a_step_count_that_works(recipe, cause):
    """issue 46: demo-2026's refusal called its 50-step momentum cool-down "the warm-down" and said only
    "raise train.steps". The count it names now is accepted, and one step fewer is not."""
    import re

    from speedrun.train.plan.budget import settle_budget

    def settle(steps: int) -> None:
        settle_budget(load_recipe(recipe, ["train.time_budget_s=1", f"train.steps={steps}"]), print)

    with pytest.raises(ConfigError, match="cannot act") as refused:
        settle(5)
    assert cause in str(refused.value), refused.value
    n = int(re.search(r"raise train.steps to at least (\d+)", str(refused.value)).group(1))
    settle(n)
    with pytest.raises(ConfigError, match="cannot act"):
        settle(n - 1)
