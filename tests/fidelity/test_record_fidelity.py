"""Each record-specific switch against an independent computation: the record script's own formula,
written here from its code (modded-nanogpt logs), or a higher-precision reference."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from speedrun.config import ModelConfig
from speedrun.model import attention, fp8
from speedrun.model.attention import MaskSpec, build_block_mask, mask_rule, spec_dense_mask
from speedrun.model.families import build_model
from speedrun.model.layers import MLP, CastedLinear, Norm, Rotary, softcap
from speedrun.optim import Muon, muon_split, newton_schulz
from speedrun.optim.build import build_optimizer
from speedrun.recipes import load_recipe
from speedrun.train.step import autocast_dtype

NS_ABC = (3.4445, -4.7750, 2.0315)


def tiny(**switches) -> ModelConfig:
    base = dict(vocab_size=128, n_layer=4, n_head=2, n_embd=64, max_seq_len=256, positional="rotary")
    base.update(norm="rmsnorm", activation="relu2", bias=False, fused_qkv=False, init="torch")
    return ModelConfig(**{**base, **switches})


# ---------------------------------------------------------------- crash: value residual under DDP


def test_value_residual_gives_every_lambda_a_gradient():
    """DDP fails at step 2 on a parameter without a gradient; the record mixes layer 0's v with itself."""
    torch.manual_seed(0)
    model = build_model(tiny(value_residual=True, tie_embeddings=False))
    x = torch.randint(0, 128, (2, 64))
    model(x, x).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing


# ---------------------------------------------------------------- 12-08 block-listed windows


def _record_1208_mask(T: int, docs: torch.Tensor, w: int) -> torch.Tensor:
    """The 12-08 record: kv block listed when causal, documents overlap and q_block − kv_block <
    ceil(w/128); inside listed blocks the token mask causal & same document & q − kv < w."""
    q, kv = torch.arange(T)[:, None], torch.arange(T)[None, :]
    token = (q >= kv) & (docs[q] == docs[kv]) & (q - kv < w)
    listed = (q // 128 - kv // 128) < (w + 127) // 128
    return token & listed


@pytest.mark.parametrize("w", [64, 192, 320, 448])  # odd multiples of 64: where blocks and tokens differ
def test_block_listed_window_is_the_12_08_mask(w):
    T = 1024
    gen = torch.Generator().manual_seed(w)
    docs = (torch.rand(T, generator=gen) < 0.003).cumsum(0).to(torch.int32)
    spec = MaskSpec(docs[None], torch.tensor(w), block_list=True, max_window=w)
    want = _record_1208_mask(T, docs, w)
    assert torch.equal(spec_dense_mask(spec, 0, T, 0, T, None)[0, 0], want)
    assert not torch.equal(want, mask_rule(torch.arange(T)[:, None], torch.arange(T)[None], None, None, w))
    q, k, v = (torch.randn(1, 2, T, 16, generator=gen) for _ in range(3))
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=want)
    with torch.no_grad():  # FlexAttention forward runs on CPU; the block lists must drop the same blocks
        flex = attention.flex_attend(q, k, v, build_block_mask(spec, T))
    torch.testing.assert_close(flex, dense, atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------- numerics of the 2024-10 / 11 models


def test_bf16_model_casts_like_the_record():
    """11-08 … 12-08: model.bfloat16(), then every CastedLinear back to fp32."""
    cfg = load_recipe("unet-2024-11").model
    small = dict(n_layer=4, n_embd=64, n_head=2, vocab_size=128, max_seq_len=64)
    ours = build_model(ModelConfig(**{**cfg.__dict__, **small}))
    ref = build_model(ModelConfig(**{**cfg.__dict__, **small, "bf16_model": False})).bfloat16()
    for m in ref.modules():
        if isinstance(m, CastedLinear):
            m.float()
    want = {n: p.dtype for n, p in ref.named_parameters()}
    assert {n: p.dtype for n, p in ours.named_parameters()} == want
    assert want["skip_weights"] == want["blocks.1.lambdas"] == want["blocks.1.attn.lamb"] == torch.bfloat16
    adam = torch.optim.Adam([ours.skip_weights])
    ours.skip_weights.grad = torch.ones_like(ours.skip_weights)
    adam.step()
    assert adam.state[ours.skip_weights]["exp_avg"].dtype == torch.bfloat16


def _record_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    d = x.size(-1) // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos], -1)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-angles"])
def test_rotary_precision_follows_the_records(precision):
    T, D, base = 256, 64, 10000.0
    x = torch.randn(1, 2, T, D).bfloat16()
    if precision == "bf16-angles":  # 12-04/12-08: bf16 buffer (1/base)^(2i/d), int positions
        inv = ((1 / base) ** (torch.arange(0, D, 2) / D)).bfloat16()
        freqs = torch.outer(torch.arange(T), inv)
        want = _record_rotary(x, freqs.cos(), freqs.sin()).type_as(x)
    else:  # 10-10: fp32 tables promote the bf16 q/k; 10-14 … 11-24: tables cached in bf16
        inv = 1.0 / (base ** (torch.arange(0, D, 2).float() / D))
        freqs = torch.outer(torch.arange(T).float(), inv)
        cos, sin = freqs.cos(), freqs.sin()
        if precision == "bf16":
            cos, sin = cos.bfloat16(), sin.bfloat16()
        want = _record_rotary(x, cos, sin).bfloat16()
    got = Rotary(D, T, base, precision=precision)(x)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    if precision != "bf16":  # under bf16 activations "auto" already rounds the tables like 11-03 … 11-24
        assert not torch.equal(Rotary(D, T, base)(x), want)


def test_erf_gelu_and_fp32_rmsnorm_of_10_10():
    x = (torch.randn(4, 32, 64) * 0.05).bfloat16()  # small activations: bf16's eps 2^-7 would dominate
    ref = x.float()
    ref = (ref * torch.rsqrt(ref.pow(2).mean(-1, keepdim=True) + 1e-6)).type_as(x)  # record rmsnorm
    torch.testing.assert_close(Norm(64, "rmsnorm", eps=1e-6, fp32=True)(x), ref, atol=0, rtol=0)
    assert not torch.equal(Norm(64, "rmsnorm")(x), ref)
    mlp = MLP(64, 256, False, False, gelu="erf")
    h = torch.randn(3, 64)
    want = mlp.c_proj(F.gelu(mlp.c_fc(h)))
    torch.testing.assert_close(mlp(h), want, atol=0, rtol=0)
    mlp.gelu_approximate = "tanh"  # the default form differs
    assert not torch.equal(mlp(h), want)


def test_qk_norm_after_rotary_of_10_14():
    torch.manual_seed(0)
    after = build_model(tiny(qk_norm=True, qk_norm_after_rotary=True)).blocks[0].attn
    x = torch.randn(1, 32, 64)
    q, k, v = (t.view(1, 32, 2, 32).transpose(1, 2) for t in (after.c_q(x), after.c_k(x), after.c_v(x)))
    rot = after.rotary
    q, k = F.rms_norm(rot(q), (32,)), F.rms_norm(rot(k), (32,))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(1, 32, 64)
    torch.testing.assert_close(after(x)[0], after.c_proj(y))


# ---------------------------------------------------------------- Muon as the records ran it


def _record_ns(G: torch.Tensor, form: str) -> torch.Tensor:
    """zeropower_via_newtonschulz5 of the records, op for op."""
    a, b, c = NS_ABC
    X = G.bfloat16() / (G.norm() + 1e-7) if form == "2024-10-10" else G.bfloat16()
    if form != "2024-10-10":
        X = X / (X.norm() + 1e-7)
    X = X.T if G.size(0) > G.size(1) else X
    for _ in range(5):
        A = X @ X.T
        if form == "2024-11-10":
            B = b * A + c * A @ A
            X = a * X + B @ X
        else:
            B = A @ X
            X = a * X + b * B + c * A @ B
    return X.T if G.size(0) > G.size(1) else X


@pytest.mark.parametrize("form", ["2024-10-10", "2024-10-14", "2024-11-10"])
def test_newton_schulz_evaluates_each_eras_ops(form):
    G = torch.randn(96, 48, generator=torch.Generator().manual_seed(1))
    want = _record_ns(G, form)
    assert torch.equal(newton_schulz(G, form=form), want)
    assert not torch.equal(newton_schulz(G), want)  # today's fused evaluation rounds differently


def _muon_under_warmup(form: str) -> tuple[torch.Tensor, torch.Tensor]:
    """4 steps with momentum 0.85 → 0.95; returns (Muon's result, the SGD-form record reference)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(24, 16, generator=gen, dtype=torch.float64))
    ref, buf = p.detach().clone(), torch.zeros_like(p)
    opt = Muon([p], lr=0.1, backend="svd", shape_scale="none", momentum_form=form)
    for step in range(4):
        m = 0.85 + 0.1 * step / 3
        g = torch.randn(24, 16, generator=gen, dtype=torch.float64)
        p.grad, opt.param_groups[0]["momentum"] = g.clone(), m
        buf = m * buf + g  # record: buf.mul_(m).add_(g); g = g.add(buf, alpha=m)
        u, _, vh = torch.linalg.svd(g + m * buf, full_matrices=False)
        ref -= 0.1 * (u @ vh)
        opt.step()
    return p.detach(), ref


def test_sgd_momentum_form_matches_the_records_under_momentum_warmup():
    got, ref = _muon_under_warmup("sgd")
    torch.testing.assert_close(got, ref, atol=1e-10, rtol=1e-10)
    ema, _ = _muon_under_warmup("ema")  # the EMA form points elsewhere while the momentum changes
    assert (ema - ref).abs().max() > 1e-4


def test_seed_optimizer_is_orthogonal_nesterov_on_the_whole_fused_qkv():
    """cd06e200: buf = m·buf + g; update NS5(g + m·buf) of the unsplit (3d, d) matrix; p −= lr·update."""
    cfg = load_recipe("seed-2024-10")
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(96, 32, generator=gen))
    o = cfg.optim
    tiny = dataclasses.replace(cfg.model, n_layer=1, n_head=2, n_embd=32, vocab_size=64)
    model = build_model(tiny)
    build_optimizer(model, dataclasses.replace(cfg, model=tiny))
    assert muon_split(model.blocks[0].attn.c_attn.weight) == 1  # the builder keeps the fused QKV whole
    muon = Muon(
        [p], lr=o.muon_lr, shape_scale=o.muon_shape_scale, momentum_form=o.muon_momentum_form,
        ns_form=o.muon_ns_form, scale_in_update_dtype=o.muon_scale_in_bf16,
        ns_dtype=torch.bfloat16,  # the record's bf16 iterations ("auto": fp32 without fast bf16, AVX2)
    )  # fmt: skip
    ref, buf = p.detach().clone(), torch.zeros_like(p)
    for _ in range(3):
        g = torch.randn(96, 32, generator=gen)
        p.grad = g.clone()
        buf = buf * 0.95 + g
        ref -= cfg.optim.muon_lr * _record_ns(g + 0.95 * buf, "2024-10-10").float()
        muon.step()
    torch.testing.assert_close(p.detach(), ref, atol=1e-6, rtol=1e-5)


# ---------------------------------------------------------------- Sub3Min FP8 head


def _dequantized_reference(x, w, grad):
    """fp64 products of exactly the fp8 values the record feeds to _scaled_mm."""
    xs, ws, gs = fp8.X_SCALE, fp8.W_SCALE, fp8.GRAD_SCALE * x.size(0) / fp8.RECORD_TOKENS
    xq = (x * xs).to(torch.float8_e4m3fn).double() / xs
    wq = (w * ws).to(torch.float8_e4m3fn).double() / ws
    gq = (grad * gs).to(torch.float8_e5m2).double() / gs
    return xq @ wq.T, gq @ wq, gq.T @ xq


@pytest.mark.parametrize("on_cpu_scaled_mm", [False, True])
def test_fp8_head_forward_and_backward_against_fp64(on_cpu_scaled_mm, monkeypatch):
    monkeypatch.setattr(fp8, "SCALED_MM_ON_CPU", on_cpu_scaled_mm)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 32, generator=gen)).bfloat16().requires_grad_()
    w = (torch.randn(48, 32, generator=gen) * 0.05).requires_grad_()
    out = fp8.fp8_linear(x, w)
    grad = (torch.randn(64, 48, generator=gen) * 1e-4).bfloat16()
    out.backward(grad)
    want_out, want_gx, want_gw = _dequantized_reference(x.detach(), w.detach(), grad)
    assert out.dtype == x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    torch.testing.assert_close(out.double(), want_out, atol=0, rtol=2**-8)  # one bf16 rounding
    torch.testing.assert_close(x.grad.double(), want_gx, atol=0, rtol=2**-8)
    torch.testing.assert_close(w.grad.double(), want_gw, atol=1e-12, rtol=1e-5)
    exact = x.detach().float() @ w.detach().T  # and FP8 really quantizes: a few % from the exact product
    assert 1e-3 < (out.float() - exact).abs().max() / exact.abs().max() < 0.1


def test_fp8_head_is_used_for_training_only():
    torch.manual_seed(0)
    model = build_model(tiny(fp8_head=True, tie_embeddings=False, embed_dtype="bf16", pad_embeddings=False))
    torch.nn.init.normal_(model.lm_head.weight, std=0.05)
    x = torch.randint(0, 128, (1, 64))
    with torch.no_grad():
        logits = model(x)  # no grad: bf16 head
    train_loss = model(x, x)
    model.eval()
    with torch.no_grad():
        eval_loss = model(x, x)
    assert train_loss.item() != eval_loss.item()
    assert math.isfinite(train_loss.item()) and logits.dtype == torch.float32


# ---------------------------------------------------------------- SDPA kernel


def test_sdpa_kernel_choice_reaches_the_attention_call(monkeypatch):
    from torch.nn.attention import SDPBackend

    seen = []

    def recorder(backends):
        seen.append(backends)
        return torch.nn.attention.sdpa_kernel([SDPBackend.MATH])  # what this CPU can run

    monkeypatch.setattr(attention, "sdpa_kernel", recorder)
    monkeypatch.setattr(attention, "_on_cuda", lambda t: True)
    x = torch.randint(0, 128, (1, 32))
    build_model(tiny(sdpa_kernel="cudnn"))(x)
    assert seen == [[SDPBackend.CUDNN_ATTENTION]] * 4
    seen.clear()
    build_model(tiny())(x)
    assert seen == []
    monkeypatch.setattr(attention, "_on_cuda", lambda t: False)  # CPU: never forced
    build_model(tiny(sdpa_kernel="cudnn"))(x)
    assert seen == []
    assert load_recipe("untied-2024-11").model.sdpa_kernel == "cudnn"  # 11-03: cuDNN only


def test_distributed_muon_scales_the_bf16_update_in_bf16():
    """10-17 … 12-04: `g = NS(g); g *= scale` on the bf16 update, then `p.add_(g.float(), alpha=-lr)`."""
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(48, 96, generator=gen))
    g = torch.randn(48, 96, generator=gen)
    start = p.detach().clone()
    opt = Muon(  # the record's bf16 iterations, pinned: "auto" takes fp32 on a CPU without fast bf16 (AVX2)
        [p], lr=0.01, shape_scale="max_dim", momentum=0.0, nesterov=False, scale_in_update_dtype=True,
        ns_dtype=torch.bfloat16,
    )  # fmt: skip
    p.grad = g.clone()
    opt.step()
    update = newton_schulz(g) * math.sqrt(96)  # bf16 × float → rounded to bf16, as the record
    assert update.dtype == torch.bfloat16
    torch.testing.assert_close(p.detach(), start.add(update.float(), alpha=-0.01), atol=0, rtol=0)
    fp32_scaled = start.add(newton_schulz(g).float(), alpha=-0.01 * math.sqrt(96))
    assert not torch.equal(p.detach(), fp32_scaled)


def _sub3min_blocks(docs: torch.Tensor, sw: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sub3Min's hand-built lists: partial and full kv blocks per query block, each list ordered most
    recent first and cut to min(n, max(sw − n_full, 1)) partial and min(n_full, sw − 1) full blocks."""
    low, high = docs.view(-1, 128)[:, 0], docs.view(-1, 128)[:, -1]
    n = low.numel()
    q, kv = torch.arange(n)[:, None], torch.arange(n)[None, :]
    nonzero = (q >= kv) & (low[:, None] <= high) & (low <= high[:, None])
    full = (q > kv) & (low[:, None] == high) & (low == high[:, None])
    partial = nonzero & ~full
    n_full = full.sum(-1)
    keep_partial = torch.clamp_max(partial.sum(-1), torch.clamp_min(sw - n_full, 1))
    keep_full = torch.clamp_max(n_full, sw - 1)

    def first(mask: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        rank = mask.flip(-1).cumsum(-1).flip(-1)  # 1 for the most recent listed block, 2 next, ...
        return mask & (rank <= count[:, None])

    return first(partial, keep_partial), first(full, keep_full)


@pytest.mark.parametrize("sw", [1, 2, 3, 5, 14])
def test_sub3min_block_window_lists_the_same_blocks(sw):
    """Sub3Min keeps the N most recent listed blocks; we keep q_block − kv_block < N: equal everywhere."""
    gen = torch.Generator().manual_seed(sw)
    for rate in (0.004, 0.0005):  # documents of ~2 blocks, and of ~16 (the window binds)
        docs = (torch.rand(128 * 24, generator=gen) < rate).cumsum(0).to(torch.int32)
        want_partial, want_full = _sub3min_blocks(docs, sw)
        spec = attention.MaskSpec(docs[None], torch.tensor(sw * 128), block_window=True)
        partial, full = attention.block_structure(spec, docs.numel())
        assert torch.equal(partial[0], want_partial) and torch.equal(full[0], want_full)


# ---------------------------------------------------------------- audit 2: softcap op and autocast


def test_softcaps_divide_as_the_records_do():
    """Bit-equal to the records' expressions (the old z·(2/15) differed in ~27% of fp32 logits)."""
    z = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 20
    # records/track_1_short/2025-01-16_Sub3Min/1d3bd93b-...txt: `30 * torch.sigmoid(logits.float() / 7.5)`
    assert torch.equal(softcap(z, 15.0, "sigmoid"), 30 * torch.sigmoid(z / 7.5))
    # records/track_1_short/2024-11-06_ShortcutsTweaks/dd7304a6-...txt: `30 * torch.tanh(logits / 30)`
    assert torch.equal(softcap(z, 30.0, "tanh"), 30 * torch.tanh(z / 30))


#: The records from 2024-11-08 (CastBf16) on dropped the autocast context: `model.cuda().bfloat16()`,
#: CastedLinear weights back to fp32, and no `torch.amp.autocast` anywhere in the script
#: (records/track_1_short/2024-11-08_CastBf16/a833bed8-...txt, the `ctx = torch.amp.autocast(...)`
#: line of 11-06 is gone; the same for 11-10 … 12-08; Sub3Min casts only the embeddings to bf16).
NO_AUTOCAST_RECIPES = (
    "unet-2024-11",
    "flex-2024-11-19",
    "flex-2024-11",
    "value-embed-2024-12",
    "unet-value-embed-2024-12",
    "record-2025-01",
)


@pytest.mark.parametrize("name", NO_AUTOCAST_RECIPES)
def test_bf16_records_run_without_autocast_so_the_residual_stream_stays_bf16(name):
    """Under CUDA autocast F.rms_norm is on the fp32 list (torch 2.13 registers an AutocastCUDA kernel for
    aten::rms_norm; not the CPU), so a bf16 embedding comes out
    of the embedding norm as fp32 and the whole residual stream turns fp32; the records kept it bf16.
    Without autocast our model reproduces the records' dtypes layer by layer."""
    cfg = load_recipe(name)
    assert autocast_dtype(cfg) is None
    small = dict(n_layer=4, n_embd=64, n_head=2, vocab_size=128, max_seq_len=256, window=256)
    small.update(value_embed_tables=1, no_attention_layers="", window_pattern="", fp8_head=False)
    model = build_model(ModelConfig(**{**cfg.model.__dict__, **small, "attention": "sdpa"}))
    seen = []
    for block in model.blocks:
        block.register_forward_hook(lambda mod, args, out: seen.append(out[0].dtype))
    logits = model(torch.randint(0, 128, (1, 256)))
    assert seen == [torch.bfloat16] * 4 and logits.dtype == torch.float32


@pytest.mark.parametrize("name", ["muon-2024-10", "modern-2024-10", "untied-2024-11", "shortcuts-2024-11"])
def test_records_before_11_08_train_under_bf16_autocast(name):
    """10-10 … 11-06 wrap the forward in `torch.amp.autocast(device_type='cuda', dtype=torch.bfloat16)`."""
    assert autocast_dtype(load_recipe(name)) == torch.bfloat16


def test_gpt2_baseline_softmax_leaves_the_padded_head_rows_out():
    """llm.c's fused classifier takes the softmax over V = 50,257 of the P = 50,304 head rows
    (`prepare_softmax_blockwide3(idx, logits, V, P)` in karpathy/llm.c train_gpt2.cu); the padded
    rows get neither probability mass nor gradient."""
    assert load_recipe("gpt2-baseline").model.logits_vocab_only
    torch.manual_seed(0)
    base = dict(vocab_size=100, pad_vocab_to=128, n_layer=1, n_head=2, n_embd=32, max_seq_len=16)
    model = build_model(ModelConfig(**base, logits_vocab_only=True))
    x = torch.randint(0, 100, (2, 16))
    full = model.lm_head(model.hidden(x)).float()  # all 128 head rows
    assert full.size(-1) == 128 and model(x).size(-1) == 100
    want = F.cross_entropy(full[..., :100].reshape(-1, 100), x.reshape(-1))
    torch.testing.assert_close(model(x, x), want)
    model(x, x).backward()
    assert model.lm_head.weight.grad[100:].abs().max() == 0
