"""Each speed-layer kernel against its plain twin compiled as a run compiles it (issue 44): the kit's
A/B of speedrun/perf/kernels/. A kernel that is not at least as fast as its compiled twin is deleted.

    python benchmarks/bench_kernels.py [--only NAME (one of NAMES)] [--reps N]

Per kernel one line `bench-kernel NAME SHAPE: kernel X ms, twin Y ms (compiled), twin/kernel Z` (CUDA
events, median of N timed calls after 3 untimed; the softcapped CE is timed forward + backward). The
shapes are the record's: record-2026-07's MLP bank in Polar Express (24 matrices 768 x 3072, bf16), its
Gram matrices, one GPU's 16,384-token micro-batch of logits over the padded vocabulary (bf16), MTP
weights 1, 0.5, 0.25, and that micro-batch through an MLP up-projection (768 -> 3072, forward and
backward); #88's prefix arm on that micro-batch; #92's sampled arm over 16,384 candidates; #92's n-gram
gather and sink for that micro-batch from a 2^22-row table (768 wide, bf16; forward + backward). Without
CUDA it prints `bench-kernel: skipped: no CUDA` and exits 0.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys

import torch

NAMES = (
    "gram", "ba_plus_caa", "softcapped_ce", "relu2_linear",
    "softcapped_prefix_ce", "sampled_softcapped_ce", "ngram_embed", "row_adam_rows",
)  # fmt: skip


def _time(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cases(name: str):
    """(shape label, kernel call, twin call) of one kernel at the record's shapes."""
    from speedrun.model.layers import relu2_linear as plain_relu2
    from speedrun.perf.kernels import gram, relu2_linear, softcapped_ce

    ortho = importlib.import_module("speedrun.optim.orthogonalize")
    head = importlib.import_module("speedrun.model.gpt2026.head")
    g = torch.Generator(device="cuda").manual_seed(0)
    if name in ("gram", "ba_plus_caa"):
        x = (torch.randn(24, 768, 3072, device="cuda", generator=g) / 3072**0.5).bfloat16()
        if name == "gram":
            twin = torch.compile(ortho.gram.plain, dynamic=False, fullgraph=True)
            return "24x768x3072 bf16", lambda: gram.gram(x), lambda: twin(x)
        a = ortho.gram.plain(x)
        twin = torch.compile(ortho.ba_plus_caa.plain, dynamic=False, fullgraph=True)
        return "24x768x768 bf16", lambda: gram.ba_plus_caa(a, -2.77, 0.5), lambda: twin(a, -2.77, 0.5)
    if name == "relu2_linear":  # forward + backward, as training runs it
        x = torch.randn(16384, 768, device="cuda", generator=g).bfloat16().requires_grad_()
        w = (torch.randn(3072, 768, device="cuda", generator=g) / 768**0.5).bfloat16().requires_grad_()
        twin = torch.compile(plain_relu2.plain, dynamic=False, fullgraph=True)

        def mlp(fn):
            x.grad = w.grad = None
            fn(x, w).sum().backward()

        return "16384x768 -> 3072 bf16", lambda: mlp(relu2_linear.relu2_linear), lambda: mlp(twin)
    raw = (torch.randn(1, 16384, 50304, device="cuda", generator=g) * 8).bfloat16().requires_grad_()
    targets = torch.randint(0, 50257, (1, 16384), device="cuda", generator=g)
    weights = torch.tensor([1.0, 0.5, 0.25], device="cuda")
    args = (targets, weights, 11.5, 7.5, 5.0, True, True)  # record-2026-07's head: bf16 cap and CE
    twin = torch.compile(head.softcapped_ce.plain, dynamic=False, fullgraph=True)

    def step(fn):
        raw.grad = None
        fn(raw, *args).backward()

    if name == "softcapped_prefix_ce":
        table = torch.randint(-1, 50257, (50304,), device="cuda", generator=g)
        args = (targets, weights, table, torch.tensor(0.25, device="cuda"), 11.5, 7.5, 5.0, True, True)
        twin = torch.compile(head.softcapped_prefix_ce.plain, dynamic=False, fullgraph=True)
        kernel = softcapped_ce.softcapped_prefix_ce
        return "16384x50304 bf16 mtp=3 prefix", lambda: step(kernel), lambda: step(twin)
    if name == "sampled_softcapped_ce":
        return sampled_case(g, targets.remainder(16384), weights)
    if name == "ngram_embed":
        return ngram_case(g)
    if name == "row_adam_rows":
        return row_adam_case(g)
    return "16384x50304 bf16 mtp=3", lambda: step(softcapped_ce.softcapped_ce), lambda: step(twin)


def sampled_case(g, pos, weights):
    """#92's sampled arm: 16,384 candidates' logits of one micro-batch, MTP and prefix positions."""
    from speedrun.model.gpt2026 import sampled
    from speedrun.perf.kernels import softcapped_ce

    logits = (torch.randn(1, 16384, 16384, device="cuda", generator=g) * 8).bfloat16().requires_grad_()
    prefix_pos = torch.randint(-4096, 16384, (1, 16384), device="cuda", generator=g).clamp(min=-1)
    args = (pos, weights, prefix_pos, torch.tensor(0.25, device="cuda"), 11.5, 7.5, 5.0)
    twin = torch.compile(sampled.sampled_softcapped_ce.plain, dynamic=False, fullgraph=True)

    def step(fn):
        logits.grad = None
        fn(logits, *args).backward()

    kernel = softcapped_ce.sampled_softcapped_ce
    return "16384x16384 bf16 mtp=3 prefix", lambda: step(kernel), lambda: step(twin)


def ngram_case(g):
    """#92's n-gram gather and sink: one micro-batch's rows of a 2^22-row bf16 table, forward + backward."""
    from speedrun.model.gpt2026.ngram import ngram_embed as plain
    from speedrun.model.gpt2026.ngram import ngram_rows, ngram_signs
    from speedrun.perf.kernels import ngram_embed

    idx = torch.randint(0, 50257, (1, 16384), device="cuda", generator=g)
    slots, (sb, st) = ngram_rows(idx, 1 << 22), ngram_signs(idx, 8192)
    table = (torch.randn(1 << 22, 768, device="cuda", generator=g) * 0.1).bfloat16().requires_grad_()
    pool = torch.randn(8192, 768, device="cuda", generator=g).sign().bfloat16()
    twin = torch.compile(plain.plain, dynamic=False, fullgraph=True)

    def step(fn):
        table.grad = None
        fn(table, slots, sb, st, pool).float().sum().backward()

    return "16384 tokens, 2^22x768 bf16", lambda: step(ngram_embed.ngram_embed), lambda: step(twin)


def row_adam_case(g):
    """#92's table step: 32,768 touched rows of a 2^22-row bf16 table (one micro-batch's distinct reads),
    the rows a step behind (one replayed step). Its twin is the eager op (RowAdam's gathers, elementwise
    ops and scatters): a Python object's state is no graph to compile."""
    from speedrun.optim.row_adam import RowAdam, row_adam_rows
    from speedrun.perf.kernels import row_adam

    table = (torch.randn(1 << 22, 768, device="cuda", generator=g) * 0.1).bfloat16()
    opt = RowAdam(table)
    rows = torch.randperm(1 << 22, device="cuda", generator=g)[:32768].sort().values
    grad = torch.randn(32768, 768, device="cuda", generator=g)
    for _ in range(2):
        opt.step(rows[:16], grad[:16], 0.05, 0.95, 0.7)  # the other rows sleep through these steps
    return (
        "32768 of 2^22x768 bf16 rows",
        lambda: row_adam.row_adam_rows(opt, rows, grad),
        lambda: row_adam_rows.plain(opt, rows, grad),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=NAMES, action="append")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench-kernel: skipped: no CUDA")
        return 0
    for name in args.only or NAMES:
        shape, kernel, twin = cases(name)
        k, t = _time(kernel, args.reps), _time(twin, args.reps)
        how = "eager" if name == "row_adam_rows" else "compiled"
        line = f"kernel {k:.3f} ms, twin {t:.3f} ms ({how}), twin/kernel {t / k:.2f}"
        print(f"bench-kernel {name} {shape}: {line}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
