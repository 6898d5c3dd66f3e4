"""demo-2026: record-2026-07's composition at the CPU demo's size, run by `speedrun train --recipe
demo-2026`. It resolves to the gpt2026 family with the record's cheap parts on, keeps the demo's data,
batch and 150 s budget logic, dry-runs with its parameter count, picks fp32 with nothing left in bf16 on
a CPU without fast bf16, and trains a few steps shrunk (fp32 and bf16 autocast)."""

from __future__ import annotations

import math

import pytest
import torch

from speedrun.cli import main
from speedrun.model.families import build_model
from speedrun.recipes import load_recipe

RECIPE = "demo-2026"


def test_it_resolves_to_the_2026_composition_with_the_demos_data_batch_and_budget():
    cfg, demo = load_recipe(RECIPE), load_recipe("demo")
    m = cfg.model
    assert m.family == "gpt2026" and (m.n_layer, m.n_head, m.n_embd, m.vocab_size) == (4, 4, 256, 4096)
    assert (
        m.attn.xsa_layers
        and m.attn.paired_layers
        and m.attn.key_offset_layers
        and m.skips
        and m.stream.backout_layer
    )
    assert (
        m.attn_inputs and m.embed.bigram_rows and m.embed.bigram_sign_rows and m.embed.smear and m.values.gate
    )
    assert m.init.value_embed_std == 0.01 and m.values.ve_dims == 6
    keys = ("time_budget_s", "budget_min_steps", "steps", "global_batch_tokens")
    keys += ("warmdown_steps", "warmdown_frac")
    for key in keys:
        assert getattr(cfg.train, key) == getattr(demo.train, key), key
    assert (cfg.data.source, cfg.data.tokenizer, cfg.train.val_tokens) == (
        demo.data.source,
        demo.data.tokenizer,
        demo.train.val_tokens,
    )
    assert cfg.train.dtype == demo.train.dtype == "auto"


def test_dry_run_prints_its_parameter_count(capsys):
    assert main(["train", "--recipe", RECIPE, "--dry-run"]) == 0
    out = capsys.readouterr().out
    torch.manual_seed(0)
    count = sum(p.numel() for p in build_model(load_recipe(RECIPE).model).parameters())
    assert f"params: {count}\n" in out


def test_a_cpu_without_fast_bf16_trains_it_in_fp32_with_nothing_in_bf16(monkeypatch):
    """The demo's mechanism (precision.resolve on train.dtype=auto): on an AVX2-only host every matrix,
    embedding and the head's softcap and cross-entropy stay fp32 (emulated bf16 is ~100x slower)."""
    from speedrun.train.plan import precision

    monkeypatch.setattr(precision, "fast_bf16", lambda _type: (False, "no bf16 here"))
    cfg = load_recipe(RECIPE)
    chosen = precision.resolve(cfg, torch.device("cpu"))
    assert chosen.dtype == "fp32" and chosen.autocast is None
    m = precision.effective_config(cfg, chosen).model
    assert (m.embed.dtype, m.block_dtype, m.head.softcap_in_bf16, m.head.ce_bf16, m.head.fp8, m.mlp.fp8) == (
        "fp32",
        "fp32",
        False,
        False,
        False,
        False,
    )
    assert {p.dtype for p in build_model(m).parameters()} == {torch.float32}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_it_trains_a_few_steps_shrunk(dtype, trained):
    """runs.py `demo-2026-DTYPE`: 8 steps at n_embd 64 on the bpe:512 data, validated every 4."""
    run = trained(f"demo-2026-{dtype}")
    val = [r["val_loss"] for r in run.metrics if "val_loss" in r]
    assert len(val) == 3 and all(math.isfinite(v) for v in val) and val[-1] < val[0], val
    assert run.summary["precision"]["dtype"] == dtype and run.summary["steps"] == 8
