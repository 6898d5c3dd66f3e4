"""The untimed warm-up: it leaves model, optimizer, loader and RNG exactly as they were (the steps that
follow are bit-identical to a run without it), and with train.compile=on no timed step compiles."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from speedrun.config import Config, ModelConfig, OptimConfig, TrainConfig
from speedrun.data.loader import TokenLoader
from speedrun.data.shards import write_shard
from speedrun.model.families import build_model
from speedrun.optim.build import build_optimizer
from speedrun.recipes import load_recipe
from speedrun.train import loop
from speedrun.train.schedule import apply_schedule, schedule_at
from speedrun.train.step import train_step
from speedrun.train.warmup import warm_up
from tests.conftest import TINY, read_metrics


def small_cfg() -> Config:
    model = ModelConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=32, max_seq_len=32, positional="rotary",
                        norm="rmsnorm", activation="relu2", bias=False)  # fmt: skip
    optim = OptimConfig(name="muon", muon_momentum_start=0.85, muon_momentum_warmup_steps=3)
    train = TrainConfig(steps=6, global_batch_tokens=128, micro_batch_tokens=64, seq_len=32, dtype="fp32")
    return Config(model=model, optim=optim, train=train)


def test_warm_up_restores_everything_so_the_run_is_unchanged(tmp_path):
    cfg = small_cfg()
    rng = np.random.default_rng(0)
    files = [tmp_path / f"t_train_{i:06d}.bin" for i in range(2)]
    for f in files:
        write_shard(f, rng.integers(0, 64, 700))

    def fresh():
        torch.manual_seed(0)
        model = build_model(cfg.model)
        return model, build_optimizer(model, cfg), TokenLoader(files, 128, 64, 32)

    def losses(model, optimizer, loader):
        out = []
        for step in range(4):
            apply_schedule(schedule_at(step, cfg), optimizer, model)
            out.append(train_step(model, optimizer, loader.next_batch, 2, None).item())
        return out, [p.detach().clone() for p in model.parameters()]

    want, want_params = losses(*fresh())
    model, optimizer, loader = fresh()
    validated = []
    warm_up(cfg, model, model, optimizer, loader, 2, None, lambda: validated.append(True))
    assert validated and optimizer.state_dict() == fresh()[1].state_dict()  # no momentum left over
    got, got_params = losses(model, optimizer, loader)
    assert got == want
    for a, b in zip(got_params, want_params, strict=True):
        assert torch.equal(a, b)


def assert_timed_steps_never_compile(
    overrides: list[str], out: Path, monkeypatch, rel: float = 1e-4
) -> dict[str, list[float]]:
    """Train the demo with `overrides` compiled and eager: dynamo's counters do not move once the first
    timed step starts (validations included), and the losses equal the eager run's (within `rel`);
    returns both runs' losses."""
    counters = torch._dynamo.utils.counters
    seen: list[int] = []
    real_step = loop.train_step

    def counting_step(*args, **kwargs):
        seen.append(sum(counters["stats"].values()))
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", counting_step)
    runs = {}
    for compile_ in ("on", "off"):
        torch._dynamo.reset()
        counters.clear()
        seen.clear()
        loop.train(load_recipe("demo", [*overrides, f"train.compile={compile_}"]), out / compile_)
        runs[compile_] = [r.get("train_loss", r.get("val_loss")) for r in read_metrics(out / compile_)]
        if compile_ == "on":
            assert seen[0] > 0, "the warm-up compiled before the first timed step"
            assert seen == [seen[0]] * len(seen) == [sum(counters["stats"].values())] * len(seen)
    assert runs["on"] == pytest.approx(runs["off"], rel=rel)
    return runs


@pytest.mark.slow
def test_timed_steps_never_compile(text_data, tmp_path, monkeypatch):
    """train.compile=on (inductor on CPU), tiny fp32 model."""
    overrides = [*TINY, f"data.dir={text_data}", "train.steps=6", "train.val_every=3", "train.log_every=1",
                 "train.dtype=fp32", "train.warmdown_steps=2"]  # fmt: skip
    assert_timed_steps_never_compile(overrides, tmp_path, monkeypatch)
