"""The banks-2026-01 recipe's model against record #65 (records/track_1_short/2026-01-30_VeFused): its
interleaved rotary pairs as a permutation of ours, bf16 block storage through the mantissa buffer
(#57), the shrunk recipe through the training loop, and the fp32 forward loss and every gradient."""

from __future__ import annotations

import math

import pytest
import torch

from speedrun.model.families import build_model
from speedrun.recipes import load_recipe
from speedrun.train.schedule import apply_to_model, schedule_at
from tests.fidelity.checks import (
    assert_loss_and_gradients_are_the_records,
    fp32_model,
    jitter_,
    two_documents,
)
from tests.fidelity.refs.yarn import windows_passed, yarn_through
from tests.fidelity.test_banks_recipe import EXT, RECIPE, STAGES_65, N, RecordSchedule65

# ------------------------------------------------------------------ #65's interleaved rotary pairs


def record_65_rotary_tables(head_dim: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """#65's Yarn.reset (not paired; fp32 here, the record casts to bf16): interleaved pairs (2i, 2i+1)
    share a frequency, the upper half of the dims is stationary; factor2's odd entries negated."""
    angular_freq = (1 / 1024) ** torch.linspace(0, 1, steps=head_dim // 4, dtype=torch.float32)
    angular_freq = angular_freq.repeat_interleave(2)
    angular_freq = torch.cat([angular_freq, angular_freq.new_zeros(head_dim // 2)])
    theta = torch.outer(torch.arange(t, dtype=torch.float32), angular_freq)
    factor1, factor2 = theta.cos(), theta.sin()
    factor2[..., 1::2] *= -1
    return factor1, factor2


def record_65_rotary(x_bthd: torch.Tensor, factor1: torch.Tensor, factor2: torch.Tensor) -> torch.Tensor:
    """#65's Yarn.rotary."""
    f1, f2 = factor1[None, : x_bthd.size(-3), None, :], factor2[None, : x_bthd.size(-3), None, :]
    x_flip = x_bthd.view(*x_bthd.shape[:-1], x_bthd.shape[-1] // 2, 2).flip(-1).view(x_bthd.shape)
    return f1 * x_bthd + f2 * x_flip


def interleave(head_dim: int) -> torch.Tensor:
    """Our half-split dims in #65's order: its pair (2i, 2i+1) is our (i, i + D/2)."""
    half = torch.arange(head_dim // 2)
    return torch.stack([half, half + head_dim // 2], dim=-1).flatten()


def test_the_interleaved_rotary_with_the_upper_half_offset_is_ours_with_q_k_rows_permuted():
    """#65 rotates adjacent dims and shifts the keys' upper half (its stationary dims); ours rotates
    (i, i + D/2) and shifts dims D/4:D/2 and 3D/4:D. Permuting each head's Q/K rows maps one onto the
    other bit for bit (the same products and sums per element), so the scores are equal and the init
    law (i.i.d. uniform rows), QK-norm and NorMuon (row statistics, orthogonalization) are unchanged:
    #65's layout is a relabelling of ours, not a new function."""
    from speedrun.model.gpt2026.attention import offset_keys
    from speedrun.model.layers import Rotary

    B, T, H, D = 1, 64, 2, 32
    gen = torch.Generator().manual_seed(0)
    dim = H * D
    x = torch.randn(B, T, dim, generator=gen)
    w_q, w_k = (
        torch.randn(dim, dim, generator=gen) * dim**-0.5,
        torch.randn(dim, dim, generator=gen) * dim**-0.5,
    )
    perm = interleave(D)
    rows = torch.cat([h * D + perm for h in range(H)])  # the record's Q/K rows, head by head
    rot = Rotary(D, T, 10000.0, True, "fp32")
    q, k = (torch.nn.functional.rms_norm(F_linear(x, w).view(B, T, H, D), (D,)) for w in (w_q, w_k))
    q_ours, k_ours = rot(q.transpose(1, 2)), offset_keys(rot(k.transpose(1, 2)), seq_dim=2)
    f1, f2 = record_65_rotary_tables(D, T)
    # the rotation and the shift alone, on the same normalized q and k: bit for bit
    q_rec, k_rec = record_65_rotary(q[..., perm], f1, f2), record_65_rotary(k[..., perm], f1, f2)
    k_rec[:, 1:, :, D // 2 :] = k_rec[:, :-1, :, D // 2 :].clone()  # key_offset on the upper half
    torch.testing.assert_close(q_rec, q_ours.transpose(1, 2)[..., perm], rtol=0, atol=0)
    torch.testing.assert_close(k_rec, k_ours.transpose(1, 2)[..., perm], rtol=0, atol=0)
    # from x through #65's row order (QK-norm sums in another order: fp32 rounding)
    q_rec, k_rec = (
        record_65_rotary(torch.nn.functional.rms_norm(F_linear(x, w[rows]).view(B, T, H, D), (D,)), f1, f2)
        for w in (w_q, w_k)
    )
    k_rec[:, 1:, :, D // 2 :] = k_rec[:, :-1, :, D // 2 :].clone()
    scores_rec = torch.einsum("bthd,bshd->bhts", q_rec, k_rec)
    torch.testing.assert_close(scores_rec, q_ours @ k_ours.transpose(-1, -2), rtol=1e-5, atol=1e-5)


def F_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # noqa: N802
    return torch.nn.functional.linear(x, w)


# ------------------------------------------------------------------ #57's bf16 block storage


def test_bf16_blocks_step_as_fp32_blocks_through_the_mantissa_buffer():
    """model.block_dtype=bf16 (#57/#65: attn_bank and mlp_bank in bf16): after optimizer steps on the same
    gradients, each bf16 block matrix is the top half of the fp32 twin's (the buffer holds the rest, as
    #65's _cautious_wd_and_update_inplace), and every other parameter is bit for bit the twin's."""
    from speedrun.model.gpt2026.init import BLOCK_MATRICES
    from speedrun.model.labels import label_of
    from speedrun.optim.build import build_optimizer
    from speedrun.train.schedule import apply_schedule
    from tests.recipe_matrix import shrink

    extra = [
        "model.embed_dtype=fp32",
        "model.fp8_head=false",
        "optim.muon_ns_dtype=fp32",
        "optim.tie_until=4",
    ]
    models, opts = [], []
    for dtype in ("bf16", "fp32"):
        cfg = load_recipe(
            RECIPE, [*shrink(RECIPE), *extra, "model.bigram_rows=300", f"model.block_dtype={dtype}"]
        )
        torch.manual_seed(0)
        models.append(build_model(cfg.model))
    m16, m32 = models
    blocks = {n for n, p in m16.named_parameters() if label_of(p).name in BLOCK_MATRICES}
    assert blocks and {p.dtype for n, p in m16.named_parameters() if n in blocks} == {torch.bfloat16}
    assert {p.dtype for n, p in m16.named_parameters() if n not in blocks} == {torch.float32}
    with torch.no_grad():  # the twin starts from the bf16 values
        for p16, p32 in zip(m16.parameters(), m32.parameters(), strict=True):
            p32.copy_(p16.float())
    opts = [build_optimizer(m, cfg) for m in (m16, m32)]
    gen = torch.Generator().manual_seed(1)
    for step in range(6):
        for m, opt in zip((m16, m32), opts, strict=True):
            apply_schedule(schedule_at(step, cfg), opt, m)
        for p16, p32 in zip(m16.parameters(), m32.parameters(), strict=True):
            g = torch.randn(p16.shape, generator=gen).to(p16.dtype)
            p16.grad, p32.grad = g.clone(), g.float()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for (name, p16), p32 in zip(m16.named_parameters(), m32.parameters(), strict=True):
        if name in blocks:
            top = (p32.detach().view(torch.int32) >> 16).to(torch.int16)
            assert torch.equal(p16.detach().view(torch.int16), top), name
            assert not torch.equal(p16.detach().float(), p32.detach()), name  # the low bits live on
        else:
            assert torch.equal(p16.detach(), p32.detach()), name


def test_bf16_blocks_need_the_normuon_table():
    from speedrun.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model\.block_dtype=bf16 needs optim\.name=normuon"):
        load_recipe(RECIPE, ["model.block_dtype=bf16", "optim.name=muon"])


@pytest.mark.slow
def test_the_shrunk_recipe_trains_through_the_loop(text_data, tmp_path):
    """The training loop on the shrunk recipe: bf16 blocks through the mantissa buffer, the bigram
    table, gates in Adam, paired heads, grad_scale 2 x tokens/8, tie → untie."""
    import json

    from speedrun.train import loop
    from tests.recipe_matrix import shrink

    eot = json.loads((text_data / "meta.json").read_text())["eot_id"]
    plan = "tokens=256 doc=64 windows=1/1 frac=1/2 mtp=1,0.5,0.25>1,0.5,0; "
    plan += "tokens=512 windows=1/2 lr=1.5 frac=1/2; tokens=512 windows=1/2 ext=2 val=1/3 yarn=2"
    over = [*shrink(RECIPE), f"data.dir={text_data}", "data.tokenizer=bpe:512", f"model.eot_id={eot}",
            "model.vocab_size=512", "model.embed_dtype=fp32", "model.fp8_head=false",
            "model.bigram_rows=1000",
            "optim.muon_ns_dtype=fp32", "train.seq_len=128", "train.micro_batch_tokens=128",
            "train.global_batch_tokens=512", "model.max_seq_len=512", "train.val_seq_len=512",
            "train.val_tokens=2048", "train.steps=8", f"train.stages={plan}", "optim.tie_until=4",
            "train.log_every=1", "data.max_docs=0"]  # fmt: skip
    cfg = load_recipe(RECIPE, over)
    assert cfg.model.block_dtype == "bf16" and cfg.train.grad_scale_mul == 2.0
    loop.train(cfg, tmp_path / "run")
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train_loss"] for r in lines if "train_loss" in r]
    assert losses and all(math.isfinite(v) for v in losses)
    assert any("val_loss" in r and math.isfinite(r["val_loss"]) for r in lines)


# ------------------------------------------------------------------ #65's model, forward and gradients


@pytest.mark.parametrize("step", [100, 700, 1200, N + EXT])  # MTP 3, MTP 2 after YaRN 3 → 7, 11; validation
def test_forward_loss_and_gradients_match_the_65_model_in_fp32(step):
    """The recipe's model (fp32 blocks) against #55's forward with #58's, #62's and #63's lines
    (tests/test_banks_switches.record_55_forward: #65's forward apart from the one-parameter value-
    embedding layout) on #65's windows, YaRN history and MTP weights at `step`."""
    from tests.fidelity.test_banks_switches import record_55_forward
    from tests.fidelity.test_yarn_recipe import RecordYarn

    heads, dim, T, vocab = 4, 64, 1024, 120
    cfg, model = fp32_model(
        RECIPE, ["model.block_dtype=fp32"], n_head=heads, n_embd=dim, vocab_size=vocab, max_seq_len=T
    )
    jitter_(model, 0.02, gates_and_bigram=True)
    x, y, cu = two_documents(vocab, T)
    rec = RecordSchedule65()
    training = step < rec.total_steps
    model.train(training)
    apply_to_model(schedule_at(step, cfg), model)
    stage = rec.lookup(min(step, rec.total_steps - 1))[0]
    ws_short, ws_long = stage[2] if training else (6, 20)  # apply_final_ws_ext
    yarn = RecordYarn(dim // heads, 2 * T)
    seen = windows_passed(
        STAGES_65[0][2][1], lambda s: rec.lookup(s)[0][2][1], min(step, rec.total_steps - 1)
    )
    scale = yarn_through(yarn, seen)
    weights = {n: p.detach().clone().requires_grad_(training) for n, p in model.named_parameters()}
    with torch.set_grad_enabled(training):
        loss = model(x[None], y[None], cu)
        mtp = rec.mtp_weights(step) if training else [1.0]
        ref = record_55_forward(
            weights, x, y, cu, (ws_short, ws_long), yarn, scale, mtp, heads, dim, training, (0, 2, 5, 9)
        )
    assert_loss_and_gradients_are_the_records(model, loss, ref, weights, T, training)
