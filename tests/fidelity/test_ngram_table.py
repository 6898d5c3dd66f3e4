"""#92's hashed n-gram table (model/gpt2026/ngram.py, optim/row_adam.py, optim/row_shard.py): the hashes
against the record's formulas written out, the forward and the touched rows' gradient against dense
references, the row-compacted Adam against dense Adam, the sharded table on 2 gloo processes against one,
and the memory guard's one line at full size."""

from __future__ import annotations

import pytest
import torch

from speedrun.errors import ConfigError
from speedrun.model.gpt2026.ngram import NgramEmbed, ngram_rows, ngram_signs
from speedrun.optim.cautious_adam import AdamLabel, cautious_adam_
from speedrun.optim.row_adam import RowAdam
from speedrun.optim.row_shard import shard_part
from speedrun.recipes import load_recipe
from tests.decoding import cached_logits
from tests.two_processes import SHARED
from tests.unit.test_kv_cache import _shrunk_model

GiB = 2**30


def wrap(v: int) -> int:
    """int32 wrap-around of a Python int."""
    return (v + 2**31) % 2**32 - 2**31


def record_row_ids(x: list[int], V: int) -> list[int]:
    """track_1_short/ngram_table.py ngram_row_ids on one sequence, in Python ints: out[:n] bigram rows,
    out[n:] trigram rows; the bigram hash is computed in place after out[0] is set."""
    half = V // 2
    bigram_mod, trigram_mod = half - 1, V - half - 1
    n = len(x)
    bigram = list(x)
    bigram[0] = bigram_mod
    rhs = [(wrap(36313 * bigram[i]) ^ wrap(27191 * bigram[i - 1])) % bigram_mod for i in range(1, n)]
    bigram[1:] = rhs
    trigram = [half + trigram_mod] * min(n, 2)
    for i in range(2, n):
        h = wrap(17351 * x[i]) ^ wrap(60961 * x[i - 1]) ^ wrap(45259 * x[i - 2])
        trigram.append(h % trigram_mod + half)
    return bigram + trigram


def record_sign_rows(x: list[int], pool: int) -> tuple[list[int], list[int]]:
    """perf/kernels/ngram_embed.py _sign_rows: pool rows of each position, row 0 without history."""
    b = [0] + [(wrap(30011 * x[t - 1]) ^ wrap(48271 * x[t])) & (pool - 1) for t in range(1, len(x))]
    tri = [(wrap(26801 * x[t - 2]) ^ wrap(39779 * x[t - 1]) ^ wrap(58699 * x[t])) & (pool - 1)
           for t in range(2, len(x))]  # fmt: skip
    return b, [0] * min(2, len(x)) + tri


@pytest.mark.parametrize("V, pool", [(84_602_880, 8192), (377_280, 8192), (96, 16)])
def test_row_and_sign_hashes_equal_the_records_formulas(V, pool):
    gen = torch.Generator().manual_seed(V)
    idx = torch.randint(0, 50257, (3, 40), generator=gen)
    idx[0, :5] = 50256  # the largest ids: every product wraps
    rows = ngram_rows(idx, V)
    sb, st = ngram_signs(idx, pool)
    for b in range(idx.size(0)):
        x = idx[b].tolist()
        assert rows[b].tolist() == record_row_ids(x, V)
        assert (sb[b].tolist(), st[b].tolist()) == record_sign_rows(x, pool)
    assert rows.min() >= 0 and rows.max() < V and rows[:, :40].max() < V // 2 <= rows[:, 40:].min()
    assert ngram_rows(idx[:, :1], V).tolist() == [[V // 2 - 1, V - 1]] * 3  # one token: the reserved rows


def _part(rows=96, dim=6, width=None, seed=0) -> NgramEmbed:
    torch.manual_seed(seed)
    part = NgramEmbed(rows, dim, 2, 16, width=width, dtype=torch.float64)
    with torch.no_grad():
        part.table.normal_()
    return part


def test_forward_equals_a_dense_reference():
    part = _part(width=9)
    idx = torch.randint(0, 500, (2, 11))
    out = part(idx)
    assert out.shape == (2, 11, 9) and out.dtype == torch.float64
    V, pool, table = part.rows, part.sign_pool.double(), part.table.detach()
    want = torch.empty(2, 11, 6, dtype=torch.float64)
    for b in range(2):
        x = idx[b].tolist()
        rid = record_row_ids(x, V)
        sb, st = record_sign_rows(x, 16)
        for t in range(11):
            want[b, t] = table[rid[t]] * pool[sb[t]] + table[rid[11 + t]] * pool[st[t]]
    assert torch.equal(out[..., :6], want)
    assert out[..., 6:].abs().max() == 0  # the stream's dims past the rows' width get nothing
    assert set(part.sign_pool.unique().tolist()) <= {-1.0, 1.0}


def test_touched_rows_gradient_equals_dense_autograd():
    """The pulled rows' gradient pushed back to their (one) owner equals the dense table's gradient."""
    idx, w = torch.randint(0, 60, (3, 17)), torch.randn(3, 17, 6, dtype=torch.float64)
    dense = _part()
    (dense(idx) * w).sum().backward()
    part = _part()
    shard = shard_part(part, local=True)
    part.pulled = shard.pull(ngram_rows(idx, part.rows))
    (part(idx) * w).sum().backward()
    rows, grad = shard.push(part.pulled)
    assert rows.tolist() == sorted(set(ngram_rows(idx, part.rows).flatten().tolist()))
    full = torch.zeros_like(dense.table).index_add_(0, rows, grad)
    torch.testing.assert_close(full, dense.table.grad, rtol=1e-12, atol=1e-12)
    untouched = torch.ones(part.rows, dtype=torch.bool)
    untouched[rows] = False
    assert dense.table.grad[untouched].abs().max() == 0 and part.table.grad is None


def _schedule(steps: int = 70, n: int = 30, d: int = 5):
    """Per step: (rows with repeats, their gradients, lr, β2, wd); rows ≥ 24 never touched, rows 6..23 not
    on every 5th step, some steps touch no row, β2 squared from step 12 (#92's period-4 cadence), the LR
    decaying; 70 steps (past RowAdam's first 64-entry history)."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for s in range(1, steps + 1):
        k = 0 if s in (3, 4, 9) else int(torch.randint(1, 9, (), generator=gen))
        rows = torch.randint(0, 24 if s % 5 else 6, (k,), generator=gen)
        if k > 1:
            rows[-1] = rows[0]  # a row twice in one step
        grad = torch.randn(k, d, generator=gen, dtype=torch.float64)
        out.append((rows, grad, 0.05 * (1 - s / 100), 0.95 if s < 12 else 0.95**2, 0.7))
    return out


def _dense_adam(w, steps, beta1, row_moment, wd_on, eps=1e-8):
    """Adam over every row every step (untouched rows with g = 0), fp64, written out."""
    m, v = torch.zeros_like(w), torch.zeros(w.shape[0] if row_moment else w.shape, dtype=w.dtype)
    for s, (rows, grad, lr, beta2, wd) in enumerate(steps, 1):
        g = torch.zeros_like(w).index_add_(0, rows, grad)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * (g.square().mean(1) if row_moment else g.square())
        denom = (v.sqrt() + eps)[:, None] if row_moment else v.sqrt() + eps
        u = m / denom * (lr * (1 - beta2**s) ** 0.5 / (1 - beta1**s))
        if wd_on:
            u = u + w * ((u * w) > 0) * lr * lr * wd
        w = w - u
    return w, v


CASES = [(0.0, True, True), (0.9, False, True), (0.8, True, False)]  # #92's: β1 = 0, one v per row, decay


@pytest.mark.parametrize("beta1, row_moment, wd_on", CASES)
def test_compacted_adam_equals_dense_adam(beta1, row_moment, wd_on):
    steps = _schedule()
    w0 = torch.randn(30, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    table = w0.clone()
    adam = RowAdam(table, beta1=beta1, eps=1e-8, row_moment=row_moment)
    for rows, grad, lr, beta2, wd in steps:
        adam.step(rows, grad, lr, beta2, wd if wd_on else 0.0)
    adam.bring_current()
    want_w, want_v = _dense_adam(w0.clone(), steps, beta1, row_moment, wd_on)
    torch.testing.assert_close(table, want_w, rtol=0, atol=1e-12)
    torch.testing.assert_close(adam.exp_avg_sq, want_v, rtol=0, atol=1e-12)
    assert torch.equal(table[24:], w0[24:])  # never touched: m = 0 and U = 0 at every step
    if not row_moment:  # the package's own dense Adam (optim/cautious_adam.py, fp32 math), step by step
        w, m, v = w0.float(), torch.zeros_like(w0).float(), torch.zeros_like(w0).float()
        table32 = w0.float()
        adam32 = RowAdam(table32, beta1=beta1, eps=1e-8, row_moment=False)
        for s, (rows, grad, lr, beta2, wd) in enumerate(steps, 1):
            g = torch.zeros_like(w).index_add_(0, rows, grad.float())
            cautious_adam_(w, g, m, v, s, lr, AdamLabel(lr, (beta1, beta2), wd if wd_on else 0.0, 1e-8))
            adam32.step(rows, grad.float(), lr, beta2, wd if wd_on else 0.0)
        adam32.bring_current()
        torch.testing.assert_close(table32, w, rtol=1e-5, atol=1e-6)  # fp32: the ops' rounding apart


@pytest.mark.slow
@SHARED
def test_sharded_table_on_two_gloo_processes_equals_one(library_results):
    """tests/ngram_rows_check.py: 6 steps of pull → forward → push → compacted Adam on 2 processes against
    the whole table on one, then the 2-process save resumed on one process for 4 more steps."""
    r = library_results["ngram_rows"]
    assert r["max_abs_diff"] <= 1e-12 and r["resumed_diff"] <= 1e-12 and r["moved"] > 0.01


def test_a_recipe_with_model_ngram_rows_feeds_the_bigram_input_and_trains_by_its_label():
    """`[model.ngram] rows = ...` puts the part where #62's table was; its rows get the gradient of exactly
    the rows the tokens hash to; its label's row is #92's table Adam (LR ×70, β1 = 0, decay ×5)."""
    from speedrun.model.families import build_model
    from speedrun.optim.build import model_rules

    no_bigram = ["model.embed.bigram_rows=0", "model.embed.bigram_sign_rows=0"]
    cfg = load_recipe("demo-2026", ["model.ngram.rows=4096", "model.ngram.dtype=fp32", *no_bigram])
    model = build_model(cfg.model)
    assert isinstance(model.bigram, NgramEmbed) and model.bigram.table.abs().max() == 0  # zero init
    idx = torch.randint(0, 4000, (1, 64))
    model(idx, torch.roll(idx, -1, 1)).backward()
    touched = (model.bigram.table.grad.abs().sum(1) > 0).nonzero().flatten().tolist()
    assert set(touched) <= set(ngram_rows(idx, 4096).flatten().tolist()) and len(touched) > 64
    (row,) = [e.rule for e in model_rules(model, cfg) if e.label.name == "ngram"]
    assert (row.group, row.betas) == ("ngram", (0.0, 0.95))
    o = cfg.optim
    assert row.lr == pytest.approx(70 * o.embed_lr) and row.wd == pytest.approx(5 * o.adam_weight_decay)
    with pytest.raises(ConfigError, match="model.ngram.rows and model.embed.bigram_rows"):
        load_recipe("demo-2026", ["model.ngram.rows=4096"])  # the recipe's own #62 table is still on


def test_cached_decoding_reads_the_two_tokens_back_as_the_full_forward():
    """The model's `lookback` (2) gives the part x[t-2] and x[t-1] of each new token: cached logits, token
    by token from position 1 (one token back at position 1, two from 2 on), equal the full forward's."""
    model = _shrunk_model("demo-2026", "model.ngram.rows=998", "model.ngram.dtype=fp32",
                          "model.embed.bigram_rows=0", "model.embed.bigram_sign_rows=0")  # fmt: skip
    assert isinstance(model.bigram, NgramEmbed) and model.lookback == 2
    idx = torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(idx)
        torch.testing.assert_close(cached_logits(model, idx, 1), full, rtol=1e-4, atol=1e-4)
