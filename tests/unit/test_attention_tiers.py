"""Every attention tier against one dense T × T-mask reference built here from the definition
(causal, same document by cu_seqlens, q − k < window): the blocked SDPA tier with gradients and
FlexAttention's forward on CPU; FlexAttention's backward and FA3 on CUDA (`gpu`)."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from speedrun.model.gpt2026 import attention_tiers as tiers
from tests.model_refs import dense_reference


def packed_cu(T: int, lengths: list[int], max_docs: int = 16) -> torch.Tensor:
    """Padded cu_seqlens for documents of `lengths` (the last one runs to T)."""
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    starts = starts[starts < T]
    cu = torch.full((max_docs,), T, dtype=torch.int32)
    cu[: len(starts)] = starts
    return cu


def reference(q, k, v, cu, window, scale):
    """Brute force: the visibility of every (query, key) pair from the definition, then SDPA."""
    T = q.size(0)
    bounds = cu.tolist()
    doc = [
        max(i for i, b in enumerate(bounds) if b <= t and (i + 1 == len(bounds) or bounds[i + 1] > t))
        for t in range(T)
    ]
    mask = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        for j in range(i + 1):
            mask[i, j] = doc[i] == doc[j] and (window == 0 or i - j < window)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, scale=scale
    )
    return out.transpose(0, 1)


CASES = [  # T, document lengths, window
    (256, [256], 0),
    (256, [40, 100, 3, 60], 0),
    (384, [200, 1, 150], 33),
    (512, [70, 300, 90], 129),
    (256, [256], 64),
]


@pytest.mark.parametrize("T,lengths,window", CASES)
def test_blocked_tier_matches_the_dense_reference_with_gradients(T, lengths, window):
    torch.manual_seed(T + window)
    cu = packed_cu(T, lengths)
    qkv = [torch.randn(T, 2, 16, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    want = reference(*qkv, cu, window, 0.12)
    want_grads = torch.autograd.grad(want.square().sum(), qkv)
    assert torch.equal(dense_reference(*qkv, cu, window, 0.12), want)
    got = tiers.blocked_attention(*qkv, cu, window, 0.12, block=96)  # blocks cross documents and windows
    grads = torch.autograd.grad(got.square().sum(), qkv)
    torch.testing.assert_close(got, want)
    for g, r in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("T,lengths,window", CASES)
def test_flex_tier_forward_matches_the_dense_reference_on_cpu(T, lengths, window):
    torch.manual_seed(T)
    cu = packed_cu(T, lengths)
    q, k, v = (torch.randn(T, 2, 16) for _ in range(3))
    with torch.no_grad():
        got = tiers.flex_varlen(q, k, v, cu, window, 0.12)
    torch.testing.assert_close(got, dense_reference(q, k, v, cu, window, 0.12), atol=2e-5, rtol=2e-5)


def test_cpu_gets_the_blocked_tier_and_a_missing_fa3_build_logs_one_line(monkeypatch, caplog):
    assert tiers.choose_tier("auto", torch.device("cpu"), 256) == "blocked"
    assert tiers.choose_tier("fa3", torch.device("cpu"), 256) == "blocked"
    fake = types.ModuleType("kernels")

    def no_build(repo, version):
        raise FileNotFoundError(f"{repo} has no build variant torch213-cxx11-cu126-aarch64-linux\nmore")

    fake.get_kernel = no_build
    monkeypatch.setitem(sys.modules, "kernels", fake)
    monkeypatch.setattr(tiers, "_fa3", [])
    with caplog.at_level(logging.WARNING):
        assert tiers.load_fa3() is None
        assert tiers.load_fa3() is None
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["attention: FA3 unavailable (kernels-community/flash-attn3 has no build variant "
                     "torch213-cxx11-cu126-aarch64-linux); using the next tier"]  # fmt: skip
    import huggingface_hub.constants as hub

    assert hub.HF_HUB_OFFLINE in (False, True)  # restored, whatever it was


def test_the_fa3_lookup_is_resolved_before_compile_and_a_constant_inside_it(monkeypatch):
    """The first CUDA lease: dynamo traced load_fa3's `from kernels import ...` inside the compiled step
    and failed (fullgraph). GPT2026 resolves it when built on a CUDA host; a compiled graph reads the
    answer and never imports."""
    fake = types.ModuleType("kernels")
    calls = []

    def no_build(repo, version):
        calls.append(repo)
        raise FileNotFoundError("no build")

    fake.get_kernel = no_build
    monkeypatch.setitem(sys.modules, "kernels", fake)
    monkeypatch.setattr(tiers, "_fa3", [])
    cuda = types.SimpleNamespace(type="cuda")  # choose_tier reads the device's type only
    pick = torch.compile(lambda x: x + len(tiers.choose_tier("auto", cuda, 256)),
                         backend="eager", fullgraph=True)  # fmt: skip
    with pytest.raises(Exception, match="runs once before compile"):
        pick(torch.zeros(2))  # unresolved inside a graph: a programmer error, not a silent import
    torch._dynamo.reset()
    from speedrun.model.gpt2026.model import GPT2026
    from speedrun.recipes import load_recipe
    from tests.recipe_matrix import shrink

    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        GPT2026(load_recipe("banks-2026-01", shrink("banks-2026-01")).model)  # a "CUDA host": resolves it
    assert calls == [tiers.FA3_REPO] and tiers._fa3 == [None]
    assert pick(torch.zeros(2)).tolist() == [4.0, 4.0]  # "flex": FA3 unavailable, T a multiple of 128
    assert calls == [tiers.FA3_REPO]  # compiled without a second lookup


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tier", ["flex", "fa3"])
def test_cuda_tiers_match_the_dense_reference_with_gradients(tier):
    if tier == "fa3" and tiers.load_fa3() is None:
        pytest.skip("no cached FA3 build (fetch it ahead, see model/gpt2026/attention_tiers.py)")
    torch.manual_seed(0)
    T = 2048
    cu = packed_cu(T, [100, 29, 571, 1, 799]).cuda()
    for window in (0, 300, 1024):
        qkv = [
            torch.randn(T, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
        ]
        got = tiers.varlen_attention(*qkv, cu, window, 0.12, max_seqlen=T, tier=tier)
        grads = torch.autograd.grad(got.float().square().sum(), qkv)
        ref = dense_reference(*[t.float() for t in qkv], cu, window, 0.12)
        ref_grads = torch.autograd.grad(ref.square().sum(), qkv)
        torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=2e-2)
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g.float(), r.float(), atol=5e-2, rtol=5e-2)


def test_the_cuda_tiers_forward_traces_in_one_graph_on_the_cpu(monkeypatch):
    """What the first CUDA lease could not check: a whole gpt2026 varlen forward through the CUDA
    branch (FA3 looked up, absent; the flex tier builds its block mask from cu_seqlens inside the graph)
    traced by dynamo with fullgraph, as training compiles it, equal to the CPU's blocked tier."""
    from speedrun.model.families import build_model
    from speedrun.recipes import load_recipe
    from speedrun.train.schedule import apply_to_model, schedule_at
    from tests.recipe_matrix import shrink

    recipe = "record-2026-07"
    cfg = load_recipe(recipe, [*shrink(recipe), "model.max_seq_len=512", "model.embed_dtype=fp32"])
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    apply_to_model(schedule_at(cfg.train.steps, cfg), model)
    idx = torch.randint(0, cfg.model.eot_id, (1, 512), generator=torch.Generator().manual_seed(2))
    idx[0, [0, 40, 200]] = cfg.model.eot_id
    cu = packed_cu(512, [40, 160])
    with torch.no_grad():
        want = model(idx, cu_seqlens=cu)  # the blocked tier
        monkeypatch.setattr(tiers, "_fa3", [None])
        monkeypatch.setattr(tiers, "on_cuda", lambda device: True)
        assert tiers.choose_tier("auto", idx.device, 512) == "flex"
        torch._dynamo.reset()
        got = torch.compile(model, backend="eager", fullgraph=True, dynamic=False)(idx, cu_seqlens=cu)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_cuda_tiers_training_step_compiles_in_one_graph_on_the_cpu(monkeypatch):
    """The same CUDA branch with gradients, as `speedrun train` and `bench` compile a step (fullgraph,
    aot_eager: FlexAttention's own op trains through its reference on the CPU): the loss and every
    gradient equal the blocked tier's eager step."""
    from speedrun.model.families import build_model
    from speedrun.recipes import load_recipe
    from speedrun.train.schedule import apply_to_model, schedule_at
    from tests.recipe_matrix import shrink

    recipe = "record-2026-07"
    cfg = load_recipe(recipe, [*shrink(recipe), "model.max_seq_len=512", "model.embed_dtype=fp32"])
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    apply_to_model(schedule_at(0, cfg), model)
    idx = torch.randint(0, cfg.model.eot_id, (1, 512), generator=torch.Generator().manual_seed(2))
    idx[0, [0, 40, 200]] = cfg.model.eot_id
    targets = torch.roll(idx, -1, 1)
    cu = packed_cu(512, [40, 160])
    model(idx, targets, cu_seqlens=cu).backward()  # the blocked tier
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    want_loss = model(idx, targets, cu_seqlens=cu).detach()
    model.zero_grad(set_to_none=True)
    monkeypatch.setattr(tiers, "_fa3", [None])
    monkeypatch.setattr(tiers, "on_cuda", lambda device: True)
    flex_calls, flex = [], tiers.flex_varlen
    monkeypatch.setattr(tiers, "flex_varlen", lambda *a: flex_calls.append(a[-2]) or flex(*a))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=False)
    loss = compiled(idx, targets, cu_seqlens=cu)
    loss.backward()
    assert flex_calls, "the step did not take the CUDA flex tier"
    torch.testing.assert_close(loss.detach(), want_loss, rtol=1e-5, atol=1e-5)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys()
    for n, g in got.items():
        torch.testing.assert_close(g, want[n], rtol=1e-3, atol=1e-5, msg=n)
