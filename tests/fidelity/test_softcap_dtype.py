"""The 2024-11-06 … 12-08 records cap the logits in bf16 and cast afterwards; the others cast first.

records/track_1_short/2024-11-06_ShortcutsTweaks/dd7304a6-...txt (under bf16 autocast) and 11-10, 11-19,
11-24, 12-04, 12-08 (bf16 model): `logits = self.lm_head(x)` (bf16), `logits = 30 * torch.tanh(logits / 30)`,
`logits = logits.float()`. Sub3Min: `30 * torch.sigmoid(logits.float() / 7.5)`. #32 on (polar-2025-09):
`30 * torch.sigmoid(logits / 7.5)` on the bf16 head output, cast afterwards (not at all for the training
loss, #37: tests/fidelity/test_polar_recipe.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from speedrun.config import ModelConfig
from speedrun.config.families import model_facts
from speedrun.model.families import build_model
from speedrun.model.gpt2024.model import GPT
from speedrun.recipes import load_recipe, recipe_names
from tests.recipe_matrix import replace

BF16_SOFTCAP_RECIPES = (
    "shortcuts-2024-11",
    "unet-2024-11",
    "flex-2024-11-19",
    "flex-2024-11",
    "value-embed-2024-12",
    "unet-value-embed-2024-12",
    "polar-2025-09",
    "normuon-2025-10",
    "stages-2025-12",
    "banks-2026-01",  # #65 evaluates 23 * sigmoid((logits + 5) / 7.5) on the bf16 logits
    "xsa-2026-04",  # #82's eval lines are #65's
    "record-2026-07",  # and #89's
    "qk96-2026-08",  # and #344's
    # #350 casts first where it masks (validation): fidelity/test_qk96_canonical_recipes.py
    "canonical-2026-08",
    "anvil-2026-08",  # #92 caps the bf16 logits, masked or not (model.head.mask_cap = "bf16")
    "medium-2025-12",  # track 2's #18 is the 2025-12 short-track script scaled up: #53's bf16 cap
)


def _head_only(name: str) -> GPT:
    m = load_recipe(name).model
    if m.family == "gpt2026":  # the recipe's head on one plain layer
        cfg = replace(
            m, vocab_size=512, n_layer=1, n_head=2, n_embd=64, max_seq_len=64, attention_layers=[0],
            mlp_layers=[0], windows=[], value_embeds=[], skips=[], key_offset_layers=[], paired_layers=[],
            backout_layer=0, fp8_head=False, embed_dtype="fp32", attention="varlen", window=0,
            window_warmup="none", yarn=False, mtp=0, xsa_layers=[], attn_inputs=[], bigram_rows=0,
            bigram_sign_rows=0, bigram_dim=0, bigram_in_x0=False, ngram=replace(m.ngram, rows=0),
        )  # fmt: skip
    else:
        cfg = ModelConfig(
            vocab_size=512, n_layer=1, n_head=2, n_embd=64, max_seq_len=64, positional="rotary",
            norm="rmsnorm", activation="relu2", bias=False, fused_qkv=False, init="torch",
            logit_softcap=m.logit_softcap, softcap_form=m.softcap_form,
            softcap_in_bf16=m.softcap_in_bf16, logits_vocab_only=m.logits_vocab_only,
        )  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    torch.nn.init.normal_(model.lm_head.weight, std=1.0)  # logits of a few tens: the cap binds
    return model


def _head(cfg):
    """Where a model config keeps its head's settings: gpt2026's [model.head], gpt2024's flat fields."""
    return getattr(cfg, "head", cfg)


def _record_loss(model: GPT, h: torch.Tensor, targets: torch.Tensor, cap_first: bool):
    """The records' lines, written out: bf16 head output, then cap and cast in the record's order."""
    h = h.detach().requires_grad_(True)
    logits = F.linear(h, model.lm_head.weight.to(torch.bfloat16))
    cfg = model.cfg
    cap = model_facts(cfg).logit_softcap
    form = getattr(cfg, "softcap_form", "sigmoid")  # gpt2026's head has #32's sigmoid form only
    if cap_first and getattr(
        _head(cfg), "softcap_offset", 0
    ):  # #54/#65: 23 * torch.sigmoid((logits + 5) / 7.5), bf16
        logits = (
            2 * cap * torch.sigmoid((logits + _head(cfg).softcap_offset) / _head(cfg).softcap_divisor)
        ).float()
    elif cap_first and form == "sigmoid":  # #32 on: 30 * torch.sigmoid(logits / 7.5), bf16
        logits = (2 * cap * torch.sigmoid(logits / (cap / 2))).float()
    elif cap_first:
        logits = (cap * torch.tanh(logits / cap)).float()
    elif form == "algebraic":  # track 3: 15 * logits * (logits.square() + 15**2).rsqrt()
        logits = logits.float()
        logits = cap * logits * (logits.square() + cap**2).rsqrt()
    elif form == "sigmoid":  # Sub3Min: 30 * sigmoid(z.float() / 7.5); demo-2026: #65's offset
        divisor = getattr(_head(cfg), "softcap_divisor", 0) or cap / 2
        offset = getattr(_head(cfg), "softcap_offset", 0)
        logits = 2 * cap * torch.sigmoid((logits.float() + offset) / divisor)
    else:
        logits = logits.float()
        logits = cap * torch.tanh(logits / cap)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
    loss.backward()
    return loss.detach(), h.grad


def _ours(model: GPT, h: torch.Tensor, targets: torch.Tensor):
    h = h.detach().requires_grad_(True)
    logits = model.logits(h)
    assert logits.dtype == torch.float32
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
    loss.backward()
    return loss.detach(), h.grad


CAPPED = [r for r in recipe_names() if model_facts(load_recipe(r).model).logit_softcap > 0]


@pytest.mark.parametrize("name", CAPPED)
def test_softcap_is_applied_in_the_dtype_each_record_uses(name):
    model = _head_only(name)
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(2, 32, 64, generator=gen).to(torch.bfloat16)
    targets = torch.randint(0, 512, (2, 32), generator=gen)
    cap_first = name in BF16_SOFTCAP_RECIPES
    want_loss, want_grad = _record_loss(model, h, targets, cap_first)
    loss, grad = _ours(model, h, targets)
    assert torch.equal(loss, want_loss)
    assert torch.equal(grad, want_grad)
    if getattr(model.cfg, "softcap_form", "sigmoid") == "tanh":  # the two orders differ: the check can fail
        other_loss, other_grad = _record_loss(model, h, targets, not cap_first)
        assert not torch.equal(other_loss, loss) or not torch.equal(other_grad, grad)


def test_only_the_11_06_to_12_08_records_cap_in_bf16():
    for name in recipe_names():
        assert model_facts(load_recipe(name).model).softcap_in_bf16 == (name in BF16_SOFTCAP_RECIPES), name
