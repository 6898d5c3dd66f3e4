"""`track3-baseline` against track 3's record script, records/track_3_optimization/train_gpt_simple.py
(README result #36): the model's loss and every gradient, the init, the LR/momentum schedule at every
step and the optimizer's steps, each written here from the script's lines on identical tiny weights.
Each comparison also runs with one switch wired wrong and must then fail."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from speedrun.config import Config
from speedrun.model.gpt2024.model import GPT
from speedrun.optim.build import build_optimizer
from speedrun.recipes import load_recipe
from speedrun.train.schedule import apply_schedule, lr_multiplier, muon_momentum, schedule_at
from tests.fidelity.refs import newton_schulz

TOKENS = 2**19  # the script sums its loss over the step's 8·64·1024 tokens
SMALL = dict(vocab_size=128, pad_vocab_to=128, n_layer=2, n_head=2, n_embd=64, max_seq_len=64)


def small_cfg(embed_dtype: str = "fp32", **model) -> Config:
    cfg = load_recipe("track3-baseline")
    cfg.model = dataclasses.replace(cfg.model, **{**SMALL, "embed_dtype": embed_dtype, **model})
    cfg.optim.muon_ns_dtype = "bf16"  # the script's Newton-Schulz is bf16 on every device
    return cfg


# ---------------------------------------------------------------- the script's model, from its lines


def _rms(x, gains=None):
    return F.rms_norm(x, (x.size(-1),), weight=None if gains is None else gains.type_as(x))


def _rms46(x, gains=None):  # record #46's RMSNorm: (norm(x.float()) * self.gains).type_as(x)
    return x if gains is None else (F.rms_norm(x.float(), (x.size(-1),)) * gains).type_as(x)


def _lin(x, w, b):
    return F.linear(x, w.type_as(x), b.type_as(x))


def _rotary(x, head_dim):  # Rotary: half-truncated, base-frequency-tuned RoPE, in fp32
    freq = (1 / 1024) ** torch.linspace(0, 1, steps=head_dim // 4, dtype=torch.float32)
    freq = torch.cat([freq, freq.new_zeros(head_dim // 4)])
    theta = torch.outer(torch.arange(x.size(1), dtype=torch.float32), freq)[None, :, None, :]
    cos, sin = theta.cos(), theta.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos), 3).type_as(x)


def script_loss(w: dict[str, torch.Tensor], inputs, targets, n_layer: int, head_dim: int, rms=_rms):
    """GPT.forward of train_gpt_simple.py (#46: `rms=_rms46`): sum of the cross-entropy over the tokens."""
    x = rms(w["embed"][inputs], w["norm1"])
    B, T = inputs.shape
    for i in range(n_layer):
        b = {k.split(".", 1)[1]: v for k, v in w.items() if k.startswith(f"{i}.")}
        h = rms(x, b["n1"])
        q, k, v = (_lin(h, b[f"{n}.w"], b[f"{n}.b"]).view(B, T, -1, head_dim) for n in "qkv")
        q, k = _rotary(_rms(q), head_dim), _rotary(_rms(k), head_dim)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=0.12, is_causal=True
        )
        x = x + _lin(y.transpose(1, 2).contiguous().view(B, T, -1), b["proj.w"], b["proj.b"])
        h = _lin(rms(x, b["n2"]), b["fc.w"], b["fc.b"]).relu().square()
        x = x + _lin(h, b["mproj.w"], b["mproj.b"])
    logits = _lin(rms(x, w["norm2"]), w["head.w"], w["head.b"]).float()
    logits = 15 * logits * (logits.square() + 15**2).rsqrt()
    return F.cross_entropy(logits.view(targets.numel(), -1), targets.view(-1), reduction="sum")


def script_names(model: GPT) -> dict[str, str]:
    """Our parameter name → the reference's key (the script's modules, in short)."""
    names = {"wte.weight": "embed", "embed_norm.gains": "norm1", "norm_f.gains": "norm2"}
    names |= {"lm_head.weight": "head.w", "lm_head.bias": "head.b"}
    parts = {"norm1.gains": "n1", "norm2.gains": "n2", "mlp.c_fc": "fc", "mlp.c_proj": "mproj"}
    parts |= {"attn.c_q": "q", "attn.c_k": "k", "attn.c_v": "v", "attn.c_proj": "proj"}
    for i in range(len(model.blocks)):
        for ours, theirs in parts.items():
            if ours.endswith("gains"):
                names[f"blocks.{i}.{ours}"] = f"{i}.{theirs}"
            else:
                names[f"blocks.{i}.{ours}.weight"] = f"{i}.{theirs}.w"
                names[f"blocks.{i}.{ours}.bias"] = f"{i}.{theirs}.b"
    assert set(names) == {n for n, _ in model.named_parameters()}, "the script's parameters, no more"
    return names


def randomized(cfg: Config, seed: int = 0) -> GPT:
    """The recipe's model, shrunk, every parameter random (zero-init ones too, so all gradients flow)."""
    torch.manual_seed(seed)
    model = GPT(cfg.model)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p, dtype=torch.float32) * (0.3 if p.ndim == 2 else 0.1) + (p.ndim == 1))
    return model


# ---------------------------------------------------------------- forward and gradients


def _loss_and_grads(cfg: Config, rms=_rms):
    model = randomized(cfg)
    names = script_names(model)
    gen = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, 128, (2, 64), generator=gen)
    targets = torch.randint(0, 128, (2, 64), generator=gen)
    ref = {names[n]: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    want = script_loss(ref, inputs, targets, cfg.model.n_layer, cfg.model.n_embd // cfg.model.n_head, rms)
    want.backward()
    got = model(inputs, targets)  # mean over tokens
    got.backward()
    n = inputs.numel()
    grads = {n_: (p.grad, ref[names[n_]].grad / n) for n_, p in model.named_parameters()}
    return got, want / n, grads


def test_forward_loss_and_every_gradient_match_the_script():
    got, want, grads = _loss_and_grads(small_cfg())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, (ours, theirs) in grads.items():
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "wrong",
    [
        {"softcap_form": "tanh"},
        {"rope_half_truncated": False},
        {"attn_scale": 0.0},
        {"qk_norm": False},
        {"activation": "gelu"},
        {"embed_norm": False, "n_layer": 2},  # the mapping then lacks norm1: caught below
    ],
)
def test_a_switch_wired_wrong_is_caught(wrong):
    cfg = small_cfg(**wrong)
    try:
        got, want, _ = _loss_and_grads(cfg)
    except (AssertionError, KeyError):
        return  # the parameters no longer are the script's
    assert not torch.allclose(got, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- init


def test_init_is_the_scripts():
    """proj weights (the head included) and biases zero, gains 1, embedding normal(0, 1), the other
    weights normal with std sqrt(0.33)/sqrt(fan_in)."""
    cfg = small_cfg(n_embd=256, n_head=2)
    torch.manual_seed(0)
    model = GPT(cfg.model)
    for name, p in model.named_parameters():
        if name.endswith("bias") or "c_proj" in name or name.startswith("lm_head"):
            assert not p.any(), name
        elif name.endswith("gains"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name == "wte.weight":
            assert abs(p.float().std().item() - 1.0) < 0.02
        else:
            want = 0.33**0.5 / p.shape[1] ** 0.5
            assert abs(p.std().item() / want - 1) < 0.03, name
            assert abs(p.mean().item()) < 0.1 * want, name


# ---------------------------------------------------------------- schedule


def test_lr_and_momentum_at_every_step_are_the_scripts():
    cfg = load_recipe("track3-baseline")
    n = cfg.train.steps
    for step in range(n):
        progress = step / n
        eta = 1.0 if progress < 1 - 0.7 else (1 - progress) / 0.7  # set_hparams(step, cooldown_frac=0.7)
        assert lr_multiplier(step, cfg.train) == pytest.approx(eta, rel=1e-12, abs=1e-15), step
        assert muon_momentum(step, cfg.optim, n) == 0.95
    wrong = dataclasses.replace(cfg.train, warmdown_frac=0.4)
    assert any(abs(lr_multiplier(s, wrong) - lr_multiplier(s, cfg.train)) > 1e-3 for s in range(n))


# ---------------------------------------------------------------- optimizer


def script_steps(params: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]], etas: list[float]):
    """optimizer1 (AdamW) + optimizer2 (Muon) of the script, on summed gradients, one step per eta."""
    embed, head = params["embed"], params["head.w"]
    matrices = [p for k, p in params.items() if p.ndim == 2 and k not in ("embed", "head.w")]
    scalars = [p for p in params.values() if p.ndim < 2]
    groups = [dict(params=[embed], lr=0.7), dict(params=[head], lr=0.004), dict(params=scalars, lr=0.015)]
    adam = torch.optim.AdamW(groups, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.001)
    for g in adam.param_groups:
        g["initial_lr"] = g["lr"]
    momentum = {id(p): torch.zeros_like(p) for p in matrices}
    for grad, eta in zip(grads, etas, strict=True):
        for k, p in params.items():
            p.grad = grad[k].clone()
        for g in adam.param_groups:
            g["lr"] = g["initial_lr"] * eta
        adam.step()
        lr = 0.025 * eta
        for p in matrices:  # muon_update + Muon.step
            m = momentum[id(p)]
            m.lerp_(p.grad, 1 - 0.95)
            update = newton_schulz.track3_simple(p.grad.lerp_(m, 0.95))
            update *= max(1, p.grad.size(-2) / p.grad.size(-1)) ** 0.5
            p.mul_(1 - lr * 0.05)
            p.add_(update, alpha=-lr)


def _run_both(cfg: Config, steps: int = 3, total: int = 4):
    cfg.train.steps = total
    model = randomized(cfg)
    names = script_names(model)
    ref = {names[n]: p.detach().clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, cfg)
    gen = torch.Generator().manual_seed(2)
    grads, etas = [], []
    for step in range(steps):
        # the mean loss's gradients, entries from 1e-3 down to 1e-17 (big batches average to tiny ones):
        # where the script's eps meets them
        mean = {
            n: torch.randn(p.shape, generator=gen) * 10 ** -(3 + 14 * torch.rand(p.shape, generator=gen))
            for n, p in model.named_parameters()
        }
        values = schedule_at(step, cfg)
        apply_schedule(values, opt, model)
        for n, p in model.named_parameters():  # ours: the mean loss's gradient times train_step's grad_scale
            p.grad = (mean[n] * values.grad_scale).to(p.dtype)
        opt.step()
        grads.append({names[n]: g * TOKENS for n, g in mean.items()})  # the script's: the summed loss's
        progress = step / total
        etas.append(1.0 if progress < 0.3 else (1 - progress) / 0.7)
    with torch.no_grad():
        script_steps(ref, grads, etas)
    return model, names, ref


def _max_error(model, names, ref) -> dict[str, float]:
    return {n: (p.detach() - ref[names[n]]).abs().max().item() for n, p in model.named_parameters()}


def test_optimizer_steps_are_the_scripts():
    """Three steps (the third in the cooldown): every parameter to fp32 rounding (the bf16 Newton-Schulz
    runs the script's ops in its order, so on the CPU it matches bit for bit)."""
    model, names, ref = _run_both(small_cfg())
    for name, err in _max_error(model, names, ref).items():
        assert err <= 1e-6, (name, err)


@pytest.mark.parametrize(
    "wrong",
    [
        {"muon_ns_coefficients": (3.4445, -4.7750, 2.0315)},
        {"muon_ns_steps": 5},
        {"adam_weight_decay": 0.0},
        {"muon_weight_decay": 0.0},
        {"eps": 1e-10 / TOKENS},  # the script's eps on the mean loss's gradients (before summed_loss_ranks)
        {"betas": (0.9, 0.95)},
        {"scalar_lr": 0.02},
        {"summed_loss_ranks": 0},  # our mean loss's gradients: the eps meet gradients 2**19 smaller
    ],
)
def test_an_optimizer_switch_wired_wrong_is_caught(wrong):
    cfg = small_cfg()
    train = {k: v for k, v in wrong.items() if hasattr(cfg.train, k)}
    cfg.optim = dataclasses.replace(cfg.optim, **{k: v for k, v in wrong.items() if k not in train})
    cfg.train = dataclasses.replace(cfg.train, **train)
    model, names, ref = _run_both(cfg)
    assert max(_max_error(model, names, ref).values()) > 1e-6, wrong


def test_the_gradients_are_the_summed_loss_s_on_any_batch_split():
    """train.summed_loss_ranks = 1: the optimizer sees the gradient of the loss summed over the step's
    2**19 tokens (the script's all_reduce SUM of each rank's reduction="sum"), whatever the processes."""
    cfg = load_recipe("track3-2026-06")
    assert schedule_at(0, cfg).grad_scale == cfg.train.global_batch_tokens == TOKENS
    assert cfg.optim.eps == 1e-10  # the script's, on the gradient it meets there


# ---------------------------------------------------------------- record #46's model numerics and init


def _small_2026_06(**model) -> Config:
    cfg = load_recipe("track3-2026-06")
    cfg.model = dataclasses.replace(cfg.model, **{**SMALL, "embed_dtype": "fp32", **model})
    return cfg


@pytest.mark.parametrize("embed_dtype", ["fp32", "bf16"])
def test_2026_06_forward_and_gradients_match_record_46(embed_dtype):
    """#46's RMSNorm normalizes in fp32 and multiplies by the fp32 gains (bf16 activations: the two
    norms round differently, so the bf16 case tells them apart)."""
    cfg = _small_2026_06(embed_dtype=embed_dtype)
    got, want, grads = _loss_and_grads(cfg, _rms46)
    tol = dict(rtol=1e-5, atol=1e-6) if embed_dtype == "fp32" else dict(rtol=0, atol=0)
    torch.testing.assert_close(got, want, **tol)
    for name, (ours, theirs) in grads.items():
        torch.testing.assert_close(
            ours, theirs, rtol=1e-4 if embed_dtype == "fp32" else 1e-2, atol=1e-6, msg=name
        )
    if embed_dtype == "bf16":  # the baseline's bf16 norm is another computation
        assert not torch.equal(
            _loss_and_grads(_small_2026_06(embed_dtype="bf16", norm_fp32=False), _rms46)[0], want
        )


def test_2026_06_init_is_record_46s():
    """Every *proj* parameter zero (weights, biases, the head), torch's default init elsewhere (uniform
    with std 1/sqrt(3·fan_in), biases uniform), layer l's fc × (1 − 0.3·l/(L − 1))."""
    cfg = _small_2026_06(n_embd=256, n_layer=4)
    torch.manual_seed(0)
    model = GPT(cfg.model)
    params = dict(model.named_parameters())
    for name, p in params.items():
        if "c_proj" in name or name.startswith("lm_head"):
            assert not p.any(), name
    assert params["blocks.0.attn.c_q.bias"].abs().max() > 0  # biases keep torch's uniform init
    for i in range(4):
        w = params[f"blocks.{i}.mlp.c_fc.weight"]
        want = (1 - 0.3 * i / 3) / (3 * w.shape[1]) ** 0.5
        assert abs(w.std().item() / want - 1) < 0.03, i
