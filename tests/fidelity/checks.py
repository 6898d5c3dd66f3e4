"""What every whole-model fidelity test shares: its inputs (a two-document row, jittered weights) and its
last check, our loss and every gradient against the record's on the same weights."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def assert_loss_and_gradients_are_the_records(
    model: torch.nn.Module, loss: Tensor, ref: Tensor, weights: dict[str, Tensor], T: int, training: bool
) -> None:
    """In training the record's summed loss over T tokens is our step's mean; at evaluation both are means.
    The loss to 1e-6 relative; every gradient to rtol 1e-4, atol 1e-6, named by its parameter."""
    ref = ref / T if training else ref
    assert math.isclose(loss.item(), ref.item(), rel_tol=1e-6), (loss.item(), ref.item())
    if not training:
        return
    loss.backward()
    ref.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, weights[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def two_documents(vocab: int, T: int = 1024, slots: int = 128) -> tuple[Tensor, Tensor, Tensor]:
    """The whole-model tests' row: T random tokens (seed 1) holding a 1,000-token document that both windows
    cut, then a short one; inputs, targets and cu_seqlens padded to `slots` entries as records pad."""
    gen = torch.Generator().manual_seed(1)
    seq = torch.randint(0, vocab - 1, (T + 1,), generator=gen)
    seq[[0, 1000]] = vocab - 1
    cu = torch.full((slots,), T, dtype=torch.int32)
    cu[:2] = torch.tensor([0, 1000])
    return seq[:-1], seq[1:], cu


@torch.no_grad()
def jitter_(
    model: torch.nn.Module, matrix_std: float, vector_std: float = 0.3, gates_and_bigram: bool = False
) -> torch.nn.Module:
    """Add N(0, std²) noise (from the global generator) to every parameter: the records zero-init
    projections, gates and heads, where a zero would hide a wrong gradient. With `gates_and_bigram` (the
    banked 2026 models), each value-embedding and skip gate is then drawn N(0, 1) (gates far from 1) and
    the bigram table N(0, 0.5²) (rows of the token embedding's size), parameter by parameter."""
    for n, p in model.named_parameters():
        p.add_(torch.randn_like(p) * (matrix_std if p.ndim > 1 else vector_std))
        if gates_and_bigram and ("ve_gate" in n or "skip_gate" in n):
            p.copy_(torch.randn_like(p))
        if gates_and_bigram and n == "bigram.embed.weight":
            p.normal_(std=0.5)
    return model


def fp32_model(recipe: str, overrides=(), *, seed: int | None = 0, **fields) -> tuple:
    """The recipe (with `overrides`) at the test's size in fp32 storage, its end-of-text id the last token of
    the vocabulary; built after torch.manual_seed(seed) unless seed is None. `fields`: n_head, n_embd,
    vocab_size, max_seq_len and any other model field. Returns (cfg, model)."""
    from speedrun.model.families import build_model
    from speedrun.recipes import load_recipe
    from tests.recipe_matrix import replace

    cfg = load_recipe(recipe, list(overrides))
    cfg.model = replace(
        cfg.model, embed_dtype="fp32", fp8_head=False, eot_id=fields["vocab_size"] - 1, **fields
    )
    if seed is not None:
        torch.manual_seed(seed)
    return cfg, build_model(cfg.model)


def shrunk_with_optimizer(recipe: str, extra=()) -> tuple:
    """The recipe shrunk as the recipe matrix shrinks it (then `extra`), its model built after
    torch.manual_seed(0) and the run's optimizer over it: (cfg, model, optimizer, parameters by name)."""
    from speedrun.model.families import build_model
    from speedrun.optim.build import build_optimizer
    from speedrun.recipes import load_recipe
    from tests.recipe_matrix import shrink

    cfg = load_recipe(recipe, [*shrink(recipe), *extra])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    return cfg, model, build_optimizer(model, cfg), dict(model.named_parameters())


def short_documents(vocab: int = 100, T: int = 64) -> tuple[Tensor, Tensor]:
    """The part tests' batch: one row of T random tokens (seed 1) cut into documents at 0, 20 and 41, and
    random targets."""
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, vocab - 1, (1, T), generator=g)
    idx[0, [0, 20, 41]] = vocab - 1
    return idx, torch.randint(0, vocab - 1, (1, T), generator=g)
