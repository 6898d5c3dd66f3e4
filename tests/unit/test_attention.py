"""Attention masks and backends against independent references: brute-force masks, dense SDPA,
block-reduced dense masks, exact fractions for the window schedules."""

import math
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

import speedrun.model.attention as A
from speedrun.config import ModelConfig
from speedrun.model.attention import (
    MaskSpec,
    attend,
    block_structure,
    build_block_mask,
    choose_backend,
    document_ids,
    flex_attend,
    short_window,
    spec_dense_mask,
)
from speedrun.model.families import build_model
from speedrun.train.schedule import window_tokens
from tests.unit.test_architecture import docs_batch, randomize, tiny

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
BS = A.BLOCK_SIZE


def make_docs(T: int, starts: list[int], batch: int = 1) -> torch.Tensor:
    """(batch, T) token ids with end-of-text (0) at `starts` (shifted by 37·row for the other rows)."""
    tokens = torch.randint(1, 100, (batch, T), generator=torch.Generator().manual_seed(T))
    for r in range(batch):
        for s in starts:
            tokens[r, (s + 37 * r) % T] = 0
    return tokens


def brute_force_mask(
    doc: torch.Tensor | None, T: int, window: int | None, block_window: bool
) -> torch.Tensor:
    """(T, T) mask from the plain-language definition, one pair at a time (row 0 of `doc`)."""
    ids = doc[0].tolist() if doc is not None else [0] * T
    rows = []
    for i in range(T):
        row = []
        for j in range(T):
            if window is None:
                near = True
            elif block_window:
                near = (i // BS - j // BS) * BS < window
            else:
                near = i - j < window
            row.append(j <= i and ids[i] == ids[j] and near)
        rows.append(row)
    return torch.tensor(rows)


# (T, document starts, window, block window): windows below a block, documents crossing block edges,
# one long document, no documents at all, block windows of one and several blocks.
CASES = [
    (512, [0, 100, 129, 300, 301, 450], 5, False),
    (512, [0, 127, 128, 255, 390], 64, False),
    (512, [0, 200], 200, False),
    (512, [], 129, False),
    (384, [0, 50, 260], None, False),
    (512, [0, 100, 300], 128, True),
    (640, [0, 333], 384, True),
    (256, [0, 10, 20, 30, 140], 1, False),
]


def spec_for(tokens, window, block_window, docs=True) -> MaskSpec:
    w = torch.tensor(window, dtype=torch.int32, device=tokens.device) if window is not None else None
    return MaskSpec(document_ids(tokens, 0) if docs else None, w, block_window, max_window=window or 0)


@pytest.mark.parametrize("T, starts, window, block_window", CASES)
def test_mask_rule_equals_brute_force(T, starts, window, block_window):
    tokens = make_docs(T, starts)
    spec = spec_for(tokens, window, block_window)
    got = spec_dense_mask(spec, 0, T, 0, T, None)[0, 0]
    assert torch.equal(got, brute_force_mask(document_ids(tokens, 0), T, window, block_window))


def block_reduce(mask: torch.Tensor, reduce) -> torch.Tensor:
    """(T, T) token mask → (nb, nb) per-block any/all."""
    nb = mask.size(-1) // BS
    return reduce(mask.view(nb, BS, nb, BS).transpose(1, 2).reshape(nb, nb, BS * BS), dim=-1)


def lists_to_dense(num: torch.Tensor, idx: torch.Tensor, nb: int) -> torch.Tensor:
    """BlockMask (B, H, nq) counts + (B, H, nq, nk) indices → (nq, nk) booleans for row 0, head 0."""
    out = torch.zeros(nb, nb, dtype=torch.bool)
    for q in range(nb):
        out[q, idx[0, 0, q, : num[0, 0, q]].long()] = True
    return out


def token_mask_of_block_mask(bm, spec: MaskSpec, T: int) -> torch.Tensor:
    """What the compiled FlexAttention kernel computes: full blocks all visible, partial blocks by
    mask_mod, unlisted blocks hidden (eager FlexAttention ignores the block lists, so build it here)."""
    nb = T // BS
    partial = lists_to_dense(bm.kv_num_blocks, bm.kv_indices, nb)
    full = lists_to_dense(bm.full_kv_num_blocks, bm.full_kv_indices, nb)
    expand = lambda blocks: blocks.repeat_interleave(BS, 0).repeat_interleave(BS, 1)
    q, kv = torch.arange(T)[:, None], torch.arange(T)[None, :]
    by_mod = bm.mask_mod(torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long), q, kv)
    return expand(full) | (expand(partial) & by_mod)


@pytest.mark.parametrize("T, starts, window, block_window", CASES)
def test_block_mask_marks_exactly_the_needed_blocks(T, starts, window, block_window):
    tokens = make_docs(T, starts)
    spec = spec_for(tokens, window, block_window)
    dense = spec_dense_mask(spec, 0, T, 0, T, None)[0, 0]
    bm = build_block_mask(spec, T)
    nb = T // BS
    partial = lists_to_dense(bm.kv_num_blocks, bm.kv_indices, nb)
    full = lists_to_dense(bm.full_kv_num_blocks, bm.full_kv_indices, nb)
    needed, complete = block_reduce(dense, torch.any), block_reduce(dense, torch.all)
    assert not (partial & full).any()
    assert torch.equal(full, complete)  # full exactly where every pair is visible: no mask_mod needed
    listed = partial | full
    assert not (needed & ~listed).any(), "a block the dense mask needs is missing"
    assert (listed & ~needed).sum(dim=-1).max() <= 1, "more than one block of slack in a row"
    assert torch.equal(token_mask_of_block_mask(bm, spec, T), dense)


@pytest.mark.parametrize("T, starts, window, block_window", CASES)
def test_flex_forward_equals_dense_sdpa(T, starts, window, block_window):
    torch.manual_seed(0)
    tokens = make_docs(T, starts, batch=2)
    spec = spec_for(tokens, window, block_window)
    q, k, v = (torch.randn(2, 3, T, 16) for _ in range(3))
    reference = F.scaled_dot_product_attention(q, k, v, attn_mask=spec_dense_mask(spec, 0, T, 0, T, None))
    with torch.no_grad():
        flex = flex_attend(q, k, v, build_block_mask(spec, T), scale=None)
        dense = attend(q, k, v, spec)
    torch.testing.assert_close(flex, reference, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(dense, reference, atol=2e-5, rtol=1e-4)


def test_block_mask_without_documents_broadcasts_over_batch():
    T = 384
    spec = MaskSpec(None, torch.tensor(100, dtype=torch.int32), False, 100)
    q, k, v = (torch.randn(2, 2, T, 8) for _ in range(3))
    with torch.no_grad():
        out = flex_attend(q, k, v, build_block_mask(spec, T), scale=0.3)
    mask = spec_dense_mask(spec, 0, T, 0, T, None)
    torch.testing.assert_close(
        out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3), atol=2e-5, rtol=1e-4
    )


@pytest.mark.parametrize(
    "docs, window, block_window",
    [(True, None, False), (True, 90, False), (False, 70, False), (True, 256, True)],
)
def test_chunked_and_per_document_paths_match_one_dense_mask_with_gradients(
    monkeypatch, docs, window, block_window
):
    """Long rows: query chunks (CUDA fallback) and per-document calls (CPU) give the same outputs and
    gradients as one SDPA call with the full T×T mask."""
    monkeypatch.setattr(A, "DENSE_CHUNK", 96)
    T = 640
    tokens = make_docs(T, [0, 20, 21, 250, 400], batch=2)  # the 230-token document needs chunking too
    spec = spec_for(tokens, window, block_window, docs=docs)
    base = [torch.randn(2, 2, T, 8, requires_grad=True) for _ in range(3)]
    ref = F.scaled_dot_product_attention(*base, attn_mask=spec_dense_mask(spec, 0, T, 0, T, None), scale=0.2)
    ref_grads = torch.autograd.grad(ref.square().sum(), base)
    paths = {
        "per-document": lambda *x: attend(*x, spec, 0.2),
        "chunked": lambda *x: A._chunked(*x, spec, 0.2, 0),
    }
    for name, fn in paths.items():
        out = fn(*base)
        grads = torch.autograd.grad(out.square().sum(), base)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4, msg=name)
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4, msg=name)


def test_window_is_a_tensor_input_so_changing_it_does_not_recompile():
    from torch._dynamo.testing import CompileCounter

    T = 512
    docs = document_ids(make_docs(T, [0, 100, 300]), 0)

    def lists(docs, window):
        bm = build_block_mask(MaskSpec(docs, window, False, 1792), T)
        return bm.kv_num_blocks, bm.full_kv_num_blocks

    counter = CompileCounter()
    compiled = torch.compile(lists, backend=counter, fullgraph=True)
    results = [compiled(docs, torch.tensor(w, dtype=torch.int32)) for w in (64, 200, 1792)]
    assert counter.frame_count == 1
    assert not torch.equal(results[0][0], results[2][0])  # ... and the window really changed the mask
    for w, (num, full) in zip((64, 200, 1792), results, strict=True):
        eager = lists(docs, torch.tensor(w, dtype=torch.int32))
        assert torch.equal(num, eager[0]) and torch.equal(full, eager[1])


def test_block_structure_is_quadratic_in_blocks_not_tokens():
    T = 65536
    docs = document_ids(make_docs(T, list(range(0, T, 700))), 0)
    partial, full = block_structure(MaskSpec(docs, torch.tensor(1792)), T)
    assert partial.shape == full.shape == (1, T // BS, T // BS)
    per_row = (partial | full).sum(-1)
    assert per_row.max() <= math.ceil(1792 / BS) + 1  # a 1792-token window touches at most 15 blocks


def test_backend_choice():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_backend("auto", cpu, 1024, needs_mask=False, needs_grad=True) == "causal"
    assert choose_backend("auto", cpu, 1024, needs_mask=True, needs_grad=True) == "dense"
    assert choose_backend("auto", cuda, 1024, needs_mask=True, needs_grad=True) == "flex"
    assert choose_backend("auto", cuda, 1000, needs_mask=True, needs_grad=True) == "dense"  # not whole blocks
    assert choose_backend("sdpa", cuda, 1024, needs_mask=True, needs_grad=True) == "dense"
    assert choose_backend("flex", cpu, 1024, needs_mask=True, needs_grad=True) == "dense"  # no CPU backward
    assert choose_backend("flex", cpu, 1024, needs_mask=True, needs_grad=False) == "flex"


def reference_floor(step: int, n: int) -> int:
    """2024-11-24, written as in the record."""
    return 64 * math.floor(Fraction(64 + Fraction(1728 * step, n), 64))


def reference_ceil(step: int, n: int) -> int:
    """Sub3Min: the smallest multiple of 128 that is >= 1728·step/N, at least 128."""
    v = Fraction(1728 * step, n)
    return next(m for m in range(128, 4096, 128) if m >= v)


def test_window_schedules_match_the_records():
    floor_cfg = ModelConfig(window=1792, window_warmup="floor", window_warmup_start=64, window_unit=64)
    ceil_cfg = ModelConfig(window=1792, window_warmup="ceil", window_warmup_start=64, window_unit=128)
    for n in (1750, 1393, 7):
        assert [window_tokens(s, n, floor_cfg) for s in range(n + 1)] == [
            reference_floor(s, n) for s in range(n + 1)
        ]
        assert [window_tokens(s, n, ceil_cfg) for s in range(n + 1)] == [
            reference_ceil(s, n) for s in range(n + 1)
        ]
    assert window_tokens(0, 1750, floor_cfg) == 64 and window_tokens(1750, 1750, floor_cfg) == 1792
    assert window_tokens(0, 1393, ceil_cfg) == 128 and window_tokens(1393, 1393, ceil_cfg) == 1792
    assert window_tokens(5, 10, ModelConfig(window=1024)) == 1024
    assert window_tokens(5, 10, ModelConfig()) == 0


def test_short_window_is_half_the_long_one():
    w = torch.tensor([128, 256, 384, 1792])
    assert short_window(w, block_window=True).tolist() == [128, 128, 128, 896]  # at least one block
    assert short_window(w, block_window=False).tolist() == [64, 128, 192, 896]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_flex_forward_and_backward_match_dense():
    torch.manual_seed(0)
    T = 2048
    tokens = make_docs(T, [0, 100, 129, 700, 701, 1500]).cuda()
    for window, block_window in ((None, False), (300, False), (1024, True), (5, False)):
        spec = spec_for(tokens, window, block_window)
        base = [torch.randn(1, 4, T, 64, device="cuda", requires_grad=True) for _ in range(3)]
        out = flex_attend(*base, build_block_mask(spec, T), scale=0.12)
        grads = torch.autograd.grad(out.square().sum(), base)
        ref = F.scaled_dot_product_attention(
            *base, attn_mask=spec_dense_mask(spec, 0, T, 0, T, "cuda"), scale=0.12
        )
        ref_grads = torch.autograd.grad(ref.square().sum(), base)
        torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r, atol=2e-2, rtol=2e-2)


# ------------------------------------------------------------------------------------------------
# the backends inside the model (model helpers from tests/unit/test_architecture.py)


#: the 2024 switches that touch attention, all on (each test adds its window and layout)
EVERY_2024_SWITCH = dict(
    document_mask=True,
    window_granularity="block",
    fused_qkv=True,
    value_embeds="ends",
    value_embed_tables=2,
    value_mix="lambdas",
    rope_half_truncated=True,
    attn_scale=0.12,
    unet=True,
    x0_shortcut=True,
)


@pytest.mark.parametrize(
    "switches",
    [
        dict(document_mask=True),
        dict(document_mask=True, window=100, window_pattern="LSLSSL"),
        dict(window=256, window_granularity="block", window_pattern="LSSSSL", unet=True, x0_shortcut=True),
        dict(EVERY_2024_SWITCH, window=384, window_pattern="LSSLLS", no_attention_layers="3"),
    ],
)
def test_flex_and_sdpa_backends_give_the_same_model(switches):
    model = randomize(build_model(tiny(**switches)))
    x = docs_batch(512, batch=2)
    with torch.no_grad():
        model.cfg.attention = "sdpa"
        dense = model(x)
        model.cfg.attention = "flex"  # runs eagerly on CPU without gradients
        flex = model(x)
    torch.testing.assert_close(flex, dense, atol=1e-4, rtol=1e-4)


def test_window_schedule_changes_the_mask_without_recompiling():
    """One long and one short layer: each layer kind once is enough, and tracing time grows with depth."""
    from torch._dynamo.testing import CompileCounter

    model = randomize(build_model(tiny(n_layer=2, window=256, window_pattern="LS", attention="sdpa")))
    buffer = model.attn_window
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    x = docs_batch(512)
    outs = []
    with torch.no_grad():
        for w in (64, 128, 256):
            model.set_attention_window(w)
            outs.append(compiled(x))
            model.cfg.attention = "flex"  # the eager FlexAttention reference for this window
            torch.testing.assert_close(outs[-1], model(x), atol=1e-4, rtol=1e-4)
            model.cfg.attention = "sdpa"
    assert counter.frame_count == 1  # one graph for every window: the window is a tensor input
    assert model.attn_window is buffer and int(buffer) == 256
    assert not torch.allclose(outs[0], outs[2])
    with pytest.raises(AssertionError, match="outside 1..model.window"):
        model.set_attention_window(512)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_compiled_flex_model_matches_dense_and_never_recompiles_for_new_windows():
    from torch._dynamo.testing import CompileCounterWithBackend

    switches = dict(EVERY_2024_SWITCH, window=1024, window_pattern="LSSLSS", max_seq_len=4096)
    model = randomize(build_model(tiny(**switches))).cuda()
    x = docs_batch(4096).cuda()
    torch._dynamo.reset()  # an earlier test's compile of the same forward would make shapes dynamic here
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, dynamic=False)  # as `speedrun train` compiles
    frames = None
    for w in (128, 512, 1024):
        model.set_attention_window(w)
        model.cfg.attention = "flex"
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = compiled(x, x)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        frames = frames or counter.frame_count
        model.cfg.attention = "sdpa"  # eager dense reference (a different code path, not compiled)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref = model(x, x)
        ref.backward()
        torch.testing.assert_close(loss, ref, atol=2e-2, rtol=2e-2)
        for g, p in zip(grads, model.parameters(), strict=True):
            torch.testing.assert_close(g, p.grad, atol=5e-2, rtol=5e-2)
    assert counter.frame_count == frames  # new window values reuse the compiled graphs
