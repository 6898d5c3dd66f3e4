"""A family's rules live in its record (issue 36): model/families.py (the model side) and
config/families.py (the config side, torch-free); nowhere else does code branch on a family's name."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np

import speedrun
from speedrun.cli import main
from speedrun.model import families
from tests.conftest import TINY

PACKAGE = Path(speedrun.__file__).parent
RECORDS = {PACKAGE / "model" / "families.py", PACKAGE / "config/families.py"}
#: a comparison with a family's name, either way round, or a membership test of the family field
BRANCH = re.compile(
    r"""family\s*(==|!=)\s*["']|["']gpt20\d\d["']\s*(==|!=)|\.family\s+(not\s+)?in\b|isinstance\([^)]*Gpt2026Config"""
)


def family_branches(root: Path = PACKAGE) -> list[str]:
    return [
        f"{path.relative_to(root.parent)}:{n}: {line.strip()}"
        for path in sorted(root.rglob("*.py"))
        if path not in RECORDS
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if BRANCH.search(line)
    ]


def test_the_pattern_finds_each_form_of_a_family_branch(tmp_path):
    lines = [
        'if m.family == "gpt2026":',
        "gated = cfg.model.family != 'gpt2024'",
        'if "gpt2024" == m.family:',
        'if m.family in ("gpt2026",):',
        "if isinstance(m, Gpt2026Config):",
    ]
    (tmp_path / "speedrun").mkdir()
    (tmp_path / "speedrun" / "x.py").write_text("\n".join([*lines, "if name == cfg.model.family:"]))
    assert len(family_branches(tmp_path / "speedrun")) == len(lines)


def test_no_family_branch_outside_the_family_records():
    found = family_branches()
    assert not found, "move the rule into the family record (model/families.py, config/families.py): " + (
        "; ".join(found)
    )


def _recording(monkeypatch) -> list[int]:
    """gpt2024's record with an after_step hook that notes each step it is called with."""
    calls: list[int] = []
    real = families.FAMILIES["gpt2024"]

    def recording() -> families.Family:
        return dataclasses.replace(real(), after_step=lambda model, step: calls.append(step))

    monkeypatch.setitem(families.FAMILIES, "gpt2024", recording)
    return calls


def test_the_loop_calls_the_family_after_step_hook_before_every_step(text_data, tmp_path, monkeypatch):
    """after_step(model, step - 1) before each trained step: the hook the FP8 refresh (#84/#89) needs,
    called for every family (gpt2024's does nothing)."""
    calls = _recording(monkeypatch)
    fast = [*TINY, "train.steps=4", "train.warmdown_steps=1", "train.val_every=0"]
    assert main(["train", "--out", str(tmp_path / "run"), f"data.dir={text_data}", *fast]) == 0
    assert calls == [-1, 0, 1, 2]  # compile off: no warm-up


def test_the_warm_up_calls_the_family_after_step_hook_as_the_loop(tmp_path, monkeypatch):
    from speedrun.data.loader import TokenLoader
    from speedrun.data.shards import write_shard
    from speedrun.optim.build import build_optimizer
    from speedrun.train.warmup import warm_up, warmup_steps
    from tests.e2e.test_warmup import small_cfg

    calls = _recording(monkeypatch)
    cfg = small_cfg()
    files = [tmp_path / f"t_train_{i:06d}.bin" for i in range(2)]
    for f in files:
        write_shard(f, np.random.default_rng(0).integers(0, 64, 700))
    model = families.build_model(cfg.model)
    warm_up(
        cfg, model, model, build_optimizer(model, cfg), TokenLoader(files, 128, 64, 32), 2, None, lambda: 0
    )
    assert calls and calls == [s - 1 for s in warmup_steps(cfg, 0)]
