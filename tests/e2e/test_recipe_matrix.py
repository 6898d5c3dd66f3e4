"""Every bundled recipe, shrunk but with its switches: trains on 2 gloo processes exactly like on one,
and its model compiles with fullgraph on the path CUDA takes (FlexAttention) with the eager losses (a
cover of the recipes: every model setting value and attention layout of every recipe, compiled once).

The worker is tests/recipe_matrix.py; the suite's one torchrun launch (tests/two_processes.py) runs all
recipes after its CLI jobs (tests/library_checks.py; start-up paid once).
"""

from __future__ import annotations

import pytest
import torch

from speedrun.config.families import model_facts
from speedrun.model import attention
from speedrun.optim.table_rows import table_part
from speedrun.recipes import recipe_names
from tests.recipe_cover import recipe_cover
from tests.recipe_matrix import batch, build, compile_config, flex_overrides, rows, shrunk, train_losses
from tests.two_processes import SHARED

RECIPES = recipe_names()


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_parameter_gets_a_gradient(recipe):
    """DDP stops a run at its second step when a parameter never receives a gradient."""
    cfg = shrunk(recipe)
    model, _ = build(cfg)
    x, y = batch(0, cfg)
    model(*rows(cfg, x[:1], y[:1])).backward()
    assert [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None] == []
    table = table_part(model)  # #92's sharded table: no parameter; its gradient lands on the pulled rows
    assert table is None or table.pulled.cache.grad is not None


@pytest.mark.slow
@SHARED
def test_two_gloo_processes_train_every_recipe_like_one_process(library_results):
    two_process_losses = library_results["recipes"]
    assert sorted(two_process_losses) == RECIPES
    for recipe in RECIPES:
        two = two_process_losses[recipe]
        assert isinstance(two, list), f"{recipe} under torchrun: {two}"
        # fp32 (bf16 where the recipe stores parameters in bf16): DDP's (g1 + g2)/2 against
        # accumulated g1/2 + g2/2 agree to rounding (measured: identical)
        assert two == pytest.approx(train_losses(recipe), rel=1e-5, abs=0), recipe


@pytest.mark.slow
@pytest.mark.parametrize("recipe", recipe_cover(compile_config))
def test_model_compiles_fullgraph_on_the_cuda_path_and_matches_eager_dense(recipe, monkeypatch):
    """torch.compile(fullgraph=True) fails on any graph break. attention=flex takes FlexAttention where
    CUDA would (aot_eager trains through its reference implementation); eager runs dense SDPA. A forced
    SDPA kernel is entered as on CUDA (with the math kernel this CPU has), so its context is traced too.
    Each graph costs seconds to trace: the recipes are a cover (tests/recipe_cover.py) that uses every
    model setting and attention layout of every recipe, not one recipe per distinct model."""
    torch._dynamo.reset()  # every recipe's GPT.forward is the same code object
    cfg = compile_config(recipe)
    if getattr(cfg.model, "sdpa_kernel", "auto") != "auto":  # a gpt2024 switch
        math_only = [torch.nn.attention.SDPBackend.MATH]
        monkeypatch.setattr(attention, "_on_cuda", lambda t: True)
        monkeypatch.setattr(attention, "sdpa_kernel", lambda _: torch.nn.attention.sdpa_kernel(math_only))
    model, optimizer = build(cfg)
    sdpa = [o.replace("=flex", "=sdpa") for o in flex_overrides(recipe)]
    ref, _ = build(shrunk(recipe, *sdpa, n_layer=2))
    ref.load_state_dict(model.state_dict())
    x, y = batch(0, cfg)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    optimizer.feed(compiled)  # as the loop: #92's table rows are pulled outside the graph
    loss, want = compiled(x, y), ref(x, y)
    loss.backward()
    want.backward()
    bf16 = model_facts(cfg.model).bf16_model  # bf16 parameters: the two paths round differently
    torch.testing.assert_close(loss, want, rtol=1e-2 if bf16 else 1e-5, atol=0)
    if table_part(model) is not None:  # the sharded table's gradient: on the rows pulled for the call
        got, ref_rows = table_part(model).pulled.cache.grad, table_part(ref).pulled.cache.grad
        torch.testing.assert_close(got.float(), ref_rows.float(), rtol=1e-3, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        if not p.requires_grad:
            continue
        tol = dict(rtol=5e-2, atol=1e-3) if bf16 or p.dtype == torch.bfloat16 else dict(rtol=1e-3, atol=1e-5)
        torch.testing.assert_close(p.grad.float(), q.grad.float(), **tol, msg=f"{recipe}: {name}")
