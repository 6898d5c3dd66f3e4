"""Recipe matrix worker: every bundled recipe, shrunk but with its switches, trains K optimizer steps.

Run in-process (one process, gradient accumulation over 2 micro-batches) or under torchrun with 2 gloo
processes (in tests/two_processes.py's one launch), where each rank takes one micro-batch and the model is
wrapped in DDP exactly as the training loop does. Both see the same global batch per step, so their
losses must agree.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from speedrun.config import Config
from speedrun.config.families import model_facts
from speedrun.config.gpt2026 import FLAT, Gpt2026Config
from speedrun.model.families import build_model
from speedrun.optim.build import RunOptimizer, build_optimizer, sharded_optimizer
from speedrun.recipes import load_recipe, recipe_names
from speedrun.train.evaluate import row_cu_seqlens
from speedrun.train.schedule import apply_schedule, schedule_at
from speedrun.train.step import autocast_dtype, train_step

STEPS, SEQ, MICRO = 3, 256, 2  # optimizer steps; tokens per sequence; sequences per step
VOCAB, EOT = 512, 511


def replace(obj, **changes):
    """dataclasses.replace; a gpt2026 model config also takes the flat keys of before its parts
    (`mudd_sources=[7, 3]`, through `FLAT`) and merges them into the part they belong to."""
    if isinstance(obj, Gpt2026Config):
        top = {k: v for k, v in changes.items() if k not in FLAT}
        for key in changes.keys() & FLAT.keys():
            part, name = FLAT[key]
            top[part] = dataclasses.replace(top.get(part, getattr(obj, part)), **{name: changes[key]})
        changes = top
    return dataclasses.replace(obj, **changes)


def shrink(name: str, n_layer: int = 4) -> list[str]:
    """Overrides that make a recipe tiny while keeping every switch it sets (layer-specific ones get
    a layer pattern of their own kind: long and short windows, a layer without attention)."""
    base = load_recipe(name)
    m = base.model
    out = [
        f"model.n_layer={n_layer}",
        "model.n_head=2",
        "model.n_embd=64",
        f"model.vocab_size={VOCAB}",
        f"model.eot_id={EOT}",
        f"model.max_seq_len={SEQ}",
        f"train.seq_len={SEQ}",
        f"train.micro_batch_tokens={SEQ}",
        f"train.global_batch_tokens={SEQ * MICRO}",
        "train.steps=10",
        "train.warmup_steps=0",
        "train.dtype=fp32",
    ]
    if not base.train.warmdown_frac:  # a warm-down in steps (600 > 10): none; a share scales itself
        out.append("train.warmdown_steps=0")
    if model_facts(m).window > 0:  # a window that bites inside 256 tokens (an odd multiple of 64, as 12-08)
        out += ["model.window=192", "model.window_warmup_start=64"]
    if m.family == "gpt2026":
        out += _gpt2026_layers(m, n_layer)
        if m.stream.backout_layer:  # #40's layer 8 of 12: about 2/3 of the depth
            out.append(f"model.backout_layer={max(1, 2 * n_layer // 3)}")
    else:
        if m.window_pattern:
            out.append("model.window_pattern=" + ("LSSL" if n_layer == 4 else "LS"))
        if m.no_attention_layers:
            out.append(f"model.no_attention_layers={n_layer // 2}")
        if m.value_embeds == "ends":
            out.append("model.value_embed_tables=1")
    if base.optim.ships.on():  # #92's terminal ships: windows inside the 10 steps, the cadence before them
        out += [
            "optim.ships.tail_ema_window=6", "optim.ships.tail_avg_window=4",
            "optim.ships.value_embed_window=4", "optim.ships.bank_blend_window=6",
            "optim.value_embed_every4_from=4",
        ]  # fmt: skip
    if base.train.val_seq_len:  # validation rows longer than the shrunk model's positions
        out.append("train.val_seq_len=0")
    if base.train.stages:  # two stages of one step's tokens; windows of 1 and 2 blocks bite inside 256
        tokens = SEQ * MICRO
        sampled = " sampled=384" if m.family == "gpt2026" and m.head.sampled_stride else ""  # #92
        out.append(
            f"train.stages=tokens={tokens} windows=1/1 frac=1/2{sampled}; "
            f"tokens={tokens} windows=1/2 frac=1/2; "
            f"tokens={tokens} windows=1/2 ext=0"
        )
    return out


def _gpt2026_layers(m, L: int) -> list[str]:
    """A gpt2026 recipe's per-layer lists at L layers, each feature kept: a layer without attention
    (L//2, at 4 layers or more), layer 0 without MLP or absent where the recipe's is, long and short
    windows, one value-embedding table at the ends, the recipe's skips (U-Net pairs, or one from the
    first layer to the last), key offset on the long layers."""
    no_attn = L >= 4 and len(m.attention_layers) < m.n_layer
    first = 0 in m.attention_layers or L < 4  # (below 4 layers an absent layer 0 would drop every skip)
    attn = [i for i in range(L) if not (no_attn and i == L // 2) and (i or first)]
    mlp = [i for i in range(L) if i or 0 in m.mlp_layers]
    windows = (
        (["L", "S", "S", "L"] if L == 4 else ["L", "S"] + ["L"] * (L - 2)) if "S" in m.windows else ["L"] * L
    )
    ve = [0 if m.value_embeds and m.value_embeds[0] >= 0 else -1] + [-1] * (L - 2) + [0]
    skips = [[0, L - 1]] if len(m.skips) == 1 else [[L - 1 - dst, dst] for dst in range(L - L // 2, L)]
    out = [f"model.attention_layers={attn}", f"model.mlp_layers={mlp}", f"model.windows={','.join(windows)}"]
    out += [f"model.value_embeds={ve}" if m.value_embeds else "model.value_embeds=[]"]
    out += [f"model.skips={skips}" if m.skips else "model.skips=[]"]
    if m.attn.key_offset_layers:
        out.append(f"model.key_offset_layers={[i for i in attn if windows[i] == 'L']}")
    paired = []
    if m.attn.paired_layers:
        offset = m.attn.key_offset_layers and windows  # #58: a paired layer has no #49 key offset
        paired = [i for i in attn if not offset or windows[i] == "S"][:1]
        out.append(f"model.paired_layers={paired}")
    if m.attn.xsa_layers:  # #82: the unpaired attention layers
        out.append(f"model.xsa_layers={[i for i in attn if i not in paired]}")
    if m.attn_inputs:  # #77: the last layer attends to the output of the (shrunk) backout layer
        out.append(f"model.attn_inputs={[-1] * (L - 1) + [max(0, min(L - 2, 2 * L // 3))]}")
    if m.embed.bigram_dim:  # #89's script: 192 of 768 dims
        out.append("model.embed.bigram_dim=16")
    if m.mudd.sources:  # #81: two sources below the last two layers (the record's [7, 3] of 11)
        out.append(f"model.mudd_sources={[L - 3, L - 4]}" if L >= 4 else "model.mudd_sources=[]")
    if m.mudd.gate_layer and L >= 4:  # #85: the post gate at layer 1 (record 4 of 11); gates on the first and
        # last attention layers (record 3, 10), DC on the last (record 10)
        out += ["model.mudd_gate_layer=1", f"model.mudd_gate_attn_layers={[attn[0], attn[-1]]}"]
        out += [f"model.dc_layers={[attn[-1]]}"] if m.mudd.dc_layers else []
    elif m.mudd.gate_layer:  # below 4 layers there is no MUDD for the gate network to ride on
        out += ["model.mudd_gate_layer=0", "model.mudd_gate_attn_layers=[]", "model.dc_layers=[]"]
    out += _anvil_layers(m, L, attn)
    if m.attn.qk_head_dim:  # #344: Q/K at the recipe's share of the head width (96 of 128: 24 of 32)
        out.append(f"model.attn.qk_head_dim={m.attn.qk_head_dim * 64 // 2 // (m.n_embd // m.n_head)}")
    return out


def _anvil_layers(m, L: int, attn: list[int]) -> list[str]:
    """#92's parts at L layers: injection sites below the last layer (one without attention), a narrow
    (and narrow-V) short layer, the MLP's width at the recipe's share, a parallel MLP, a small n-gram
    table, the post-loop sources on the one shrunk table, 4 channel groups."""
    out = []
    if L < 4:  # no MUDD nor gate network below 4 layers (_gpt2026_layers): nothing for the sites to ride on
        out += ["model.stream.x0_layers=[]", "model.stream.bigram_layers=[]"] if m.stream.x0_layers else []
        out += ["model.mudd.final_sources=[]", "model.mudd.mix_groups=0"] if m.mudd.mix_groups else []
    elif m.stream.x0_layers or m.stream.bigram_layers:
        out += [f"model.stream.x0_layers={list(range(L - 1))}", f"model.stream.bigram_layers={[0, L - 2]}"]
    if m.attn.narrow_layers:
        short = [i for i in attn if i not in (0, L - 1)][:1]
        out += [f"model.attn.narrow_layers={short}", f"model.attn.narrow_v_layers={short}"]
    if m.mlp.hidden:
        out.append(f"model.mlp.hidden={m.mlp.hidden * 64 // m.n_embd}")
    if m.mlp.parallel_layers:
        out.append(f"model.mlp.parallel_layers={[L - 2]}")
    if m.ngram.rows:
        out.append("model.ngram.rows=4096")
    if m.mudd.final_sources and L >= 4:
        names = ",".join("ve0" if n.startswith("ve") else n for n in m.mudd.final_sources)
        out.append(f"model.mudd.final_sources={names}")
    if m.mudd.mix_groups and L >= 4:
        out.append("model.mudd.mix_groups=4")
    return out


def flex_overrides(name: str) -> list[str]:
    """attention=flex for the compile test; a staged varlen recipe drops its stages and YaRN for a fixed
    window (its varlen path compiles in tests/e2e/test_stages_training.py)."""
    if load_recipe(name).train.stages:
        fixed = ["train.stages=", "train.cooldown_start=int", "model.yarn=false", "model.window=192"]
        fixed += ["train.stage_bounds=round", "model.mtp=0"]  # #53's stage-driven switches go with them
        if load_recipe(name).model.family == "gpt2026" and load_recipe(name).model.head.sampled_stride:
            fixed.append("model.head.sampled_stride=0")  # #92's P comes from the stages
        return ["model.attention=flex", *fixed]
    return ["model.attention=flex"]


def rows(cfg: Config, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One (1, T) row as the model takes it: with its cu_seqlens under model.attention=varlen."""
    return (x, y, row_cu_seqlens(x, cfg)) if cfg.model.attention == "varlen" else (x, y)


def shrunk(name: str, *extra: str, n_layer: int = 4) -> Config:
    return load_recipe(name, [*shrink(name, n_layer), *extra])


def compile_config(name: str, *extra: str) -> Config:
    """The recipe as the fullgraph compile test builds it: shrunk to 2 layers (tracing time grows with
    depth), FlexAttention where CUDA takes it."""
    return shrunk(name, *flex_overrides(name), *extra, n_layer=2)


def batch(step: int, cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: MICRO sequences with documents (end-of-text about every 60 tokens)."""
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, EOT, (MICRO, SEQ + 1), generator=gen)
    tokens[torch.rand(MICRO, SEQ + 1, generator=gen) < 1 / 60] = EOT
    return tokens[:, :-1], tokens[:, 1:]


def build(cfg: Config) -> tuple[torch.nn.Module, RunOptimizer]:
    """Model and optimizer as a run builds them."""
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)
    return model, build_optimizer(model, cfg)


def train_losses(name: str, rank: int = 0, world: int = 1) -> list[float]:
    """K steps of the shrunk recipe through the training step; the mean loss of each global batch."""
    cfg = shrunk(name)
    model, optimizer = build(cfg)
    wrap = world > 1 and not sharded_optimizer(cfg)  # the 2025–26 optimizer communicates itself
    ddp = DDP(model, broadcast_buffers=False, gradient_as_bucket_view=True) if wrap else model
    accum = MICRO // world
    losses = []
    for step in range(STEPS):
        sched = schedule_at(step, cfg)
        apply_schedule(sched, optimizer, model)
        x, y = batch(step, cfg)
        mine = iter(range(rank * accum, (rank + 1) * accum))  # this rank's sequences of the global batch

        def next_batch(mine=mine, x=x, y=y) -> tuple[torch.Tensor, ...]:
            i = next(mine)
            return rows(cfg, x[i : i + 1], y[i : i + 1])

        loss = train_step(ddp, optimizer, next_batch, accum, autocast_dtype(cfg), 0.0, sched.grad_scale)
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    return losses


def every_recipe(rank: int, world: int) -> dict[str, object]:
    """Each recipe's losses on this rank, or its error; run by tests/library_checks.py under torchrun."""
    results: dict[str, object] = {}
    for name in recipe_names():
        try:
            results[name] = train_losses(name, rank, world)
        except Exception as e:  # report every recipe, not just the first failure
            results[name] = f"{type(e).__name__}: {e}"
            # a rank that failed leaves its peer waiting in a collective: both must stop together
            break
    return results
