"""The research workflow end to end on CPU: train three seeds of a tiny run (`train --seeds`), sample
it (KV cache vs full forward), evaluate it (against the loop's own final val loss), compare the seeds
(t-test against a hand formula with scipy's t distribution), and the failures users meet."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from speedrun.cli import main
from speedrun.model.generate import prompt_ids, sample_during_training
from speedrun.model.kv_cache import KVCache, forward_cached
from speedrun.tools.compare import make_groups
from speedrun.tools.evaluate import evaluate_loss
from speedrun.tools.results import load_run
from speedrun.tools.runs import load_model, run_tokenizer
from speedrun.tools.stats import below_target_test
from tests.conftest import TINY, read_metrics
from tests.e2e import runner
from tests.e2e.runs import RESEARCH
from tests.model_refs import generate_uncached

SEEDS = (1, 2, 3)


def copy_with_config(run: Path, copy: Path, edit) -> Path:
    """A copy of `run` whose config.json was changed by `edit(cfg)`."""
    shutil.copytree(run, copy)
    cfg = json.loads((copy / "config.json").read_text())
    edit(cfg)
    (copy / "config.json").write_text(json.dumps(cfg))
    return copy


# the tests that read these runs share one pytest-xdist worker (--dist loadgroup): trained once
SEED_RUNS = runner.uses("research-seeds")


@pytest.fixture
def seed_runs(trained):
    """Three tiny demo runs differing only in train.seed, trained in-process (runs.py `research-seeds`:
    12 fp32 steps with a final checkpoint, about 2 s each)."""
    return trained("research-seeds").folders


@pytest.mark.slow
@SEED_RUNS
def test_seeds_make_sibling_runs_with_their_seed(seed_runs):
    for seed, run in zip(SEEDS, seed_runs, strict=True):
        assert json.loads((run / "config.json").read_text())["train"]["seed"] == seed
    finals = [read_metrics(r)[-1]["val_loss"] for r in seed_runs]
    assert len(set(finals)) == 3  # the seed changed the initial weights


@pytest.mark.slow
@SEED_RUNS
def test_sample_streams_what_uncached_greedy_generation_produces(seed_runs, capsys):
    run = seed_runs[0]
    assert main(["sample", str(run), "--prompt", "The", "--max-tokens", "24", "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    model, cfg, _ = load_model(run)
    tok = run_tokenizer(cfg)
    tokens = []
    for t in generate_uncached(model, prompt_ids(tok, "The", "cpu"), 24):
        if int(t[0]) == tok.eot_id:
            break
        tokens.append(int(t[0]))
    assert printed == "The" + tok.decode(tokens) + "\n"
    assert sample_during_training(model.train(), tok, ["The"], max_tokens=24) == [tok.decode(tokens)]
    assert model.training  # sample_during_training restores the mode


@pytest.mark.slow
@SEED_RUNS
def test_cached_decoding_under_bf16_autocast_tracks_the_full_forward(seed_runs):
    model, _, _ = load_model(seed_runs[0])
    idx = torch.randint(0, 511, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        full = model(idx)
        cache = KVCache()
        steps = [forward_cached(model, idx[:, :8], cache)]
        steps += [forward_cached(model, idx[:, t : t + 1], cache) for t in range(8, 40)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0.05, atol=0.05)


@pytest.mark.slow
@SEED_RUNS
def test_eval_reproduces_the_loops_final_val_loss(seed_runs, capsys):
    run = seed_runs[1]
    final = read_metrics(run)[-1]
    model, cfg, _ = load_model(run)
    result = evaluate_loss(model, cfg, cfg.data.dir)
    assert result["tokens"] == cfg.train.val_tokens
    assert result["val_loss"] == pytest.approx(final["val_loss"], abs=1e-6)
    assert result["val_bpb"] == pytest.approx(final["val_bpb"], abs=1e-6)
    assert main(["eval", str(run), "--tokens", "1024"]) == 0
    assert capsys.readouterr().out.startswith("val loss ")


@pytest.mark.slow
@SEED_RUNS
def test_eval_rejects_data_of_another_tokenizer(seed_runs, tmp_path, capsys):
    from speedrun.data.prepare import prepare

    src = tmp_path / "t.jsonl"
    src.write_text(
        "".join(json.dumps({"text": f"Document {i} says little. " * 30}) + "\n" for i in range(40))
    )
    other = prepare(f"text:{src}", "bpe:300", tmp_path / "other", log=lambda *_: None)
    assert main(["eval", str(seed_runs[0]), "--data", str(other)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("speedrun: error:") and "bpe:300" in err and "\n" not in err


@pytest.mark.slow
@SEED_RUNS
def test_compare_table_groups_and_plot(seed_runs, tmp_path, capsys):
    from matplotlib.image import imread

    copies = []  # runs copied from "another machine": only relative contents matter
    for run in seed_runs:
        copies.append(tmp_path / "elsewhere" / run.name)
        shutil.copytree(run, copies[-1])
    png = tmp_path / "curves.png"
    assert main(["compare", *map(str, copies), "--target", "9.5", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    for run in seed_runs:
        assert run.name in out
    assert "group demo: n=3" in out
    image = imread(png)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    runs = [load_run(c) for c in copies]
    (group,) = make_groups(runs, 9.5)
    losses = [read_metrics(r)[-1]["val_loss"] for r in seed_runs]
    assert group.losses == pytest.approx(losses)
    assert group.mean == pytest.approx(sum(losses) / 3)


@pytest.mark.slow
@SEED_RUNS
def test_a_different_setting_makes_another_group(seed_runs, tmp_path):
    other = copy_with_config(seed_runs[0], tmp_path / "other", lambda cfg: cfg["optim"].update(muon_lr=0.1))
    groups = make_groups([load_run(r) for r in [*seed_runs, other]], 3.28)
    assert sorted(g.n for g in groups) == [1, 3]
    assert any("optim.muon_lr=0.1" in g.label for g in groups)


def test_t_test_matches_the_textbook_formula_with_scipys_t_distribution():
    from scipy import stats

    losses = [3.2791, 3.2768, 3.2802, 3.2775, 3.2783, 3.2770]
    target = 3.28
    n = len(losses)
    mean = sum(losses) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in losses) / (n - 1))
    t = (mean - target) / (sd / math.sqrt(n))
    t_lib, p_lib = below_target_test(losses, target)
    assert t_lib == pytest.approx(t, rel=1e-9)
    assert p_lib == pytest.approx(stats.t.cdf(t, df=n - 1), rel=1e-9)
    assert p_lib < 0.01


def test_seed_usage_errors(capsys):
    assert main(["train", "--seeds", "1,1", "--dry-run"]) == 2
    assert main(["train", "--seeds", "1,x"]) == 2
    assert main(["train", "--seeds", "1,2", "train.seed=3"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 3 and all(e.startswith("speedrun: error: --seeds") for e in errors)


def test_seed_dry_run_lists_the_run_directories(tmp_path, capsys):
    assert main(["train", "--seeds", "4,5", "--out", str(tmp_path / "g"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"seed 4: {tmp_path / 'g-seed4'}" in out and f"seed 5: {tmp_path / 'g-seed5'}" in out


@pytest.mark.slow
@SEED_RUNS
def test_tool_errors_are_one_line(seed_runs, tmp_path, capsys):
    no_ckpt = tmp_path / "no-ckpt"
    no_ckpt.mkdir()
    shutil.copy(seed_runs[0] / "config.json", no_ckpt)
    shutil.copy(seed_runs[0] / "metrics.jsonl", no_ckpt)
    cases = [
        (["sample", str(tmp_path)], 1, "neither a run directory nor a checkpoint"),
        (["sample", str(no_ckpt)], 1, "checkpoint_at_end"),
        (["sample", str(seed_runs[0]), "--temperature", "-1"], 2, "must not be negative"),
        (["eval", str(seed_runs[0]), "--tokens", "100"], 2, "multiple of the run's seq_len"),
        (["eval", str(seed_runs[0]), "--hellaswag"], 2, "GPT-2-tokenized"),
        (["compare", str(tmp_path)], 1, "not a run directory"),
        (["sample", str(seed_runs[0]), "--device", "cuda:0"], 2, "CUDA"),
    ]
    for argv, code, text in cases:
        if "cuda:0" in argv and torch.cuda.is_available():
            continue
        assert main(argv) == code, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("speedrun: error:") and text in err and "\n" not in err, (argv, err)


@pytest.mark.slow
@SEED_RUNS
def test_summary_json_wins_over_numbers_derived_from_metrics(seed_runs, tmp_path):
    run = tmp_path / "with-summary"
    shutil.copytree(seed_runs[0], run)
    derived = load_run(run)
    assert derived.steps == 12 and derived.tokens_per_s > 0 and derived.curve[-1][0] == 12 * 1024
    summary = {"recipe": "demo", "steps": 12, "final_val_loss": 1.5, "tokens_per_s": 1234.0}
    (run / "summary.json").write_text(json.dumps(summary))
    given = load_run(run)
    assert (given.final_val_loss, given.tokens_per_s) == (1.5, 1234.0)
    assert given.final_val_bpb == derived.final_val_bpb  # absent from summary.json: still from metrics


@pytest.mark.slow
@SEED_RUNS
def test_a_run_from_an_older_version_still_joins_its_group(seed_runs, tmp_path):
    # a field added after that run was made
    old = copy_with_config(seed_runs[2], tmp_path / "old", lambda cfg: cfg["train"].pop("sample_every"))
    (group,) = make_groups([load_run(r) for r in [*seed_runs[:2], old]], 3.28)
    assert group.n == 3


@pytest.mark.slow
@SEED_RUNS
def test_compare_reports_and_plots_the_flops_axis(seed_runs, tmp_path, capsys, monkeypatch):
    from matplotlib.axes import Axes

    from speedrun.recipes import load_recipe
    from speedrun.tools.flops import flops_per_token, train_flops
    from speedrun.train.flops import config_model, run_flops

    cfg = load_recipe("demo", [*TINY, *RESEARCH])  # the seed runs' config
    total = run_flops(config_model(cfg), cfg, 12)  # Σ tokens × each step's count
    per_token = total / (12 * 1024)
    summary = json.loads((seed_runs[0] / "summary.json").read_text())
    assert summary["train_flops"] == pytest.approx(total, rel=1e-12)
    old = tmp_path / "old"  # a run from before summary.json recorded it: counted from its config
    shutil.copytree(seed_runs[1], old)
    before = json.loads((old / "summary.json").read_text())
    dropped = ("flops_per_token", "train_flops")
    (old / "summary.json").write_text(json.dumps({k: v for k, v in before.items() if k not in dropped}))
    assert train_flops(load_run(old)) == pytest.approx(total, rel=1e-12)
    assert flops_per_token(load_run(old)) == pytest.approx(per_token, rel=1e-12)

    target = max(read_metrics(r)[-1]["val_loss"] for r in seed_runs[:2]) + 1e-9  # the last validation
    assert all(m["val_loss"] > target for r in seed_runs[:2] for m in read_metrics(r)[:-1] if "val_loss" in m)
    assert main(["compare", str(seed_runs[0]), str(old), "--target", str(target)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header, row = lines[0].split(), lines[1].split()
    assert header[-4:] == ["FLOPs", "tokens", "to", f"{target:g}"]
    assert row[-2:] == [f"{total:.2e}".replace("e+", "e"), f"{12 * 1024:,}"]
    assert lines[2].split()[-2:] == row[-2:]

    assert main(["compare", str(seed_runs[0]), "--x", "flops"]) == 2
    assert "add --plot" in capsys.readouterr().err
    drawn = []
    monkeypatch.setattr(Axes, "plot", lambda self, x, y, **kw: drawn.append((self.get_xlabel(), list(x))))
    assert main(["compare", str(seed_runs[0]), "--plot", str(tmp_path / "f.png"), "--x", "flops"]) == 0
    tokens = [m["tokens"] for m in read_metrics(seed_runs[0]) if "val_loss" in m]
    assert drawn[0][1] == pytest.approx([t * per_token for t in tokens], rel=1e-12)
