"""The speed layer's Triton kernels against their plain twins (issue 44).

On the CPU, through Triton's interpreter: one child process (tests/perf_interpreted.py) runs every
kernel case and the CUDA branch of the swap compiled in one graph (tests/perf_traced.py); each test here
rebuilds the same inputs and compares with the plain op computed in this process, in fp64 where the
kernel computes in fp32. On CUDA (`gpu`): tests/unit/test_perf_kernels_gpu.py.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import perf_interpreted as cases

pytest.importorskip("triton")  # the `dev` extra; the plain ops need no Triton
ROOT = Path(__file__).parents[2]
ortho = importlib.import_module("speedrun.optim.orthogonalize")
head = importlib.import_module("speedrun.model.gpt2026.head")
pytestmark = pytest.mark.xdist_group("perf_interpreted")  # one worker runs the child once
#: one bf16 step relative to the value: Triton 3.9's interpreter narrows fp32 to bf16 toward zero
BF16_STEP = 2**-7


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("interpreted")
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
    }
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "perf_interpreted.py"), str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


def _got(out: Path, case: str) -> dict:
    return torch.load(out / f"{case}.pt")


@pytest.mark.parametrize("case", ["gram_fp32", "gram_bf16_strided"])
def test_the_gram_kernel_equals_bmm_x_xt_on_ragged_tiles(interpreted, case):
    x = cases.inputs(case)["x"]
    got = _got(interpreted, case)["out"]
    assert got.dtype == x.dtype and got.shape == (3, 80, 80)
    assert torch.equal(got[:, 64:, :64], got[:, :64, 64:].mT), "the mirrored tile is not the computed one"
    exact = torch.bmm(x.double(), x.double().mT)
    plain = ortho.gram.plain(x)
    if x.dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(got, plain, rtol=1e-5, atol=1e-4)
    else:  # bf16 out: within one bf16 step of the exact product (fp32 sums; the interpreter narrows to
        # bf16 toward zero, a GPU to nearest); the CPU's bf16 bmm rounds more on some hosts
        assert ((got.double() - exact).abs() <= exact.abs() * BF16_STEP + 1e-3).all()
        torch.testing.assert_close(got.double(), plain.double(), rtol=2**-5, atol=0.1)


@pytest.mark.parametrize("case", ["ba_plus_caa_fp32", "ba_plus_caa_bf16"])
def test_the_ba_plus_caa_kernel_equals_baddbmm_for_a_gram_matrix(interpreted, case):
    a = cases.inputs(case)["a"]
    got = _got(interpreted, case)["out"]
    assert got.dtype == a.dtype and got.shape == a.shape
    assert torch.equal(got[:, 64:, :64], got[:, :64, 64:].mT)
    exact = ortho.ba_plus_caa.plain(a.double(), cases.NS_B, cases.NS_C)
    if a.dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            got, ortho.ba_plus_caa.plain(a, cases.NS_B, cases.NS_C), rtol=1e-5, atol=1e-5
        )
    else:
        assert ((got.double() - exact).abs() <= exact.abs() * BF16_STEP + 2e-2).all()


@pytest.mark.parametrize("case", ["ce_plain", "ce_ignore", "ce_mtp", "ce_bf16"])
def test_the_fused_softcapped_ce_equals_the_plain_loss_and_its_gradient(interpreted, case):
    """Targets on the ragged tile's last column and on column 0, ignored targets, MTP's weights past
    the row's end, logits 20x past the cap; the twin in fp64 on the same (bf16-rounded) logits."""
    a = cases.inputs(case)
    got = _got(interpreted, case)
    raw = a["raw"].double().requires_grad_()
    twin = head.softcapped_ce.plain  # in the logits' dtype (fp64 here): cap_in_bf16=ce_bf16=True keep it
    want = twin(raw, a["targets"], a["mtp"], a["cap"], a["divisor"], a["offset"], True, True)
    want.backward()
    assert got["loss"].dtype == torch.float32 and got["grad"].dtype == a["raw"].dtype
    torch.testing.assert_close(got["loss"].double(), want.detach(), rtol=1e-6, atol=1e-6)
    # the bf16 gradient: narrowed once (one step under the interpreter) and scaled by 1/rows in bf16
    tol = 1e-6 if a["raw"].dtype == torch.float32 else BF16_STEP + 2**-8
    torch.testing.assert_close(got["grad"].double(), raw.grad, rtol=tol, atol=1e-7)
    if case == "ce_ignore":
        assert (got["grad"][0, 2] == 0).all() and (got["grad"][1, 6] == 0).all()


def _close_loss_and_grad(got: dict, want, wanted_grad, dtype) -> None:
    assert got["loss"].dtype == torch.float32 and got["grad"].dtype == dtype
    torch.testing.assert_close(got["loss"].double(), want.detach(), rtol=1e-6, atol=1e-6)
    tol = 1e-6 if dtype == torch.float32 else BF16_STEP + 2**-8
    # fp32's cancellation in Σw·softmax − w at a target column: a few fp32 steps of the largest entry
    atol = 1e-6 * wanted_grad.abs().max().item()
    torch.testing.assert_close(got["grad"].double(), wanted_grad, rtol=tol, atol=atol)


@pytest.mark.parametrize("case", ["ce_prefix", "ce_prefix_ignore", "ce_prefix_mtp", "ce_prefix_bf16"])
def test_the_fused_prefix_arm_equals_the_plain_ce_plus_prefix_loss_and_its_gradient(interpreted, case):
    """#88's prefix target as one more column of the fused CE: ids without a prefix (−1), a prefix on
    the ragged tile's last column, ignored next-token targets, MTP; the twin (the head's CE plus
    prefix.prefix_loss on the same capped logits) in fp64."""
    a = cases.inputs(case)
    got = _got(interpreted, case)
    raw = a["raw"].double().requires_grad_()
    cap = (a["cap"], a["divisor"], a["offset"])
    want = head.softcapped_prefix_ce.plain(
        raw, a["targets"], a["mtp"], a["table"], a["weight"], *cap, True, True
    )
    want.backward()
    _close_loss_and_grad(got, want, raw.grad, a["raw"].dtype)
    without = head.softcapped_ce.plain(a["raw"].double(), a["targets"], a["mtp"], *cap, True, True)
    assert (got["loss"].double() - without).abs() > 1e-3, "the prefix term is missing"


@pytest.mark.parametrize(
    "case", ["sampled_plain", "sampled_mtp_prefix", "sampled_no_prefix_candidates", "sampled_bf16"]
)
def test_the_fused_sampled_arm_equals_the_plain_sampled_loss_and_its_gradient(interpreted, case):
    """#92's loss over the candidates' logits (P = 150: a ragged tile; targets on its first and last
    column), MTP's terms past the row's end, prefix targets outside C (−1), and a set with no prefix
    target in C (the term adds nothing); the twin (model/gpt2026/sampled.py) in fp64."""
    sampled = importlib.import_module("speedrun.model.gpt2026.sampled")
    a = cases.inputs(case)
    got = _got(interpreted, case)
    logits = a["logits"].double().requires_grad_()
    cap = (a["cap"], a["divisor"], a["offset"])
    want = sampled.sampled_softcapped_ce.plain(
        logits, a["pos"], a["mtp"], a["prefix_pos"], a["prefix_weight"], *cap
    )
    want.backward()
    _close_loss_and_grad(got, want, logits.grad, a["logits"].dtype)
    if case == "sampled_no_prefix_candidates":
        alone = sampled.sampled_softcapped_ce.plain(
            a["logits"].double(), a["pos"], a["mtp"], None, None, *cap
        )
        torch.testing.assert_close(got["loss"].double(), alone, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["ngram_fp32", "ngram_bf16", "ngram_pulled"])
def test_the_ngram_gather_and_sink_equal_the_plain_rows_and_their_scatter_added_gradient(interpreted, case):
    """The signed bigram + trigram rows (d = 40 against 32-wide tiles) and the source's gradient, where
    rows repeat within a row of tokens and across tokens; from the table and from pulled rows. The
    forward against the twin exactly in fp32 (±1 products, one rounding), within the rounding's step in
    bf16; the gradient against an fp64 reference
    written here: each token's d out times its sign rows, index_add-ed into the rows it read."""
    ngram = importlib.import_module("speedrun.model.gpt2026.ngram")
    a = cases.inputs(case)
    got = _got(interpreted, case)
    src, slots, sb, st, pool = (a[k] for k in ("source", "slots", "sb", "st", "pool"))
    twin = ngram.ngram_embed.plain(src, slots, sb, st, pool)
    if src.dtype == torch.float32:
        assert torch.equal(got["out"], twin)
    else:  # the one rounding to bf16: toward zero under the interpreter, to nearest in the twin
        exact = ngram.ngram_embed.plain(src.double(), slots, sb, st, pool)
        assert got["out"].dtype == src.dtype
        assert ((got["out"].double() - exact).abs() <= exact.abs() * BF16_STEP).all()
        assert ((got["out"].double() - twin.double()).abs() <= exact.abs() * BF16_STEP).all()
    T = sb.size(1)
    assert slots.unique().numel() < slots.numel(), "no repeated row: the sink's atomics are untested"
    g = a["wout"].to(src.dtype).double()  # d out reaches the sink in out's dtype
    shares = torch.cat([g * pool.double()[sb], g * pool.double()[st]], dim=1)  # (B, 2T, d): each read's
    want = torch.zeros(src.shape, dtype=torch.float64).index_add_(
        0, slots.reshape(-1), shares.reshape(-1, 40)
    )
    assert got["grad"].dtype == src.dtype and slots.size(1) == 2 * T
    if src.dtype == torch.float32:
        torch.testing.assert_close(got["grad"].double(), want, rtol=1e-6, atol=1e-6)
    else:  # summed in fp32, rounded once to bf16 (toward zero under the interpreter)
        assert ((got["grad"].double() - want).abs() <= want.abs() * BF16_STEP + 1e-6).all()
    twin_src = src.clone().requires_grad_()
    (ngram.ngram_embed.plain(twin_src, slots, sb, st, pool).float() * a["wout"]).sum().backward()
    torch.testing.assert_close(got["grad"].double(), twin_src.grad.double(), rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("case", ["row_adam_fp32", "row_adam_bf16"])
def test_the_row_adam_kernel_steps_the_table_as_the_plain_row_adam(interpreted, case):
    """12 steps at β1 = 0 with #92's changes (β2 squared from step 6, decay 0.7, a decaying LR): rows
    repeated in a step, steps that touch no row, rows asleep for 3 steps (their missed steps replayed),
    rows never touched; the twin (RowAdam's own arithmetic) in fp64 for the fp32 table, in bf16 for the
    bf16 one (whose every step rounds the table: toward zero under the interpreter)."""
    a = cases.inputs(case)
    got = _got(interpreted, case)
    bf16 = a["table"].dtype == torch.bfloat16
    want = cases.run_row_adam({**a, "table": a["table"] if bf16 else a["table"].double()})
    assert got["table"].dtype == a["table"].dtype
    assert torch.equal(got["current"], want["current"])
    moved = (got["table"] != a["table"]).any(1)
    assert moved[:5].all() and not moved[20:].any(), "the schedule touched other rows than it should"
    if bf16:
        scale = want["table"].abs().max().item()
        torch.testing.assert_close(
            got["table"].double(), want["table"].double(), rtol=0, atol=4 * BF16_STEP * scale
        )
        torch.testing.assert_close(got["exp_avg_sq"], want["exp_avg_sq"], rtol=1e-2, atol=1e-8)
    else:
        torch.testing.assert_close(got["table"].double(), want["table"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["exp_avg_sq"].double(), want["exp_avg_sq"], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("case", ["relu2_fp32", "relu2_bf16"])
def test_the_fused_relu2_up_projection_equals_the_plain_op_and_its_gradients(interpreted, case):
    """Forward ReLU²(x Wᵀ) and both gradients against the plain op: in fp64 for fp32 inputs; for bf16
    inputs against the plain op in bf16 under autograd (its backward's bf16 matmuls round as the
    kernel's plain-torch backward does), within a few bf16 steps of the largest value."""
    from speedrun.model.layers import relu2_linear

    a = cases.inputs(case)
    got = _got(interpreted, case)
    bf16 = a["x"].dtype == torch.bfloat16
    x, w = (t.clone() if bf16 else t.double() for t in (a["x"], a["w"]))
    x.requires_grad_(), w.requires_grad_()
    want = relu2_linear.plain(x, w)
    (want.double() * torch.linspace(-1, 1, want.size(-1), dtype=torch.float64)).sum().backward()
    assert got["out"].dtype == a["x"].dtype and got["out"].shape == (2, 25, 72)
    for name, g, ref in (
        ("out", got["out"], want.detach()),
        ("dx", got["dx"], x.grad),
        ("dw", got["dw"], w.grad),
    ):
        ref = ref.double()
        tol = 4 * BF16_STEP * ref.abs().max().item() if bf16 else 1e-5
        torch.testing.assert_close(g.double(), ref, rtol=2 * BF16_STEP if bf16 else 1e-5, atol=tol, msg=name)


def test_the_cuda_branch_of_the_swap_compiles_in_one_graph_and_trains_as_the_plain_ops(interpreted):
    """swaps.install asked as on CUDA installs every kernel; record-2026-07's step (MTP 1, 0.5, 0.25)
    and Polar Express compile with fullgraph=True, call the kernels' custom ops inside their graphs, and
    give the plain eager run's loss, gradients and orthogonalized matrices."""
    from speedrun.perf.kernels import REPLACES
    from tests import perf_traced

    got = torch.load(interpreted / "traced.pt")
    assert got["installed"] == sorted(REPLACES)
    for op in (
        "speedrun.softcapped_ce_rows.default",
        "speedrun.sym_gram.default",
        "speedrun.sym_ba_plus_caa.default",
    ):
        assert op in got["seen"], f"{op} is not in the compiled graphs"
    want = perf_traced.plain()
    torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-5, atol=1e-5)
    assert got["grads"].keys() == want["grads"].keys()
    for n, g in got["grads"].items():
        torch.testing.assert_close(g, want["grads"][n], rtol=1e-3, atol=1e-5, msg=n)
    for o, w in zip(got["ortho"], want["ortho"], strict=True):
        torch.testing.assert_close(o, w, rtol=1e-4, atol=1e-5)


def test_the_ngram_prefix_and_sampled_swaps_compile_in_one_graph_and_train_as_the_plain_ops(interpreted):
    """#92's parts on the same step (the n-gram table, #88's prefix loss, the sampled softmax): with every
    kernel installed as on CUDA, a full-softmax step and a sampled step each compile with fullgraph=True,
    call the n-gram gather and the CE kernel (its prefix arm, then its sampled arm) inside the graph, and
    give the plain eager steps' losses and gradients (the n-gram table's among them)."""
    from tests import perf_traced

    got = torch.load(interpreted / "traced.pt")
    want = perf_traced.plain()["anvil"]
    for name in ("full", "sampled"):
        seen = got["anvil_seen"][name]
        for op in ("speedrun.softcapped_ce_rows.default", "speedrun.ngram_gather.default"):
            assert op in seen, f"{op} is not in the {name} step's graph"
        g, w = got["anvil"][name], want[name]
        torch.testing.assert_close(g["loss"], w["loss"], rtol=1e-5, atol=1e-5, msg=name)
        assert g["grads"].keys() == w["grads"].keys() and "bigram.table" in g["grads"]
        for n, grad in g["grads"].items():
            torch.testing.assert_close(grad, w["grads"][n], rtol=1e-3, atol=1e-5, msg=f"{name}: {n}")
    assert (got["anvil"]["full"]["loss"] - got["anvil"]["sampled"]["loss"]).abs() > 1e-3, "P had no effect"
