import pytest, torch
from tests.test_stages_training import staged
from tests.test_warmup import assert_timed_steps_never_compile
from speedrun.train import loop

def test_exp(text_data, tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "warm_up", lambda *a, **k: 0)
    stages = "tokens=128 windows=1/1 frac=1/2; tokens=256 windows=1/2 frac=1/2; tokens=256 windows=1/2 ext=0"
    overrides = staged(text_data, "train.checkpoint_every=0", f"train.stages={stages}", "train.steps=4")
    overrides.append("train.val_every=0")
    try:
        assert_timed_steps_never_compile(overrides, tmp_path, monkeypatch, rel=1)
    except AssertionError as e:
        print("ASSERT", str(e)[:200])
    from tests.conftest import read_metrics
    for c in ("on", "off"):
        print("RUNS", c, [r.get("train_loss", r.get("val_loss")) for r in read_metrics(tmp_path / c)])
