"""The FLOPs count (model/flops.py) against hand counts, the record's 6N, the anchors' figures, and a
brute-force count of the (query, key) pairs the mask allows."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from speedrun.config import ModelConfig
from speedrun.model.attention import mask_rule
from speedrun.model.families import family_of
from speedrun.model.flops import StepWindows, matmul_params
from speedrun.model.gpt2024.model import GPT
from speedrun.recipes import load_recipe
from speedrun.train.flops import config_model, run_flops, step_flops, step_flops_at
from speedrun.train.schedule import StepSchedule, tokens_through


def brute_keys(window: int, doc_lens: list[int]) -> int:
    """(query, key) pairs the one mask definition allows over a packed row of `doc_lens` documents."""
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(doc_lens)])
    pos = torch.arange(len(docs))
    allowed = mask_rule(pos[:, None], pos[None, :], docs[:, None], docs[None, :], window if window else None)
    return int(allowed.sum())


def plain_gpt(**fields) -> GPT:
    cfg = dataclasses.replace(ModelConfig(), n_layer=4, n_head=4, n_embd=64, vocab_size=256, **fields)
    return GPT(cfg)


def test_windowed_long_short_pattern_equals_a_hand_count():
    """LSLS at long window 48 (short 24, the token rule's half) over rows of 200 tokens: 6·(12·L·d² + V·d)
    plus 12·d·Σ per-token keys min(w, p + 1) / T for each layer's window."""
    d, L, T = 64, 4, 200
    model = plain_gpt(window=48, window_pattern="LSLS", max_seq_len=T)
    n = L * 12 * d * d + model.lm_head.weight.numel()  # qkv 3d², out d², MLP 8d² per block; the head
    mean = lambda w: sum(min(w, p + 1) for p in range(T)) / T  # noqa: E731
    hand = 6 * n + 12 * d * (2 * mean(48) + 2 * mean(24))
    assert step_flops(model, StepWindows(24, 48), seq_len=T) == pytest.approx(hand, rel=1e-12)
    # the window warm-up: the schedule's 16 gives the short layers 8, by the mask's own rule
    warm = family_of(model.cfg).step_windows(model.cfg, StepSchedule(lr=1.0, muon_momentum=0.95, window=16))
    assert warm == StepWindows(8, 16)
    assert step_flops(model, warm, seq_len=T) == pytest.approx(6 * n + 12 * d * (2 * mean(16) + 2 * mean(8)))


def test_record_2026_07_counts_its_6n_plus_attention_inside_documents_and_windows():
    """#89's 6N is 684.8 M; attention inside <= 2,048-token documents and <= 1,664-token windows adds
    under 0.2 G (the old count, the whole 49,152-token row as one sequence, printed 5.2 G)."""
    cfg = load_recipe("record-2026-07")
    model = config_model(cfg)
    for step in (0, cfg.train.steps // 2, cfg.train.steps - 1):
        assert 684.8e6 <= step_flops_at(model, cfg, step) < 684.8e6 + 0.2e9 + 1e6  # 6N to ~1 M


def test_record_2025_01_at_the_benchs_window_128():
    """gpu-anchors.md: long 128 on 3 layers, short 64 on 8, 12·768·(3·128 + 8·64) on 6N: 735.6 M."""
    cfg = load_recipe("record-2025-01")
    count = step_flops(config_model(cfg), StepWindows(64, 128), seq_len=cfg.train.seq_len)  # 65,536
    assert count == pytest.approx(735.6e6, abs=0.15e6)


def test_a_staged_recipe_counts_each_stage_at_its_windows_and_documents():
    """Each stage of record-2026-07 at its own (short, long) blocks·128 + 1 and document cut, by brute
    force over a row of its documents; the run's total is Σ tokens × the count of the step's stage."""
    cfg = load_recipe("record-2026-07")
    model = config_model(cfg)
    m, T = cfg.model, cfg.train.seq_len
    width = m.n_head * ((m.attn.qk_head_dim or m.n_embd // m.n_head) + m.n_embd // m.n_head) / 2
    kinds = [w for i, w in enumerate(m.windows or ["L"] * m.n_layer) if i in m.attention_layers]
    paired = [i in m.attn.paired_layers for i in m.attention_layers]  # #58: each document twice, interleaved
    n6 = 6 * matmul_params(model)  # checked against hand counts above
    stages = {0: (1, 3, 896), cfg.train.steps - 1: (6, 13, 2048)}  # the recipe's first and last stage
    for step, (short, long, doc) in stages.items():
        lens = [doc] * (T // doc) + [T % doc] * bool(T % doc)
        keys = {
            (k, two): sum(min(b * 128 + 1, p + 1) for n in lens for p in range((1 + two) * n))
            for k, b in (("S", short), ("L", long))
            for two in (False, True)
        }
        # a paired layer: H/2 heads over the 2T interleaved queries, so its pairs count half
        pairs = sum(keys[k, two] / (1 + two) for k, two in zip(kinds, paired, strict=True))
        hand = n6 + 12 * width * pairs / T
        assert step_flops_at(model, cfg, step) == pytest.approx(hand, rel=1e-9)
    total = sum(
        (tokens_through(s + 1, cfg) - tokens_through(s, cfg)) * step_flops_at(model, cfg, s)
        for s in range(cfg.train.steps)
    )
    assert run_flops(model, cfg, cfg.train.steps) == pytest.approx(total, rel=1e-12)


@pytest.mark.parametrize("window", [0, 1, 5, 64])
def test_known_document_lengths_equal_the_pairs_the_mask_allows(window):
    """A varlen row of known documents: the count's context is Σ over tokens min(window, position in
    document + 1), which must equal the (query, key) pairs the mask rule lets through."""
    cfg = load_recipe("demo-2026")
    model = config_model(cfg)
    lens = [1, 7, 130, 33, 2, 200]
    fam = family_of(cfg.model)
    layers = fam.attention_layers(model)
    widths = {lay.width for lay in layers}
    assert len(widths) == 1
    (width,) = widths
    n6 = 6 * matmul_params(model)
    got = step_flops(model, StepWindows(window, window), doc_lens=lens)
    brute = {False: brute_keys(window, lens), True: brute_keys(window, [2 * n for n in lens])}
    # a paired layer has H/2 heads over the 2T interleaved queries: its pairs count half
    expected = n6 + 12 * width * sum(brute[lay.paired] / (1 + lay.paired) / sum(lens) for lay in layers)
    assert got == pytest.approx(expected, rel=1e-12)


def test_an_old_gpt2026_run_folder_without_a_count_works_in_the_flops_tools(tmp_path):
    """tools/flops.py goes through the family record: an old gpt2026 run (no count in summary.json)
    gets its count from config.json, not from the 2024 class (which raised AttributeError)."""
    from speedrun.tools.flops import train_flops
    from speedrun.tools.results import load_run

    cfg = load_recipe("demo-2026", ["train.steps=3"])
    run = tmp_path / "old"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    summary = {"recipe": "demo-2026", "steps": 3, "status": "finished", "final_val_loss": 5.0}
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "metrics.jsonl").write_text(
        json.dumps({"step": 3, "val_loss": 5.0, "tokens": tokens_through(3, cfg)}) + "\n"
    )
    loaded = load_run(run)
    expected = run_flops(config_model(cfg), cfg, 3)
    assert train_flops(loaded) == pytest.approx(expected, rel=1e-12)
