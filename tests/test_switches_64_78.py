"""The gpt2026 switches #64 and #70–#78 add, each against its record's own lines
(records/track_1_short/2026-01-30_MimeticValueOutput for #64's mimetic_vo_init)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from speedrun.errors import ConfigError
from speedrun.model.families import build_model
from speedrun.recipes import load_recipe

BASE = "banks-2026-01"


def record_64_mimetic_vo_init(attn_bank, model_dim, num_heads, head_dim, beta=0.05, noise_std=0.01):
    """#64's mimetic_vo_init on a (layers, 4·d, d) bank: Q/K uniform, V = √β·I_h per head, O = −√β·I_h,
    plus noise (#64 calls it with beta 0.05, noise_std 0.01)."""
    dim, sqrt_beta = model_dim, beta**0.5
    bound = 3**0.5 * model_dim**-0.5
    with torch.no_grad():
        attn_bank[:, : 2 * dim, :].uniform_(-bound, bound)
        for layer in range(attn_bank.shape[0]):
            w_v = torch.zeros(dim, dim)
            w_o = torch.zeros(dim, dim)
            for h in range(num_heads):
                s, e = h * head_dim, (h + 1) * head_dim
                w_v[s:e, s:e] = sqrt_beta * torch.eye(head_dim)
                w_o[s:e, s:e] = -sqrt_beta * torch.eye(head_dim)
            w_v += noise_std * torch.randn_like(w_v)
            w_o += noise_std * torch.randn_like(w_o)
            attn_bank[layer, 2 * dim : 3 * dim, :] = w_v
            attn_bank[layer, 3 * dim :, :] = w_o


def _small(cfg):
    return dataclasses.replace(cfg.model, n_head=4, n_embd=128, vocab_size=120, max_seq_len=256)


def test_mimetic_vo_init_is_64s():
    """Our V rows and output projection against #64's bank, layer by layer: the same deterministic part
    (the difference is two independent noises: std 0.01·√2, mean 0), Q/K as the bank's uniform law."""
    cfg = load_recipe(BASE, ["model.mimetic_vo_beta=0.05"])
    torch.manual_seed(0)
    model = build_model(_small(cfg))
    d, heads = 128, 4
    attn = [b.attn for b in model.blocks if b.attn is not None]
    bank = torch.empty(len(attn), 4 * d, d)
    record_64_mimetic_vo_init(bank, d, heads, d // heads)
    for a, rec in zip(attn, bank, strict=True):
        ours = torch.cat([a.c_attn.weight.detach(), a.c_proj.weight.detach()])
        diff = (ours - rec)[2 * d :]  # V and O
        assert abs(diff.std().item() / (0.01 * 2**0.5) - 1) < 0.05
        assert abs(diff.mean().item()) < 1e-3
        qk = ours[: 2 * d]
        assert abs(qk.std().item() / rec[: 2 * d].std().item() - 1) < 0.05
        assert qk.abs().max() <= 3**0.5 * d**-0.5
    off = build_model(_small(load_recipe(BASE)))  # #65: V uniform, O zero
    a = next(b.attn for b in off.blocks if b.attn is not None)
    assert a.c_proj.weight.abs().max() == 0 and abs(a.c_attn.weight[2 * d :].trace().item()) < 1.0


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["model.mimetic_vo_beta=-0.1"], "model.mimetic_vo_beta must be >= 0"),
        (["model.mimetic_vo_beta=2"], "model.mimetic_vo_beta (#64) must be 0..1"),
    ],
)
def test_a_bad_switch_is_one_config_error_naming_it(overrides, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_recipe(BASE, overrides)
