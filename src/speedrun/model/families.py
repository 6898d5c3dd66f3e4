"""The model families behind one small registry (torchtitan's ModelSpec idea, without parallelism):
gpt2024 (llm.c → record-2025-01, one switch per technique: model/gpt2024/) and gpt2026 (records #26 on,
per-layer specs: model/gpt2026/). Callers use `build_model` and `apply_schedule`, never a class."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from speedrun.config.families import model_facts
from speedrun.model.flops import AttentionLayer, StepWindows


@dataclass(frozen=True)
class CompiledSaves:
    """What a compiled step keeps for its backward beyond train/plan/memory.py's common count (the norms'
    inputs, QKV, attention output, MLP pre-activation, the head's output and one logit gradient): the
    family's facts, read from inductor's min-cut partition (tests/fake_compiled_memory.py)."""

    mlp_post: bool = False  # the ReLU² output too (the down-projection's input)
    matmul_input_copies: bool = False  # a matmul-dtype copy of each matmul input when the stream is wider
    logit_gradients: int = 1  # logit-sized matmul-dtype tensors alive at once in the head's backward
    cuda_margin: float = 1.2  # the guard asks for this x the estimate free (gpt2024's H100 peaks: 1.09-1.16x)


LayerFacts = tuple[list[bool], list[bool], list[int | None], set[int], list[bool], bool]


@dataclass(frozen=True)
class Family:
    """What the rest of the package needs of a family."""

    build: Callable[[Any], nn.Module]  # the family's model config → the model
    apply_schedule: Callable[[nn.Module, Any], None]  # a step's StepSchedule → the model
    # the FLOPs count's inputs (model/flops.py): a step's windows from its schedule (None: the config's),
    # and the model's attention layers
    step_windows: Callable[[Any, Any], StepWindows]
    attention_layers: Callable[[nn.Module], list[AttentionLayer]]
    # train/plan/memory.py's per-layer facts: attention, MLP, value-embedding table, the layers a skip enters,
    # whether v is mixed (a separate tensor), whether the x0 shortcut is there
    layer_facts: Callable[[Any], LayerFacts]
    # after optimizer step `step` (-1 before the first): what the family refreshes (#84/#89: gpt2026's FP8
    # weight copies); the loop, the warm-up and the bench call it before every step
    after_step: Callable[[nn.Module, int], None] = lambda model, step: None  # gpt2024 keeps no copies
    # what a compiled step keeps beyond train/plan/memory.py's common count (gpt2024: that count; its H100
    # peaks were 1.09-1.16x it)
    compiled_saves: CompiledSaves = CompiledSaves()


def _tensor_rule_windows(model_cfg: Any, values: Any) -> StepWindows:
    """The tensor window's (2024, #26): the step's window (the config's before any step) and the short
    layers' half of it, by the mask's own rule."""
    from speedrun.model.attention import short_window

    facts = model_facts(model_cfg)
    if facts.window <= 0:
        return StepWindows()
    long = values.window if values is not None and values.window > 0 else facts.window
    block = facts.window_granularity == "block"
    return StepWindows(int(short_window(torch.tensor(long), block)), long)


def _gpt2024() -> Family:
    from speedrun.model.gpt2024.layout import attention_layers, value_embed_layout
    from speedrun.model.gpt2024.model import GPT

    def apply(model: nn.Module, values: Any) -> None:  # the growing window (stages are gpt2026's)
        assert values.stage is None, "config checks: train.stages needs the gpt2026 family"
        if values.window > 0:
            model.set_attention_window(values.window)

    def layers(model: nn.Module) -> list[AttentionLayer]:
        cfg = model.cfg
        pattern = cfg.window_pattern or "L" * cfg.n_layer
        return [
            AttentionLayer(k, cfg.n_embd) for k, a in zip(pattern, attention_layers(cfg), strict=True) if a
        ]

    def layer_facts(m: Any) -> LayerFacts:
        L = m.n_layer
        n_skip = L // 2 if m.unet else 0
        skipped = {i for i in range(L) if i >= L - n_skip > 0}
        mixes, layout = m.value_residual or m.value_embeds != "none", value_embed_layout(m)
        mixed = [mixes and (m.value_mix == "lambdas" or j is not None or m.value_residual) for j in layout]
        return attention_layers(m), [True] * L, layout, skipped, mixed, m.x0_shortcut

    return Family(GPT, apply, _tensor_rule_windows, layers, layer_facts)


def _gpt2026() -> Family:
    from speedrun.model.gpt2026 import windows
    from speedrun.model.gpt2026.model import GPT2026

    def step_windows(model_cfg: Any, values: Any) -> StepWindows:
        if values is not None and values.stage is not None:  # the stage's windows (blocks) and cut
            v = values.stage
            short, long = windows.blocks_to_tokens(v.short_window), windows.blocks_to_tokens(v.long_window)
            return StepWindows(short, long, v.attention_len)  # #92: its segments bound attention
        if model_cfg.attention == "varlen":  # no stage: what the model starts with
            w = windows.initial_windows(model_cfg.attn.window)
            return StepWindows(w.short, w.long)
        return _tensor_rule_windows(model_cfg, values)

    def layers(model: nn.Module) -> list[AttentionLayer]:
        cfg = model.cfg
        qk, v = model_facts(cfg).qk_head_dim, cfg.n_embd // cfg.n_head

        def width(s) -> float:  # the mean of the Q/K and V widths (#92: half of either on narrow layers)
            return cfg.n_head * (qk // (1 + s.narrow_qk) + v // (1 + s.narrow_v)) / 2

        return [AttentionLayer(s.window, width(s), s.paired) for s in model.specs if s.attention]

    def layer_facts(m: Any) -> LayerFacts:
        L = m.n_layer
        attn, mlp = [i in m.attention_layers for i in range(L)], [i in m.mlp_layers for i in range(L)]
        layout = [j if j >= 0 else None for j in m.value_embeds] or [None] * L
        mixed = [m.values.mix == "lambdas" or j is not None for j in layout]
        return attn, mlp, layout, {dst for _, dst in m.skips}, mixed, True

    # the partition of the varlen step (docs/benchmarks.md): the estimate sits 0-9 % above the count, and
    # the count of record-2026-07 is 39,877 MiB against #89's 1xH100 log, 39,736: no margin on top
    saves = CompiledSaves(mlp_post=True, matmul_input_copies=True, logit_gradients=2, cuda_margin=1.0)
    # after_step: the FP8 parts' weight copies (none without model.mlp.fp8 or model.attn.fp8_qkv)
    return Family(
        GPT2026, windows.apply_schedule, step_windows, layers, layer_facts, GPT2026.refresh_fp8, saves
    )


FAMILIES: dict[str, Callable[[], Family]] = {"gpt2024": _gpt2024, "gpt2026": _gpt2026}


def family_of(model_cfg: Any) -> Family:
    """The family a model config belongs to (its `family` field; gpt2024 without one)."""
    return FAMILIES[getattr(model_cfg, "family", "gpt2024")]()


def build_model(model_cfg: Any) -> nn.Module:
    """The model of `model_cfg`, on the host, in the family's initialization (torch's current seed)."""
    return family_of(model_cfg).build(model_cfg)


def apply_schedule(model: nn.Module, values: Any) -> None:
    """Write a step's model values (windows, stage, YaRN, MTP weights) through the model's family."""
    family_of(model.cfg).apply_schedule(model, values)


__all__ = ["FAMILIES", "CompiledSaves", "Family", "apply_schedule", "build_model", "family_of"]
