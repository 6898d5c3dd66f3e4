"""The CUDA branch of the speed layer, traced on the CPU (run by tests/perf_interpreted.py under Triton's
interpreter; compared in tests/unit/test_perf_kernels.py): `swaps.install` asked as if on CUDA installs every
kernel, then record-2026-07's training step (shrunk; MTP weights 1, 0.5, 0.25; no FP8) and Polar Express (the
Muon step's orthogonalization, wide and tall) are compiled with fullgraph=True, as CUDA compiles them: a
graph break, or an import or a registry choice inside the graph, fails here instead of on a GPU lease.
`plain()` is the same with every op plain, eager.

The same model with #92's parts added (`setup_anvil`: the n-gram table, #88's prefix loss, the sampled
softmax over 192 of 512 classes) is compiled the same way for a full-softmax step and a sampled step, so the
n-gram gather and sink and the CE's prefix and sampled arms are traced in one graph each where a step uses
them."""

from __future__ import annotations

import torch

RECIPE = "record-2026-07"
MTP = (1.0, 0.5, 0.25)


def _overrides() -> list[str]:
    """The shrunk record's settings for these traces (fp32 twin, no FP8)."""
    over = [
        "model.max_seq_len=128",
        "train.seq_len=128",
        "train.micro_batch_tokens=128",
        "train.global_batch_tokens=512",
        "model.embed_dtype=fp32",
    ]
    # the twin in fp32, as the kernel computes; no FP8 head, whose e5m2 gradient (2 mantissa bits) turns
    # a last-bit difference of the logits' gradient into a 12 % one of the weights'
    over += ["model.head.softcap_in_bf16=false", "model.head.ce_bf16=false", "model.head.fp8=false"]
    over += ["model.mlp.fp8=false"]  # the bf16 MLP, whose up-projection the fused ReLU² kernel replaces
    return over


def setup():
    """(model, idx, targets, matrices) from fixed seeds."""
    from speedrun.model.families import build_model
    from speedrun.model.gpt2026 import head
    from speedrun.recipes import load_recipe
    from speedrun.train.schedule import apply_to_model, schedule_at
    from tests.recipe_matrix import shrink

    cfg = load_recipe(RECIPE, [*shrink(RECIPE), *_overrides()])
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    apply_to_model(schedule_at(0, cfg), model)
    head.write_weights(model.mtp_weights, MTP)
    g = torch.Generator().manual_seed(2)
    idx = torch.randint(0, cfg.model.eot_id, (1, 128), generator=g)
    targets = torch.roll(idx, -1, 1)
    matrices = [torch.randn(2, 40, 72, generator=g), torch.randn(72, 40, generator=g)]
    return model, idx, targets, matrices


ANVIL = [  # #92's parts on the shrunk record: the n-gram table instead of #62's bigram rows, #88's prefix
    "model.ngram.rows=256", "model.ngram.sign_rows=8", "model.ngram.dtype=fp32", "model.ngram.dim=16",
    "model.embed.bigram_rows=0", "model.embed.bigram_sign_rows=0", "model.embed.bigram_dim=0",
    "model.embed.bigram_in_x0=false", "model.head.prefix_loss_weight=0.25",
]  # fmt: skip
SAMPLED = 192  # candidates of the sampled step (of 512 classes)


def setup_anvil():
    """(model, idx, targets) with #92's n-gram table (drawn, not zero: its forward is then seen), #88's
    prefix table and #92's sweep (stride 7, coprime with 512; P is set per step)."""
    from speedrun.model.families import build_model
    from speedrun.model.gpt2026 import head, sampled
    from speedrun.recipes import load_recipe
    from speedrun.train.schedule import apply_to_model, schedule_at
    from tests.recipe_matrix import shrink

    _, idx, targets, _ = setup()
    cfg = load_recipe(RECIPE, [*shrink(RECIPE), *_overrides(), *ANVIL])
    torch.manual_seed(0)
    model = build_model(cfg.model).train()
    apply_to_model(schedule_at(0, cfg), model)
    head.write_weights(model.mtp_weights, MTP)
    with torch.no_grad():
        model.bigram.table.copy_(
            torch.randn(model.bigram.table.shape, generator=torch.Generator().manual_seed(3))
        )
    assert type(model.bigram).__name__ == "NgramEmbed", "the n-gram table is not the bigram input"
    del model.sampled_sweep
    model.register_buffer("sampled_sweep", sampled.sweep(model.lm_head.weight.size(0), 7), persistent=False)
    model.register_buffer("sampled_start", torch.tensor(5), persistent=False)
    return model, idx, targets


def _anvil_steps(model, forwards, idx, targets) -> dict:
    """A full-softmax step (prefix arm) then a sampled one, each through its own forward."""
    out = {}
    for name, count in (("full", 0), ("sampled", SAMPLED)):
        model.zero_grad(set_to_none=True)
        model.sampled_candidates = count
        loss = forwards[name](idx, targets)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out[name] = {"loss": loss.detach(), "grads": grads}
    return out


def _step(model, forward, idx, targets, matrices, polar) -> dict:
    loss = forward(idx, targets)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach(), "grads": grads, "ortho": [polar(m) for m in matrices]}


def _polar(m: torch.Tensor) -> torch.Tensor:
    from speedrun.optim.orthogonalize import polar_express

    return polar_express(m, steps=2, dtype=torch.float32)


def plain() -> dict:
    from speedrun import ops

    ops.reset()
    model, idx, targets, matrices = setup()
    out = _step(model, model, idx, targets, matrices, _polar)
    anvil, idx, targets = setup_anvil()
    return {**out, "anvil": _anvil_steps(anvil, {"full": anvil, "sampled": anvil}, idx, targets)}


def traced() -> dict:
    from speedrun.perf import swaps

    swaps.on_cuda = lambda device: True  # the selection asked as on a GPU (this child process only)
    installed = swaps.install("auto", torch.device("cpu"))
    seen: list[str] = []
    eager = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):  # the ops each graph calls, then aot_eager as the GPU tests do
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return eager(gm, example_inputs)

    model, idx, targets, matrices = setup()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
    polar = torch.compile(_polar, backend=backend, fullgraph=True, dynamic=False)
    out = _step(model, compiled, idx, targets, matrices, polar)
    out |= {"installed": list(installed), "seen": sorted(set(seen))}
    anvil, idx, targets = setup_anvil()
    forwards, seen_by = {}, {}
    for name in ("full", "sampled"):  # one compiled forward each, with the ops its graphs call
        seen_by[name] = []

        def backend_of(gm, example_inputs, calls=seen_by[name]):
            calls.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return eager(gm, example_inputs)

        forwards[name] = torch.compile(anvil, backend=backend_of, fullgraph=True, dynamic=False)
    out["anvil"] = _anvil_steps(anvil, forwards, idx, targets)
    out["anvil_seen"] = {k: sorted(set(v)) for k, v in seen_by.items()}
    return out
