"""#344's model.qk_head_dim (Q/K 96 wide, V 128) against PR #344's CausalSelfAttention (c4c209d1,
train_gpt.py 1101-1183 with triton_kernels.py's QKNormRoPEPad 1959-2068), transcribed here on the
non-FP8 path: the fused λ-scaled QKV, QK-norm over the 96 dims, interleaved rotary with the key offset
on the upper half, paired heads, document-windowed causal attention at 0.1·√(128/96), the transposed O.
Ours rotates half-split pairs; #65's interleaved pairs are ours with each head's Q/K rows permuted
(tests/fidelity/test_banks_model.py), so the reference gets our weights with those rows permuted."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from speedrun.errors import ConfigError
from speedrun.model.families import build_model
from speedrun.model.gpt2026 import windows
from speedrun.model.summary import model_summary
from speedrun.optim.build import model_rules
from speedrun.recipes import load_recipe
from speedrun.train.flops import first_and_last
from tests.decoding import assert_cached_decoding_is_the_forward
from tests.fidelity.checks import jitter_

BASE = "banks-2026-01"
EPS = 1.1920928955078125e-7  # the kernel's rms eps (fp32's)


def tiny(qk: int, **fields):
    """A 4-layer gpt2026 model config of banks-2026-01's parts (paired heads, key offset on long layers,
    λ-scaled weights) with 4 heads of V width 32 and Q/K width `qk`."""
    from tests.recipe_matrix import replace, shrink

    cfg = load_recipe(BASE, [*shrink(BASE), "model.n_head=4", "model.n_embd=128", "model.block_dtype=fp32"])
    base = dict(qk_head_dim=qk, embed_dtype="fp32", fp8_head=False, vocab_size=120, eot_id=119)
    return replace(cfg.model, **(base | fields))


def record_344_attention(x, qk_w, v_w, o_w, lambdas, cu, bm_size, paired, key_offset, H, scale, freq):
    """#344's CausalSelfAttention.forward for one packed row x (T, C), fp32 factor tables. qk_w (2·H·Dqk, C)
    in the record's interleaved order, v_w (H·D, C), o_w (H·D, C) stored transposed. bm_size: FA3's left
    window (a key is visible while q − k <= bm_size); freq: Yarn.angular_freq (Dqk)."""
    T, C = x.shape
    Dqk, D = qk_w.shape[0] // (2 * H), v_w.shape[0] // H
    qkv = F.linear(x, lambdas[0] * torch.cat((qk_w, v_w)))
    qk, v = qkv.split((2 * H * Dqk, H * D), dim=-1)
    qk, v = qk.view(T, 2 * H, Dqk), v.view(T, H, D)
    # QKNormRoPEPad: rms over Dqk, y = f1·x + f2·flip(x), factor2's odd lanes negated
    n = qk * torch.rsqrt(qk.square().sum(-1, keepdim=True) / Dqk + EPS)
    flip = n.view(T, 2 * H, Dqk // 2, 2).flip(-1).view(T, 2 * H, Dqk)
    heads = torch.arange(2 * H) % H
    t = torch.arange(T, dtype=torch.float32)[:, None] * (2 if paired else 1) + (heads % 2 if paired else 0)
    theta = t[..., None] * freq  # (T, 2H, Dqk); the record's tables are bf16, read as fp32
    f1, f2 = theta.cos().bfloat16().float(), theta.sin().bfloat16().float()
    f2[..., 1::2] *= -1
    y = f1 * n + f2 * flip
    if key_offset:  # K rows, t > 0, dims >= Dqk/2: the previous token's normalized key
        y[1:, H:, Dqk // 2 :] = n[:-1, H:, Dqk // 2 :]
    q, k = y[:, :H], y[:, H:]
    seqlens, pos = cu, torch.arange(T)
    if paired:  # input head h of token t → token 2t + h // (H/2), head h % (H/2)
        q, k, v = (z.reshape(2 * T, H // 2, z.size(-1)) for z in (q, k, v))
        seqlens, pos = 2 * cu, torch.arange(2 * T)
    doc = torch.searchsorted(seqlens[1:], pos, right=True)
    back = pos[:, None] - pos[None]
    visible = (back >= 0) & (back <= bm_size) & (doc[:, None] == doc[None])
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    att = s.masked_fill(~visible, float("-inf")).softmax(-1)
    out = torch.einsum("hqk,khd->qhd", att, v).reshape(T, H * D)
    return out @ (lambdas[1] * o_w)


def record_order(Dqk: int, H: int) -> torch.Tensor:
    """Our Q/K rows in the record's order: its pair (2i, 2i+1) of a head is our (i, i + Dqk/2)."""
    half = torch.arange(Dqk // 2)
    per_head = torch.stack([half, half + Dqk // 2], dim=-1).flatten()
    return torch.cat([h * Dqk + per_head for h in range(2 * H)])


def record_freq(Dqk: int) -> torch.Tensor:
    """#344's Yarn(qk_dim).angular_freq before any YaRN update."""
    f = (1 / 1024) ** torch.linspace(0, 1, steps=Dqk // 4).repeat_interleave(2)
    return torch.cat([f, f.new_zeros(Dqk // 2)])


@pytest.mark.parametrize("paired,key_offset", [(False, True), (True, False), (False, False)])
def test_layer_loss_and_every_gradient_are_344s(paired, key_offset):
    H, D, Dqk = 4, 32, 24
    torch.manual_seed(0)
    model = build_model(tiny(Dqk)).float()
    attn = next(b.attn for b in model.blocks if b.attn is not None)
    attn.paired, attn.key_offset, attn.gate = paired, key_offset, None
    assert attn.c_attn.weight.shape == (2 * H * Dqk + H * D, H * D) and attn.weights_mix
    with torch.no_grad():
        attn.c_attn.weight.normal_(0, 0.2)
        attn.c_proj.weight.normal_(0, 0.2)
        attn.lambdas.copy_(torch.tensor([0.7, 1.3]))
    T, window = 96, 40
    cu = torch.tensor([0, 30, 77, 96, 96], dtype=torch.int32)
    x = torch.randn(1, T, H * D, requires_grad=True)
    k = 2 if paired else 1  # a paired layer's context (#58): bounds and lengths doubled
    out, _ = attn(x, windows.Packed(k * cu, window, k * T, k * T))
    g = torch.randn_like(out)
    (out * g).sum().backward()

    w = attn.c_attn.weight.detach()
    qk_w = w[: 2 * H * Dqk][record_order(Dqk, H)].clone().requires_grad_(True)
    v_w = w[2 * H * Dqk :].clone().requires_grad_(True)
    o_w = attn.c_proj.weight.detach().T.clone().requires_grad_(True)
    lam = attn.lambdas.detach().clone().requires_grad_(True)
    xr = x.detach()[0].clone().requires_grad_(True)
    scale = 0.1 * math.sqrt(D / Dqk)  # init_attn's qk_attn_scale
    ref = record_344_attention(xr, qk_w, v_w, o_w, lam, cu, window - 1, paired, key_offset, H, scale,
                               record_freq(Dqk))  # fmt: skip
    (ref * g[0]).sum().backward()
    close = dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(out[0], ref, **close)
    torch.testing.assert_close(x.grad[0], xr.grad, **close)
    gw = attn.c_attn.weight.grad
    torch.testing.assert_close(gw[: 2 * H * Dqk][record_order(Dqk, H)], qk_w.grad, **close)
    torch.testing.assert_close(gw[2 * H * Dqk :], v_w.grad, **close)
    torch.testing.assert_close(attn.c_proj.weight.grad.T, o_w.grad, **close)
    torch.testing.assert_close(attn.lambdas.grad, lam.grad, **close)


def test_yarn_updates_the_narrow_rotary_and_the_widened_scale_as_344():
    """#344's Yarn(qk_dim, attn_scale=0.1·√(D/Dqk)).apply(old, new) vs our apply_yarn: the scale, and
    the rotary table of the Q/K width (our half-split frequencies are the record's pairs)."""
    D, Dqk = 32, 24
    model = build_model(tiny(Dqk, max_seq_len=512))
    wins = [128, 384, 896]
    windows.apply_yarn(model, wins)
    freq, scale = record_freq(Dqk), 0.1 * math.sqrt(D / Dqk)
    for old, new in zip(wins[:-1], wins[1:], strict=True):  # Yarn.apply, alpha 1, beta 32
        rotations = old * freq / (2 * torch.pi)
        factor = old / new
        weight = torch.clamp((rotations - 1) / (32 - 1), 0, 1)
        freq = freq * (factor + weight * (1 - factor))
        scale *= 0.2 * math.log(new / old) + 1
    attns = [b.attn for b in model.blocks if b.attn is not None]
    assert all(a.scale == pytest.approx(scale, rel=1e-12) for a in attns)
    rotary = attns[0].rotary
    assert rotary.cos.shape[-1] == Dqk // 2
    theta = torch.outer(torch.arange(rotary.cos.size(0), dtype=torch.float32), freq[0::2])
    for ours, ref in ((rotary.cos, theta.cos()), (rotary.sin, theta.sin())):  # bf16 tables, as the record's
        torch.testing.assert_close(ours.float(), ref.to(ours.dtype).float(), rtol=0, atol=1e-2)


def test_same_width_is_the_model_without_the_switch():
    """qk_head_dim equal to the V width builds the same parameters and the same loss, bit for bit."""
    idx = torch.randint(0, 119, (1, 64), generator=torch.Generator().manual_seed(3))
    losses = []
    for qk in (0, 32):
        torch.manual_seed(0)
        model = build_model(tiny(qk)).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
            losses.append(model(idx, idx))
    assert torch.equal(losses[0], losses[1])


@pytest.mark.parametrize("attention", ["varlen", "sdpa"])
def test_cached_decoding_equals_the_full_forward(attention):
    torch.manual_seed(0)
    model = build_model(tiny(24, attention=attention, window=192, xsa_layers=[3])).eval()
    assert any(b.attn.paired for b in model.blocks if b.attn) and any(
        b.attn.key_offset for b in model.blocks if b.attn
    )
    jitter_(model, 0.05)
    idx = torch.randint(0, 119, (1, 40), generator=torch.Generator().manual_seed(2))
    idx[0, 17] = model.cfg.eot_id  # a document boundary inside
    assert_cached_decoding_is_the_forward(model, idx, 25, tol=1e-5)


def test_parameter_count_flops_and_the_optimizers_qk_blocks():
    """The fused weight loses 2·H·(D − Dqk) rows per attention layer; attention FLOPs are
    6·L·H·(Dqk + D)·T; NorMuon's #80 blocks are head pairs of Dqk rows, V whole."""
    from speedrun.model.families import family_of
    from speedrun.model.flops import matmul_params
    from speedrun.optim.rules import block_rows

    H, D, Dqk, C = 4, 32, 24, 128
    wide, narrow = build_model(tiny(0)), build_model(tiny(Dqk))
    L = len(narrow.cfg.attention_layers)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(wide) - count(narrow) == L * 2 * H * (D - Dqk) * C
    assert matmul_params(wide) - matmul_params(narrow) == L * 2 * H * (D - Dqk) * C
    layers = family_of(narrow.cfg).attention_layers(narrow)  # the FLOPs count's d_attn = H·(Dqk + D)/2
    assert len(layers) == L and all(lay.width == H * (Dqk + D) / 2 for lay in layers)
    cfg = load_recipe(BASE)
    cfg.model = tiny(Dqk)
    assert model_summary(narrow, cfg, first_and_last(narrow, cfg)).count(f"(Q/K {Dqk}, #344)") == 1
    cfg.optim.muon_qk_block_heads = 2
    qkv = [e for e in model_rules(narrow, cfg) if e.label.name == "qkv"]
    assert qkv and all(block_rows(e) == (2 * Dqk,) * (2 * H // 2) + (H * D,) for e in qkv)


def test_bad_widths_are_refused_in_one_line():
    from speedrun.config.gpt2026 import check

    for bad in (-4, 30):
        with pytest.raises(ConfigError, match="qk_head_dim"):
            check(tiny(bad))
