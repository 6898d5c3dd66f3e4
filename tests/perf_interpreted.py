"""The speed layer's kernels run through Triton's CPU interpreter, in a child process of their own
(tests/unit/test_perf_kernels.py): TRITON_INTERPRET=1 has to be set before a kernel module is imported
(triton 3.9 decides at `@triton.jit` time), and a worker whose kernels were built interpreted must not
run the GPU tests. `python tests/perf_interpreted.py OUT` saves each case's outputs to OUT/<case>.pt;
the test rebuilds the same inputs (`inputs`) and compares them with the plain twins in its own process.

Shapes are small (the interpreter runs each program in numpy) but cut the tiles raggedly: 80 rows and
100 columns against the Gram kernel's 64 x 32 tiles, a 300-token vocabulary against the CE kernel's
128-column tiles, targets on the first and last column, ignored targets, logits far past the softcap;
50 x 40 inputs to 72 outputs against the fused MLP's 32-wide tiles; the CE's prefix arm (ids without a
prefix, a prefix on the last column) and sampled arm (150 candidates, prefix targets outside the set, a
set with none); n-gram rows 40 wide against 32-wide tiles, repeated rows, pulled rows.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

V = 300  # three 128-column tiles, the last one ragged
NS_B, NS_C = -4.7750, 2.0315  # a Newton–Schulz step's b, c


def inputs(case: str) -> dict:
    """The seeded inputs of `case` (the same in the child and in the test)."""
    g = torch.Generator().manual_seed(sum(map(ord, case)))
    if case.startswith("gram"):
        x = torch.randn(3, 80, 100, generator=g)
        if case == "gram_bf16_strided":  # a tall matrix seen transposed, as _wide hands it over
            x = torch.randn(3, 100, 80, generator=g).bfloat16().mT
        return {"x": x}
    if case.startswith("ba_plus_caa"):
        x = torch.randn(2, 70, 90, generator=g) / 90**0.5
        a = torch.bmm(x, x.mT)
        return {"a": a.bfloat16() if case.endswith("bf16") else a}
    if case.startswith("ce"):
        raw = torch.randn(2, 7, V, generator=g) * 20  # far past the cap: σ saturates both ways
        targets = torch.randint(0, V, (2, 7), generator=g)
        targets[0, 0], targets[1, 3] = V - 1, 0  # the ragged tile's last column, the first column
        mtp = None
        if case in ("ce_ignore", "ce_prefix_ignore"):
            targets[0, 2] = targets[1, 6] = -100
        if case in ("ce_mtp", "ce_prefix_mtp"):
            mtp = torch.tensor([1.0, 0.5, 0.25])
        if case in ("ce_bf16", "ce_prefix_bf16"):
            raw = raw.bfloat16()
        # #54's cap: 23·σ((z + 5)/7.5) = softcap 11.5, divisor 7.5, offset 5
        out = {"raw": raw, "targets": targets, "mtp": mtp, "cap": 11.5, "divisor": 7.5, "offset": 5.0}
        if case.startswith("ce_prefix"):  # #88: a prefix table, −1 (no prefix) for about a third of ids
            table = torch.randint(-V // 2, V, (V,), generator=g).clamp(min=-1)
            table[targets[0, 1]], table[targets[0, 0]] = -1, V - 1  # a missing prefix; the last column
            out |= {"table": table, "weight": torch.tensor(0.25)}
        return out
    if case.startswith("sampled"):  # #92: P = 150 candidates (a ragged 128-column tile), bound-as-max
        P = 150
        logits = torch.randn(2, 7, P, generator=g) * 20
        pos = torch.randint(0, P, (2, 7), generator=g)
        pos[0, 0], pos[1, 1] = P - 1, 0
        prefix_pos = torch.randint(-P // 2, P, (2, 7), generator=g).clamp(min=-1)
        if case == "sampled_no_prefix_candidates":  # no prefix target is a candidate: the term is empty
            prefix_pos = torch.full_like(pos, -1)
        mtp = None if case == "sampled_plain" else torch.tensor([1.0, 0.5, 0.25])
        out = {"logits": logits.bfloat16() if case == "sampled_bf16" else logits, "pos": pos, "mtp": mtp}
        out |= {"prefix_pos": None, "prefix_weight": None, "cap": 11.5, "divisor": 7.5, "offset": 5.0}
        if case != "sampled_plain":
            out |= {"prefix_pos": prefix_pos, "prefix_weight": torch.tensor(0.25)}
        return out
    if case.startswith("ngram"):  # #92's rows: 20 table rows for 2 x 9 tokens (rows repeat), d = 40
        from speedrun.model.gpt2026.ngram import ngram_rows, ngram_signs

        idx = torch.randint(0, 50, (2, 9), generator=g)
        idx[1, 5:8] = idx[1, 0:3].clone()  # a repeated trigram: the same rows twice in one row
        slots, (sb, st) = ngram_rows(idx, 20), ngram_signs(idx, 8)
        source = torch.randn(20, 40, generator=g)
        if case == "ngram_pulled":  # a sharded table's pulled rows: slots index the distinct rows read
            want = torch.unique(slots)
            source, slots = torch.randn(want.numel(), 40, generator=g), torch.searchsorted(want, slots)
        pool = torch.randn(8, 40, generator=g).sign().bfloat16()
        wout = torch.randn(2, 9, 40, generator=g)  # the loss's weights: d out
        source = source.bfloat16() if case == "ngram_bf16" else source
        return {"source": source, "slots": slots, "sb": sb, "st": st, "pool": pool, "wout": wout}
    if case.startswith("row_adam"):  # 30 rows of 40 (32-wide tiles), 12 steps of RowAdam at β1 = 0
        steps = []
        for s in range(1, 13):
            k = 0 if s in (3, 7) else int(torch.randint(1, 9, (), generator=g))  # steps that touch no row
            rows = torch.randint(0, 20 if s % 4 else 5, (k,), generator=g)  # rows 20.. never, 5.. asleep
            if k > 1:
                rows[-1] = rows[0]  # a row twice in one step
            grad = torch.randn(k, 40, generator=g)
            steps.append((rows, grad, 0.05 * (1 - s / 30), 0.95 if s < 6 else 0.95**2, 0.7))
        table = torch.randn(30, 40, generator=g)
        return {"table": table.bfloat16() if case.endswith("bf16") else table, "steps": steps}
    if case.startswith("relu2"):  # 50 x 40 -> 72 against 32-wide tiles: every edge ragged
        x, w = torch.randn(2, 25, 40, generator=g), torch.randn(72, 40, generator=g) / 40**0.5
        return {"x": x.bfloat16(), "w": w.bfloat16()} if case.endswith("bf16") else {"x": x, "w": w}
    raise KeyError(case)


CASES = (
    "gram_fp32", "gram_bf16_strided", "ba_plus_caa_fp32", "ba_plus_caa_bf16",
    "ce_plain", "ce_ignore", "ce_mtp", "ce_bf16", "relu2_fp32", "relu2_bf16",
    "ce_prefix", "ce_prefix_ignore", "ce_prefix_mtp", "ce_prefix_bf16",
    "sampled_plain", "sampled_mtp_prefix", "sampled_no_prefix_candidates", "sampled_bf16",
    "ngram_fp32", "ngram_bf16", "ngram_pulled", "row_adam_fp32", "row_adam_bf16",
)  # fmt: skip


def run_kernel(case: str) -> dict:
    from speedrun.perf.kernels import gram, relu2_linear, softcapped_ce

    a = inputs(case)
    if case.startswith("gram"):
        return {"out": gram.gram(a["x"])}
    if case.startswith("ba_plus_caa"):
        return {"out": gram.ba_plus_caa(a["a"], NS_B, NS_C)}
    if case.startswith("ngram"):
        from speedrun.perf.kernels import ngram_embed

        source = a["source"].clone().requires_grad_()
        out = ngram_embed.ngram_embed(source, a["slots"], a["sb"], a["st"], a["pool"])
        (out.float() * a["wout"]).sum().backward()
        return {"out": out.detach(), "grad": source.grad}
    if case.startswith("row_adam"):
        import speedrun.optim.row_adam  # noqa: F401  (declares the op)
        from speedrun import ops
        from speedrun.perf.kernels import row_adam

        ops.install("row_adam_rows", row_adam.row_adam_rows)
        try:
            return run_row_adam(a)
        finally:
            ops.reset()
    if case.startswith("relu2"):
        x, w = a["x"].clone().requires_grad_(), a["w"].clone().requires_grad_()
        out = relu2_linear.relu2_linear(x, w)
        (out.float() * torch.linspace(-1, 1, out.size(-1))).sum().backward()
        return {"out": out.detach(), "dx": x.grad, "dw": w.grad}
    cap = (a["cap"], a["divisor"], a["offset"])
    if case.startswith("sampled"):
        raw = a["logits"].clone().requires_grad_()
        loss = softcapped_ce.sampled_softcapped_ce(
            raw, a["pos"], a["mtp"], a["prefix_pos"], a["prefix_weight"], *cap
        )
        loss.backward()
        return {"loss": loss.detach(), "grad": raw.grad}
    raw = a["raw"].clone().requires_grad_()
    if case.startswith("ce_prefix"):
        loss = softcapped_ce.softcapped_prefix_ce(
            raw, a["targets"], a["mtp"], a["table"], a["weight"], *cap, False, False
        )
    else:
        loss = softcapped_ce.softcapped_ce(raw, a["targets"], a["mtp"], *cap, False, False)
    loss.backward()
    return {"loss": loss.detach(), "grad": raw.grad}


def run_row_adam(a: dict) -> dict:
    """RowAdam (optim/row_adam.py) through `a`'s steps, then every row brought current."""
    from speedrun.optim.row_adam import RowAdam

    table = a["table"].clone()
    opt = RowAdam(table)
    for rows, grad, lr, beta2, wd in a["steps"]:
        opt.step(rows, grad, lr, beta2, wd)
    opt.bring_current()
    return {"table": table, "exp_avg_sq": opt.exp_avg_sq, "current": opt.current}


def main(out: Path) -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    torch.set_num_threads(1)
    for case in CASES:
        torch.save(run_kernel(case), out / f"{case}.pt")
    from tests.perf_traced import traced  # the CUDA branch of the swap, compiled in one graph

    torch.save(traced(), out / "traced.pt")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parents[1]))
    main(Path(sys.argv[1]))
