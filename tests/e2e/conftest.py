"""The e2e tests' fixtures: the runs of tests/e2e/runs.py, trained once per pytest-xdist worker by
tests/e2e/runner.py, and the damaged inputs several bad-input files start from."""

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from tests.e2e import runner


@pytest.fixture(scope="session")
def trained(text_data, tmp_path_factory) -> Callable[[str], runner.Result]:
    """`trained(name)`: the run of definition `name` (read-only: a test copies it to change it)."""
    return lambda name: runner.trained(name, text_data, tmp_path_factory)


@pytest.fixture
def finished(trained) -> Path:
    """A finished tiny run with a checkpoint at every step, its last the final one (runs.py `finished`)."""
    return trained("finished").folder


@pytest.fixture
def uncheckpointed(trained) -> Path:
    """A finished tiny run that saved no checkpoint (runs.py `uncheckpointed`)."""
    return trained("uncheckpointed").folder


@pytest.fixture
def resumable(trained, tmp_path) -> Path:
    """A run stopped after step 3 of 6 with a checkpoint there: a copy of runs.py `six-steps` without its
    step-6 checkpoint."""
    out = tmp_path / "run"
    shutil.copytree(trained("six-steps").folder, out)
    shutil.rmtree(out / "checkpoints" / "step_000006")
    return out


@pytest.fixture
def no_document_starts(data_copy) -> Path:
    """The test data with every end-of-text token of the train shards replaced by another id."""
    from speedrun.data.shards import HEADER_BYTES

    eot = json.loads((data_copy / "meta.json").read_text())["eot_id"]
    for shard in data_copy.glob("*_train_*.bin"):
        raw = bytearray(shard.read_bytes())
        tokens = np.frombuffer(raw, dtype=np.uint16, offset=HEADER_BYTES).copy()
        tokens[tokens == eot] = 5
        shard.write_bytes(bytes(raw[:HEADER_BYTES]) + tokens.tobytes())
    return data_copy


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    """A checkpoint of a tiny untrained model (save_checkpoint as the loop calls it)."""
    import torch

    from speedrun.model.gpt2024.model import GPT
    from speedrun.recipes import load_recipe
    from speedrun.train.run.checkpoint import save_checkpoint
    from tests.conftest import TINY

    cfg = load_recipe("demo", TINY)
    return save_checkpoint(
        tmp_path / "run", 4, GPT(cfg.model), {"step": 4, "x": torch.ones(1)}, cfg.to_dict(), 0
    )
