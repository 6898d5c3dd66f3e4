"""benchmarks/bench_peers.py: its one evaluator against the bits per byte a run logged, its document
export against the shards, its clocks and time-to-bpb against hand-made curves; the LitGPT loader
against LitGPT's own loss (skipped where litgpt is not installed: a benchmark-only requirement)."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import read_metrics
from tests.e2e import runner

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "bench_peers.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_peers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_peers"] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


bp = _load()


@pytest.fixture
def tiny_run(trained) -> Path:
    """TINY's 30 steps with a final checkpoint (runs.py `tiny`, test_cli's run folder too)."""
    return trained("tiny").folder


@runner.uses("tiny")
def test_evaluator_matches_the_bpb_the_run_logged(tiny_run, text_data):
    """Scored over the tokens the run validated on, the evaluator's NLL and bpb are the run's own final
    val loss x tokens and val bpb (computed by the package's evaluate: another code path, fp32 loss)."""
    _, _, val_docs, tok = bp.split_documents(text_data)
    stream = bp.document_stream(val_docs, tok)
    token_bytes = np.asarray(tok.token_byte_lengths(), dtype=np.int64)
    final = [r for r in read_metrics(tiny_run) if "val_bpb" in r][-1]
    cfg = json.loads((tiny_run / "config.json").read_text())
    n, seq = cfg["train"]["val_tokens"], cfg["train"]["seq_len"]
    s = bp.score_stream(bp.speedrun_logits(tiny_run), stream, token_bytes, seq, max_tokens=n)
    assert s.tokens == n
    assert s.nll_nats == pytest.approx(final["val_loss"] * n, rel=1e-5)
    assert s.bpb == pytest.approx(final["val_bpb"], rel=1e-5)
    assert s.bpb == pytest.approx(s.nll_nats / math.log(2) / s.bytes)

    curve = bp.speedrun_curve(tiny_run)  # steps 1..timing_warmup_steps trained off the clock: added back
    untimed = [r for r in read_metrics(tiny_run) if "train_loss" in r and r["time_s"] == 0]
    assert len(untimed) == cfg["train"]["timing_warmup_steps"] and curve[-1]["step"] == cfg["train"]["steps"]
    assert curve[-1]["seconds"] > final["time_s"]

    whole = bp.score_stream(bp.speedrun_logits(tiny_run), stream, token_bytes, seq)  # a shorter last row
    assert whole.tokens == len(stream) - 1 and whole.tokens % seq != 0
    assert whole.bytes == sum(len(d.encode("utf-8")) for d in val_docs)


def test_export_is_the_shards_and_other_documents_are_refused(text_data, data_copy):
    """The re-split documents tokenize to exactly the shards; a folder split with another seed is refused."""
    from speedrun.data.meta import shard_paths
    from speedrun.data.shards import open_shard

    meta, train_docs, val_docs, tok = bp.split_documents(text_data)
    assert len(train_docs) == meta["splits"]["train"]["documents"]
    val = np.concatenate([np.asarray(open_shard(p)) for p in shard_paths(text_data, "val", meta)])
    np.testing.assert_array_equal(bp.document_stream(val_docs, tok), val)
    saved = json.loads((data_copy / "meta.json").read_text())
    (data_copy / "meta.json").write_text(json.dumps({**saved, "seed": saved["seed"] + 1}))
    with pytest.raises(bp.BenchError, match="differ from its shards"):
        bp.split_documents(data_copy)


def test_time_to_target_interpolates_and_ratios_compare_to_the_fastest():
    slow = [
        {"step": s, "tokens": s, "seconds": float(s), "bpb": b} for s, b in ((10, 3.0), (20, 2.5), (30, 2.2))
    ]
    fast = [
        {"step": s, "tokens": s, "seconds": s / 2, "bpb": b} for s, b in ((10, 2.6), (20, 2.1), (30, 1.9))
    ]
    result = bp.report({"slow": slow, "fast": fast})
    assert result["target_bpb"] == 2.2
    # np.interp over the decreasing bpb curve (reversed to increase) is the reference
    ref_fast = float(np.interp(2.2, [2.1, 2.6], [10.0, 5.0]))
    assert result["systems"]["fast"]["time_to_target"] == pytest.approx(ref_fast)
    assert result["systems"]["slow"]["time_to_target"] == 30.0
    assert result["systems"]["slow"]["ratio"] == pytest.approx(30.0 / ref_fast)
    assert bp.time_to(fast, 2.7) == 5.0 and bp.time_to(fast, 1.0) is None
    assert not result["systems"]["fast"]["at_first_point"]
    early = bp.report({"slow": slow, "fast": fast[1:]})  # already below 2.2 at its first checkpoint
    assert early["systems"]["fast"]["at_first_point"] and early["systems"]["fast"]["time_to_target"] == 10.0


def test_litgpt_clock_leaves_out_compilation_and_checkpoint_saves():
    """Rows as LitGPT's CSV logger writes them, made from a known training clock plus a 30 s compile in
    iteration 1 and a 2 s save after every 3rd step: the clock recovered is the training clock."""
    step_s, gap_s, rows, clock, train = 0.1, 0.01, [], 0.0, {}
    for it in range(1, 10):
        took = step_s + (30.0 if it == 1 else 0.0)
        clock += took + gap_s + (2.0 if it > 1 and (it - 1) % 3 == 0 else 0.0)
        train[it] = it * (step_s + gap_s)
        rows.append({"iter": str(it), "time": repr(clock), "iter_time": repr(took)})
    got = bp.litgpt_seconds(rows, save_every=3)
    assert got == pytest.approx(train)


def test_usage_errors_are_one_line_and_exit_2(tmp_path):
    (tmp_path / "x").write_text("")
    new = str(tmp_path / "new")
    for args in (
        ["--out", str(tmp_path)],
        ["--out", new, "--systems", "nanochat"],
        ["--out", new, "--speedrun-run", str(tmp_path)],
        ["--out", new, "--every", "0"],
    ):
        r = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)
        assert r.returncode == 2
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_litgpt_checkpoint_is_scored_as_litgpt_scores_it(tmp_path):
    """A LitGPT model saved as `litgpt pretrain` saves it: the evaluator's NLL equals LitGPT's own
    chunked cross-entropy over the same rows."""
    pytest.importorskip("litgpt", reason="litgpt is a benchmark-only requirement (see bench_peers.py)")
    from litgpt.config import Config
    from litgpt.model import GPT
    from litgpt.utils import chunked_cross_entropy, save_config

    size = {
        "n_layer": 2,
        "n_head": 2,
        "n_embd": 32,
        "intermediate_size": 64,
        "vocab_size": 96,
        "block_size": 16,
    }
    cfg = Config(**{**bp.demo_size({"model": {**size, "vocab_size": 96}, "train": {"seq_len": 16}}), **size})
    torch.manual_seed(0)
    model = GPT(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    torch.save({"model": model.state_dict(), "iter_num": 3}, tmp_path / "lit_model.pth")
    save_config(cfg, tmp_path)
    rng = np.random.default_rng(0)
    stream = rng.integers(0, 96, size=16 * 5 + 1)
    token_bytes = rng.integers(1, 5, size=96)
    s = bp.score_stream(bp.litgpt_logits(tmp_path), stream, token_bytes, 16)
    ids = torch.from_numpy(stream)
    with torch.no_grad():
        logits = model.eval()(ids[:-1].view(5, 16))
        ref = float(chunked_cross_entropy(logits, ids[1:].view(5, 16))) * 80
    assert s.nll_nats == pytest.approx(ref, rel=1e-5)
    assert s.bytes == int(token_bytes[stream[1:]].sum())
