"""GPU-only checks of the compiled paths (skipped without CUDA; benchmarks/gpu_check.sh runs them):
the full-size flagship recipe compiled by inductor, the FP8 head against the bf16 head, and
FlexAttention at the records' 65,536 tokens against a chunked dense reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from speedrun.model import fp8
from speedrun.model.attention import MaskSpec, _chunked, build_block_mask, document_ids
from speedrun.model.flex import flex_attend
from speedrun.recipes import load_recipe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_full_size_record_2025_01_compiled_20_steps_finite_falling_loss_no_recompiles():
    """The recipe's real model and micro-batch (65,536 tokens), compiled as `speedrun train` compiles
    it (inductor, fullgraph, static shapes), one micro-batch per step: 20 steps with the window, LR and
    momentum schedules moving; the loss stays finite and falls, and nothing compiles after step 1."""
    from torch._dynamo.utils import counters

    from speedrun.optim.build import build_optimizer
    from speedrun.tools.bench import synthetic_tokens
    from speedrun.train.distributed import DistContext
    from speedrun.train.loop import build_model
    from speedrun.train.schedule import apply_schedule, schedule_at
    from speedrun.train.step import autocast_dtype, train_step

    torch._dynamo.reset()
    counters.clear()
    cfg = load_recipe("record-2025-01", ["train.global_batch_tokens=65536", "train.steps=20"])
    device = torch.device("cuda")
    model, compiled = build_model(cfg, DistContext(0, 0, 1, device))
    assert compiled is not model
    optimizer = build_optimizer(model, cfg)
    T, n = cfg.train.seq_len, cfg.train.micro_batch_tokens
    pool = torch.from_numpy(synthetic_tokens(n + 1, cfg.model.vocab_size, cfg.model.eot_id, 1000)).to(device)
    x, y = pool[:-1].view(-1, T).long(), pool[1:].view(-1, T).long()  # one batch, learnt quickly
    losses, graphs = [], None
    for step in range(20):
        apply_schedule(schedule_at(step, cfg), optimizer, model)
        losses.append(train_step(compiled, optimizer, lambda: (x, y), 1, autocast_dtype(cfg)).item())
        if step == 0:
            graphs = counters["stats"]["unique_graphs"]
    assert all(math.isfinite(v) for v in losses), losses
    assert np.mean(losses[-5:]) < losses[0] - 0.5, losses
    assert counters["stats"]["unique_graphs"] == graphs, "recompiled after the first step"


def test_fp8_head_logits_match_the_bf16_head_within_e4m3_resolution():
    """Same inputs through the FP8 head (compiled bodies, `_scaled_mm`) and the bf16 head: e4m3 keeps
    3 mantissa bits, so each product is off by up to ~2·2^-4 relative; summed over 768 terms of random
    sign the logits differ by a few % of their scale. And against fp64 products of the same fp8 values
    (what _scaled_mm must compute), one bf16 rounding plus fast accumulation."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8192, 768, device="cuda", generator=gen).bfloat16()
    w = torch.randn(50304, 768, device="cuda", generator=gen) * 0.05
    got = fp8.fp8_linear(x, w).float()
    bf16 = (x @ w.bfloat16().T).float()
    scale = bf16.abs().max()
    assert (got - bf16).abs().max() / scale < 0.1
    assert 1e-3 < (got - bf16).abs().mean() / bf16.abs().mean() < 0.08
    xq = (x * fp8.X_SCALE).to(torch.float8_e4m3fn).double() / fp8.X_SCALE
    wq = (w * fp8.W_SCALE).to(torch.float8_e4m3fn).double() / fp8.W_SCALE
    torch.testing.assert_close(got.double(), xq @ wq.T, rtol=2**-7, atol=1e-3 * float(scale))


def test_flex_attention_at_65536_tokens_with_documents_matches_chunked_dense():
    """FlexAttention (the compiled wrapper, as evaluation calls it) with document masking and a
    sliding block window at the records' sequence length, against dense SDPA in 1,024-row chunks (never
    a T × T matrix); forward and gradients."""
    T = 65536
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(1, 50000, (1, T), device="cuda", generator=gen)
    starts = torch.randint(0, T, (40,), device="cuda", generator=gen)
    tokens[0, starts] = 50256
    spec = MaskSpec(document_ids(tokens, 50256), torch.tensor(1792, device="cuda"), True, 1792)
    q, k, v = (torch.randn(1, 6, T, 128, device="cuda", generator=gen).bfloat16() for _ in range(3))
    for t in (q, k, v):
        t.requires_grad_()
    out = flex_attend(q, k, v, build_block_mask(spec, T), scale=0.12)
    grad = torch.randn_like(out)
    got = [out, *torch.autograd.grad(out, (q, k, v), grad)]
    ref = _chunked(q, k, v, spec, 0.12, 0)
    want = [ref, *torch.autograd.grad(ref, (q, k, v), grad)]
    for g, r in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), r.float(), atol=3e-2, rtol=3e-2)
