"""`speedrun bench` on a tiny recipe: it runs the project's train_step, its numbers are consistent with
each other, the JSON matches what it printed, and the synthetic tokens have the promised shape."""

import json

import numpy as np
import pytest

import speedrun.tools.bench as bench
from speedrun.cli import main
from speedrun.train.step import train_step
from tests.conftest import TINY


@pytest.mark.slow
def test_bench_calls_train_step_and_reports_consistent_numbers(tmp_path, capsys, monkeypatch):
    calls = []

    def counting_train_step(*args, **kwargs):
        calls.append(args[3])  # accumulation steps
        return train_step(*args, **kwargs)

    monkeypatch.setattr(bench, "train_step", counting_train_step)
    out = tmp_path / "bench.json"
    argv = ["bench", "--recipe", "demo", "--steps", "3", "--warmup", "1", "--json", str(out), *TINY]
    assert main(argv) == 0
    assert calls == [2, 2, 2, 2]  # 1 warm-up + 3 timed steps of 1024 / 512 micro-batches
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["recipe"] == "demo" and r["steps_timed"] == 3 and r["tokens_per_step"] == 1024
    assert r["forward_backward_ms"] + r["optimizer_ms"] == pytest.approx(r["step_ms"])
    assert 0 < r["optimizer_ms"] < r["step_ms"]
    assert r["tokens_per_s"] == pytest.approx(1024 / (r["step_ms"] / 1000))
    ratio = r["flops_per_token"] * r["tokens_per_s"] / r["measured_peak_flops"]
    assert r["mfu_measured_peak"] == (pytest.approx(ratio) if ratio <= 1 else None)  # never above 100 %
    assert r["device"] == "cpu" and r["datasheet_bf16_peak_flops"] is None
    assert f"{r['tokens_per_s']:,.0f}" in printed and "fwd+bwd" in printed and "optimizer" in printed
    assert f"of the run with validation {r['memory_estimate_bytes'] / 2**20:,.0f} MiB" in printed
    assert f"training step {r['memory_estimate_training_bytes'] / 2**20:,.0f} MiB" in printed
    assert r["memory_estimate_training_bytes"] <= r["memory_estimate_bytes"]  # a part of the run's peak


def test_bench_usage_errors_are_one_line(capsys):
    assert main(["bench", "--steps", "0"]) == 2
    assert main(["bench", "--recipe", "no-such-recipe"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and all(e.startswith("speedrun: error:") for e in errors)


def test_synthetic_tokens_have_documents_and_a_zipf_head():
    tokens = bench.synthetic_tokens(200_000, 1000, 999, mean_doc=100, seed=0)
    assert tokens[0] == 999 and tokens.max() < 1000
    docs = int(np.count_nonzero(tokens == 999))
    assert 1000 < docs < 3000  # about one document start per 100 tokens
    counts = np.sort(np.bincount(tokens[tokens != 999], minlength=1000))[::-1]
    assert counts[0] > 20 * counts[500]  # p ∝ 1/(rank + 10): the head is far more frequent than the tail


@pytest.mark.slow
def test_bench_feeds_a_varlen_recipe_the_loaders_cu_seqlens(monkeypatch):
    """A varlen recipe trains on packed rows with cu_seqlens (data/bos_loader.py); the bench must time
    that path, not the document-mask path a batch without them takes (on a GPU the two differ ~10x)."""
    import torch

    from speedrun.data.bos_loader import cu_seqlens, record_max_docs
    from speedrun.recipes import load_recipe
    from tests.recipe_matrix import shrink

    cfg = load_recipe("stages-2025-12", shrink("stages-2025-12"))
    assert cfg.model.attention == "varlen"
    seen = []

    def recording_train_step(model, optimizer, next_batch, *args, **kwargs):
        def peek():
            batch = next_batch()
            seen.append(batch)
            return batch

        return train_step(model, optimizer, peek, *args, **kwargs)

    monkeypatch.setattr(bench, "train_step", recording_train_step)
    tokens = bench.synthetic_tokens  # documents of ~64 tokens, so each 256-token row holds several
    short = lambda n, v, e, mean_doc, seed=0: tokens(n, v, e, 64, seed)  # noqa: E731
    monkeypatch.setattr(bench, "synthetic_tokens", short)
    r = bench.run_bench(cfg, torch.device("cpu"), steps=1, warmup=1)
    assert r["attention"] == "varlen" and len(seen) == 4  # 2 steps x 2 micro-batches
    for x, y, cu in seen:
        assert x.shape == (1, cfg.train.micro_batch_tokens) and torch.equal(x[0, 1:], y[0, :-1])
        want, _ = cu_seqlens(x[0].numpy(), cfg.model.eot_id, cfg.data.max_docs or record_max_docs(x.size(1)))
        assert torch.equal(cu, torch.from_numpy(want)) and cu.dtype == torch.int32
        assert int((cu[1:] < x.size(1)).sum()) >= 1  # the row really holds several documents
