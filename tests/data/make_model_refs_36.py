"""Issue #36's bit-for-bit check of the model refactor (not run in CI).

For each gpt2026 recipe below, shrunk (tests/recipe_matrix.py's layer patterns, fp32, CPU): the loss and
every gradient on the varlen path and on the dense path, a KV-cached decode's logits and the full
forward's, and the parameters after one optimizer step. Run it once with PYTHONPATH at the code before
the change (`save OUT`) and once at the code after it (`check OUT`): every tensor must be torch.equal.

    PYTHONPATH=/work/wt/ref36/src python tests/data/make_model_refs_36.py save /tmp/ref36.pt
    PYTHONPATH=src python tests/data/make_model_refs_36.py check /tmp/ref36.pt
"""

from __future__ import annotations

import sys

import torch
from tests.recipe_matrix import EOT, SEQ, batch, build, shrunk

from speedrun.model.kv_cache import KVCache, forward_cached
from speedrun.model.labels import labelled
from speedrun.train.evaluate import row_cu_seqlens
from speedrun.train.schedule import apply_schedule, schedule_at

RECIPES = ["xsa-2026-04", "record-2026-07", "banks-2026-01", "stages-2025-12", "medium-2025-12", "demo-2026"]
FP32 = ["model.block_dtype=fp32", "model.mlp_fp8=false", "model.embed_dtype=fp32", "model.fp8_head=false"]
#: #85's gate network and DC (no bundled recipe has them): record-2026-07 at 6 layers with them on
GATE = ["model.mudd_gate_layer=2", "model.dc_layers=[4]", "model.mudd_gate_attn_layers=[1,4]"]
GATE += ["model.attn_gate=0", "model.skip_gate=0", "model.skip_gate_form=sigmoid"]
CASES = {name: (name, [], 4) for name in RECIPES} | {"record-2026-07+gate": ("record-2026-07", GATE, 6)}


def config(case: str):
    name, extra, layers = CASES[case]
    return shrunk(name, *FP32, *extra, n_layer=layers)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def results(name: str) -> dict[str, object]:
    cfg = config(name)
    model, optimizer = build(cfg)
    apply_schedule(schedule_at(0, cfg), optimizer, model)
    x, y = batch(0, cfg)
    x, y = x[:1], y[:1]
    out: dict[str, object] = {}
    paths = {"dense": ()}
    if cfg.model.attention == "varlen":
        paths["varlen"] = (row_cu_seqlens(x, cfg),)
    for path, extra in paths.items():
        model.zero_grad(set_to_none=True)
        loss = model(x, y, *extra)
        loss.backward()
        out[f"{path}/loss"] = loss.detach()
        out[f"{path}/grads"] = grads(model)
    optimizer.step()
    out["step/params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["labels"] = {n: repr(lab) for n, _, lab in labelled(model)}  # labels unchanged too
    out["buffers"] = {n: b.clone() for n, b in model.named_buffers()}
    model.eval()
    idx = x[:, :40]
    with torch.no_grad():
        out["full/logits"] = model(idx)
        cache = KVCache()
        parts = [forward_cached(model, idx[:, :30], cache)]
        parts += [forward_cached(model, idx[:, t : t + 1], cache) for t in range(30, 40)]
        out["cached/logits"] = torch.cat(parts, dim=1)
    assert EOT in x and SEQ == x.size(1)
    return out


def flat(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    items: dict[str, torch.Tensor] = {}
    for k, v in tree.items():
        items |= flat(v, f"{prefix}{k}/") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return items


def same(a: object, b: object) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def main() -> None:
    mode, path = sys.argv[1], sys.argv[2]
    torch.use_deterministic_algorithms(True)
    got = {case: flat(results(case)) for case in CASES}
    if mode == "save":
        torch.save(got, path)
        print(f"saved {sum(len(v) for v in got.values())} results to {path}")
        return
    want = torch.load(path)
    bad = 0
    for name in CASES:
        a, b = want[name], got[name]
        assert a.keys() == b.keys(), (name, a.keys() ^ b.keys())
        diff = [
            k for k in a if not (torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k])
        ]
        bad += len(diff)
        tail = f"; differ: {diff[:6]}" if diff else ""
        print(f"{name}: {len(a) - len(diff)}/{len(a)} equal{tail}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
