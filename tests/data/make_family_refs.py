"""Reference values of the five 2025 recipes, for the gpt2026 family's bit-for-bit test.

Run once on the pre-split code (`python tests/data/make_family_refs.py`): for each recipe shrunk to a
tiny CPU size that keeps every per-layer feature it has, build the model, fill every parameter from a
generator seeded by its name (so the values do not depend on the order of creation), and record, in
fp32: the loss and every gradient of one forward/backward, then the loss and every parameter after each
of 3 optimizer steps through the training step and the run's optimizer. Values are sha256 of the bytes
(bit for bit) with the fp64 norm beside them (to tell how far off a mismatch is). tests/unit/test_families.py
imports `run` and compares the new family's values with `family_refs.json`; each recipe's entry also holds its
shrunk config (as config.json holds it) and its seeded initialization.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

RECIPES = ("bos-align-2025-07", "yarn-2025-09", "polar-2025-09", "normuon-2025-10", "stages-2025-12")
STEPS, SEQ, MICRO, VOCAB, EOT = 3, 256, 2, 512, 511
OUT = Path(__file__).with_name("family_refs.json")


def overrides(name: str) -> list[str]:
    """The recipe at 4 layers, width 64, vocab 512, 256 tokens, fp32, with its per-layer features kept:
    long and short windows, layers without attention or MLP (an empty one where the recipe has one), the
    U-Net or explicit skips, backout, value embeddings at both ends, key offset on long layers; two
    stages (windows 1/1 blocks, then 1/2 with YaRN) so the third step runs after a stage change."""
    from tests.recipe_matrix import shrink

    from speedrun.recipes import load_recipe

    out = [*shrink(name), "train.steps=4", "model.embed_dtype=fp32", "model.fp8_head=false"]
    out += ["optim.muon_ns_dtype=fp32"]
    m = load_recipe(name).model
    if m.no_mlp_layers == "0" and "0" in m.no_attention_layers.split(","):  # #35's empty layer 0
        out.append("model.no_attention_layers=0,2")
    if load_recipe(name).optim.tie_until:  # untie inside the 3 steps; pause the scalars one step
        out += ["optim.tie_until=2", "optim.scalar_freeze_steps=1"]
    if m.head.mtp > 1:  # #53: MTP weights that change at the stage start
        tokens = SEQ * MICRO
        out.append(
            f"train.stages=tokens={tokens} windows=1/1 frac=1/2 mtp=1,0.5,0.25>1,0.5,0; "
            f"tokens={tokens} windows=1/2 frac=1/2 mtp=1,0.5; tokens={tokens} windows=1/2 ext=0"
        )
    return out


def fill_(model: torch.nn.Module) -> None:
    """Every parameter from a generator seeded by its name: matrices ~ N(0, 1/fan_in), embeddings
    N(0, 1), vectors and scalars 0.5 + 0.2·N(0, 1)."""
    with torch.no_grad():
        for pname, p in model.named_parameters():
            seed = int.from_bytes(hashlib.sha256(pname.encode()).digest()[:7], "little")
            gen = torch.Generator().manual_seed(seed)
            r = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if p.dim() >= 2:
                r = r if "embed" in pname or pname.startswith("wte") else r / p.shape[-1] ** 0.5
            else:
                r = 0.5 + 0.2 * r
            p.copy_(r.to(p.dtype))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MICRO rows of SEQ tokens with documents (end-of-text about every 60 tokens)."""
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, EOT, (MICRO, SEQ + 1), generator=gen)
    tokens[torch.rand(MICRO, SEQ + 1, generator=gen) < 1 / 60] = EOT
    tokens[:, 0] = EOT
    return tokens[:, :-1], tokens[:, 1:]


def digest(t: torch.Tensor) -> list:
    """[sha256 of the bytes, fp64 norm]."""
    t = t.detach().contiguous()
    sha = hashlib.sha256(t.view(torch.uint8).numpy().tobytes()).hexdigest()
    return [sha, float(t.double().norm())]


def init_values(cfg, build: Callable) -> dict:
    """Per parameter of the model as `build` initializes it under seed 0: [sha256, fp64 mean, std]."""
    torch.manual_seed(0)
    model = build(cfg)
    return {
        n: [digest(p)[0], p.double().mean().item(), p.double().std(correction=0).item()]
        for n, p in model.named_parameters()
    }


def run(cfg, build: Callable) -> dict:
    """The values of one shrunk recipe `cfg` (a Config) with the model `build(cfg)`."""
    from tests.recipe_matrix import rows

    from speedrun.optim.build import build_optimizer
    from speedrun.train.schedule import apply_schedule, schedule_at
    from speedrun.train.step import train_step

    torch.manual_seed(0)
    model = build(cfg)
    fill_(model)
    optimizer = build_optimizer(model, cfg)
    apply_schedule(schedule_at(0, cfg), optimizer, model)
    x, y = batch(0)
    loss = model(*rows(cfg, x[:1], y[:1]))
    loss.backward()
    out = {
        "loss": loss.item(),
        "grads": {n: digest(p.grad) for n, p in model.named_parameters() if p.grad is not None},
        "steps": [],
    }
    optimizer.zero_grad(set_to_none=True)
    for step in range(STEPS):
        apply_schedule(schedule_at(step, cfg), optimizer, model)
        x, y = batch(step)
        micro = iter(range(MICRO))

        def next_batch(x=x, y=y, micro=micro):
            i = next(micro)
            return rows(cfg, x[i : i + 1], y[i : i + 1])

        loss = train_step(model, optimizer, next_batch, MICRO, None)
        params = {n: digest(p) for n, p in model.named_parameters()}
        out["steps"].append({"loss": loss.item(), "params": params})
    return out


def main() -> None:
    """Run from a clean checkout of the pre-split commit (or an export of it, naming it in REF_COMMIT)."""
    import os

    from speedrun.model.gpt2024.model import GPT
    from speedrun.recipes import load_recipe

    commit = (
        os.environ.get("REF_COMMIT")
        or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    )
    if "REF_COMMIT" not in os.environ:
        dirty = subprocess.run(["git", "status", "--porcelain", "src"], capture_output=True, text=True).stdout
        assert not dirty.strip(), "make the references from committed code"
    import importlib.util

    # this script's tree's hardware.py (torch only): the pre-split code on the path has no fingerprint
    spec = importlib.util.spec_from_file_location(
        "hw", Path(__file__).parents[2] / "src/speedrun/hardware.py"
    )
    hardware = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hardware)
    # the kernels pick the fp32 summation order: bit for bit only on the same ones (tests/stored.py)
    refs = {
        "commit": commit,
        "torch": torch.__version__,
        "recipes": {},
        "kernels": hardware.kernel_fingerprint(),
    }
    for name in RECIPES:
        cfg = load_recipe(name, overrides(name))
        build = lambda cfg: GPT(cfg.model)  # noqa: E731
        refs["recipes"][name] = {"config": cfg.to_dict(), "init": init_values(cfg, build), **run(cfg, build)}
        print(name, refs["recipes"][name]["loss"], [s["loss"] for s in refs["recipes"][name]["steps"]])
    OUT.write_text(json.dumps(refs, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main()
