"""Old run folders of a 2025 recipe load as gpt2026: tests/data/stages_2025_run holds the config.json
and metrics.jsonl of a 4-step run of the shrunk stages-2025-12 written by the pre-split code (5ece166,
gpt2024 switches, no `family`). Its config converts to the gpt2026 model, trains to the same losses (bit
for bit on the kernels that made them; they were stored without a fingerprint, so within fp32 rounding
everywhere: tests/stored.py), resumes from a checkpoint whose config.json is the old one, and `speedrun
sample` reads it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path

import pytest

from speedrun.config.files import config_from_dict, flatten
from speedrun.recipes import load_recipe
from speedrun.train.run import checkpoint as ckpt
from tests.conftest import read_metrics, run_speedrun
from tests.stored import agree  # stored without a kernel fingerprint: never bit for bit

OLD = Path(__file__).parents[1] / "data" / "stages_2025_run"


def old_config(data_dir: Path) -> dict:
    """The old config.json, its data folder moved to this test's copy of the same prepared corpus."""
    config = json.loads((OLD / "config.json").read_text())
    config["data"]["dir"] = str(data_dir)
    return config


def as_overrides(config: dict) -> list[str]:
    """Every key of a config that differs from today's stages-2025-12 recipe, as a command-line override
    (lists in JSON): the rest the recipe gives already, and a key given that its optimizer does not read
    (optim.lr under normuon) is refused, as any setting that would not act."""
    flat = flatten(config_from_dict(config, "config.json").to_dict())
    recipe = flatten(load_recipe("stages-2025-12").to_dict())
    return [
        f"{k}={json.dumps(v) if isinstance(v, list) else v}"
        for k, v in flat.items()
        if k != "recipe" and recipe.get(k, not v) != v
    ]


def write_old_config(run: Path, config: dict) -> None:
    """Put the old config.json where the pre-split code wrote it: the run's (with its run id) and every
    checkpoint's (without; its manifest entry updated as the checkpoint writer records it)."""
    run_id = json.loads((run / "config.json").read_text())["run_id"]
    (run / "config.json").write_text(json.dumps({"run_id": run_id, **config}, indent=2) + "\n")
    for path in ckpt.list_checkpoints(run):
        text = json.dumps({k: v for k, v in config.items() if k != "run_id"}, indent=2) + "\n"
        (path / "config.json").write_text(text)
        manifest = json.loads((path / "manifest.json").read_text())
        data = (path / "config.json").read_bytes()
        manifest["files"]["config.json"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        (path / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def train_losses(metrics: list[dict]) -> list[tuple]:
    return [(r["step"], r["train_loss"]) for r in metrics if "train_loss" in r]


@pytest.fixture(scope="module")
def new_run(text_data, tmp_path_factory) -> Path:
    """The old run's config, trained by this code (every key given as an override)."""
    out = tmp_path_factory.mktemp("family") / "run"
    overrides = as_overrides(old_config(text_data))
    proc = run_speedrun("train", "--recipe", "stages-2025-12", "--out", str(out), *overrides)
    assert proc.returncode == 0, proc.stderr
    return out


def test_an_old_2025_config_json_loads_as_gpt2026(text_data):
    cfg = config_from_dict(old_config(text_data), "config.json")
    assert "family" not in json.loads((OLD / "config.json").read_text())["model"]
    assert cfg.model.family == "gpt2026"
    assert (cfg.model.attention_layers, cfg.model.windows) == ([0, 1, 3], ["L", "S", "S", "L"])
    assert (cfg.model.skips, cfg.model.attn.key_offset_layers) == ([[0, 3]], [0, 3])


def test_the_old_run_trains_to_the_same_losses_bit_for_bit(new_run):
    """Four fp32 steps: weights that differ by summation order (gradients within ~3e-5 relative across
    CPUs) move each loss by far less than 1e-5 relative; a wrong model or order is off by > 1e-3."""
    assert json.loads((new_run / "config.json").read_text())["model"]["family"] == "gpt2026"
    ours = train_losses(read_metrics(new_run))
    stored = train_losses([json.loads(line) for line in (OLD / "metrics.jsonl").read_text().splitlines()])
    assert [s for s, _ in ours] == [s for s, _ in stored]
    assert all(agree(a, b, 1e-5, exact=False) for (_, a), (_, b) in zip(ours, stored, strict=True)), (
        ours,
        stored,
    )


def test_an_old_run_folder_resumes_and_samples(new_run, text_data, tmp_path):
    run = tmp_path / "old"
    shutil.copytree(new_run, run)
    for path in ckpt.list_checkpoints(run)[1:]:  # as the old run was at its step-2 checkpoint
        shutil.rmtree(path)
    write_old_config(run, old_config(text_data))
    proc = run_speedrun("train", "--resume", str(run))
    assert proc.returncode == 0, proc.stderr
    assert train_losses(read_metrics(run)) == train_losses(read_metrics(new_run))
    proc = run_speedrun("sample", str(run), "--max-tokens", "4", "--temperature", "0", "--prompt", "The")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()


def test_a_run_folder_written_before_the_part_tables_resumes(new_run, tmp_path):
    """Issue 36: a gpt2026 run whose config.json (the run's and its checkpoint's) has the flat part keys
    of before the tables (`mudd_sources`, `logit_softcap`, ...) resumes to the same losses."""
    from speedrun.config.gpt2026 import FLAT, PARTS, Gpt2026Config

    run = tmp_path / "flat"
    shutil.copytree(new_run, run)
    for path in ckpt.list_checkpoints(run)[1:]:
        shutil.rmtree(path)
    config = json.loads((run / "config.json").read_text())
    model, old_name = dict(config["model"]), {where: key for key, where in FLAT.items()}
    for part in PARTS:
        table = model.pop(part)
        # a field added after the tables has no flat name: an old file lacks it, so it must be at its default
        new = {k: v for k, v in table.items() if (part, k) not in old_name}
        default = dataclasses.asdict(getattr(Gpt2026Config(), part))
        assert all(v == default[k] for k, v in new.items()), new
        model |= {old_name[(part, k)]: v for k, v in table.items() if (part, k) in old_name}
    write_old_config(run, {**{k: v for k, v in config.items() if k != "run_id"}, "model": model})
    assert "mudd_sources" in json.loads((run / "config.json").read_text())["model"]
    proc = run_speedrun("train", "--resume", str(run))
    assert proc.returncode == 0, proc.stderr
    assert train_losses(read_metrics(run)) == train_losses(read_metrics(new_run))


def test_a_pre_split_gpt2024_config_json_loads_unchanged():
    """record-2025-01's config.json as the pre-split code wrote it (every 2025–26 switch, off): gpt2024,
    the same config as the recipe loads today; a 2025–26 switch turned on there is one clear refusal."""
    from speedrun.config.files import changed_keys
    from speedrun.errors import ConfigError
    from speedrun.recipes import load_recipe

    old = json.loads((OLD.parent / "record_2025_01_pre_split_config.json").read_text())
    assert "family" not in old["model"] and old["model"]["smear"] == 0
    cfg = config_from_dict(old, "config.json")
    assert cfg.model.family == "gpt2024"
    assert changed_keys(cfg, load_recipe("record-2025-01")) == []
    with pytest.raises(ConfigError, match="model.smear=12: a 2025–26 switch the gpt2024 family"):
        config_from_dict({**old, "model": {**old["model"], "smear": 12}}, "config.json")
