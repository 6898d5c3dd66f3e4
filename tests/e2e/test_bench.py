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
    assert r["recipe"] == "demo" and r["steps_timed"] == 3 and len(r["stages"]) == 1  # no train.stages
    s = r["stages"][0]
    assert s["stage"] == 0 and s["tokens_per_step"] == 1024 and s["anchor"] is None
    assert s["forward_backward_ms"] + s["optimizer_ms"] == pytest.approx(s["step_ms"])
    assert 0 < s["optimizer_ms"] < s["step_ms"]
    assert s["tokens_per_s"] == pytest.approx(1024 / (s["step_ms"] / 1000))
    ratio = s["flops_per_token"] * s["tokens_per_s"] / r["measured_peak_flops"]
    assert s["mfu_measured_peak"] == (pytest.approx(ratio) if ratio <= 1 else None)  # never above 100 %
    assert (
        r["device"] == "cpu" and r["datasheet_bf16_peak_flops"] is None and s["peak_allocated_bytes"] is None
    )
    assert f"{s['tokens_per_s']:,.0f}" in printed and "fwd+bwd" in printed and "optimizer" in printed
    assert "n/a on CPU" in printed
    assert f"of the run with validation {r['memory_estimate_bytes'] / 2**20:,.0f} MiB" in printed
    assert f"training step {r['memory_estimate_training_bytes'] / 2**20:,.0f} MiB" in printed
    assert r["memory_estimate_training_bytes"] <= r["memory_estimate_bytes"]  # a part of the run's peak


def test_bench_usage_errors_are_one_line(capsys):
    assert main(["bench", "--steps", "0"]) == 2
    assert main(["bench", "--recipe", "no-such-recipe"]) == 2
    assert main(["bench", "--recipe", "demo", "--stage", "1"]) == 2  # demo has no train.stages
    assert main(["bench", "--recipe", "record-2026-07", "--stage", "9"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 4 and all(e.startswith("speedrun: error:") for e in errors)
    assert "--stage 9: recipe record-2026-07 has stages 1, 2, 3, 4" in errors[3]


def test_synthetic_tokens_have_documents_and_a_zipf_head():
    tokens = bench.synthetic_tokens(200_000, 1000, 999, mean_doc=100, seed=0)
    assert tokens[0] == 999 and tokens.max() < 1000
    docs = int(np.count_nonzero(tokens == 999))
    assert 1000 < docs < 3000  # about one document start per 100 tokens
    counts = np.sort(np.bincount(tokens[tokens != 999], minlength=1000))[::-1]
    assert counts[0] > 20 * counts[500]  # p ∝ 1/(rank + 10): the head is far more frequent than the tail


# three stages of the shrunk recipe (2 rows a step): rows of 128 tokens with documents cut to 48, then
# rows of 256 with windows 1/2 blocks, then the extension's 2 steps
BENCH_STAGES = (
    "train.stages=tokens=256 doc=48 windows=1/1 frac=1/2; tokens=512 windows=1/2 lr=1.5 frac=1/2; "
    "tokens=512 windows=1/2 ext=2"
)


@pytest.mark.slow
def test_bench_times_each_stage_as_train_runs_it_through_the_varlen_path(monkeypatch, capsys):
    """Per stage, every micro-batch the bench feeds is the loader's packed row with its cu_seqlens (so
    the varlen path, not the document-mask fallback, is timed), of the stage's size and document cut,
    and the model holds the stage's windows; an anchor row gives the time-per-token ratio."""
    import torch

    from speedrun.config.stages import stage_plan
    from speedrun.data.bos_loader import cu_seqlens, record_max_docs
    from speedrun.recipes import load_recipe
    from speedrun.tools.anchors import Anchor
    from speedrun.train.stages import stage_values
    from tests.recipe_matrix import shrink

    cfg = load_recipe("stages-2025-12", [*shrink("stages-2025-12"), BENCH_STAGES])
    assert cfg.model.attention == "varlen" and cfg.data.loader == "documents"
    seen = []

    def recording_train_step(model, optimizer, next_batch, *args, **kwargs):
        def peek():
            batch = next_batch()
            seen.append((batch, model.varlen_windows))
            return batch

        return train_step(model, optimizer, peek, *args, **kwargs)

    monkeypatch.setattr(bench, "train_step", recording_train_step)
    tokens = bench.synthetic_tokens  # documents of ~64 tokens, so each row holds several
    short = lambda n, v, e, mean_doc, seed=0: tokens(n, v, e, 64, seed)  # noqa: E731
    monkeypatch.setattr(bench, "synthetic_tokens", short)
    anchor = Anchor(recipe=cfg.recipe, stage=2, gpu="cpu", ms=100.0, tokens=1024, source="a test row")
    r = bench.run_bench(cfg, torch.device("cpu"), steps=1, warmup=1, anchors=[anchor])
    plan = stage_plan(cfg)
    assert [s["stage"] for s in r["stages"]] == [1, 2, 3] and len(seen) == 3 * 2 * 2  # 2 steps x 2 rows
    for k, ((x, y, cu), windows) in enumerate(seen):
        v = stage_values(r["stages"][k // 4]["first_step"], plan)
        row = v.batch_tokens // 2
        assert x.shape == (1, row) and torch.equal(x[0, 1:], y[0, :-1])
        want, _ = cu_seqlens(x[0].numpy(), cfg.model.eot_id, cfg.data.max_docs or record_max_docs(row))
        assert torch.equal(cu, torch.from_numpy(want)) and cu.dtype == torch.int32
        assert int((cu[1:] < row).sum()) >= 1  # the row really holds several documents
        if v.max_doc_len:  # the stage's document cut, as the loader packs it
            assert int(torch.diff(cu).max()) <= v.max_doc_len
        assert (windows.short, windows.long) == (v.short_window * 128 + 1, v.long_window * 128 + 1)
    assert [s["tokens_per_step"] for s in r["stages"]] == [256, 512, 512]
    two = r["stages"][1]
    assert two["anchor_ratio"] == pytest.approx((two["step_ms"] / 512) / (100.0 / 1024))
    assert r["stages"][0]["anchor"] is None and r["stages"][2]["anchor_ratio"] is None
    printed = bench.format_bench(r)
    assert "ours/record" in printed and f"{two['anchor_ratio']:.2f}x" in printed and "a test row" in printed


def test_the_anchor_table_matches_the_recipes_it_names():
    """Every shipped anchor names a bundled recipe and a stage of it with the same tokens per step, so
    its ratio compares like with like; record-2026-07 has its three 1x H100 stages (PR #350)."""
    from speedrun.config.stages import stage_plan
    from speedrun.recipes import load_recipe
    from speedrun.tools.anchors import find_anchor, load_anchors
    from speedrun.train.stages import stage_bounds

    anchors = load_anchors()
    for a in anchors:
        cfg = load_recipe(a.recipe)
        plan = stage_plan(cfg)
        tokens = cfg.train.global_batch_tokens if a.stage == 0 else plan.stages[a.stage - 1].batch_tokens
        assert a.tokens == tokens, a
        assert (a.stage == 0) == (plan is None) and (a.stage == 0 or stage_bounds(plan)[a.stage - 1][1] > 0)
    for stage in (1, 2, 3):
        a = find_anchor(anchors, "record-2026-07", stage)
        assert a is not None and a.gpu == "H100" and not a.bound


def test_the_bench_loader_takes_a_full_size_2026_recipe_as_train_feeds_it(tmp_path):
    """record-2026-07 at full size: 8 rows a step of 16,384 / 32,768 / 49,152 tokens by stage with the
    record's cu_seqlens lengths (64 / 96 / 128). Refused before: the loader's micro-batch went through
    run_data.micro_batch_tokens, which also fits train.val_tokens (10,485,760, no multiple of 49,152)."""
    import torch

    from speedrun.recipes import load_recipe
    from speedrun.train.distributed import DistContext
    from speedrun.train.warmup import loader_at

    cfg = load_recipe("record-2026-07")
    ctx = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    loader = bench.synthetic_loader(cfg, ctx, tmp_path)
    try:
        rows = []
        for _, first, _ in bench.bench_stages(cfg, [1, 2, 3]):
            loader_at(loader, first)
            x, _, cu = loader.next_batch()
            rows.append((x.shape[1], cu.shape[0]))
        assert loader.accumulation_steps == 8 and rows == [(16384, 64), (32768, 96), (49152, 128)]
    finally:
        loader.close()
