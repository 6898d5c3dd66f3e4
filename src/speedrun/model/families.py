"""The model families behind one small registry (torchtitan's ModelSpec idea, without parallelism):
gpt2024 (llm.c → record-2025-01, one switch per technique: model/gpt.py) and gpt2026 (records #26 on,
per-layer specs: model/gpt2026/). Callers use `build_model` and `apply_schedule`, never a class."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class CompiledSaves:
    """What a compiled step keeps for its backward beyond train/memory.py's common count (the norms'
    inputs, QKV, attention output, MLP pre-activation, the head's output and one logit gradient): the
    family's facts, read from inductor's min-cut partition (tests/fake_compiled_memory.py)."""

    mlp_post: bool = False  # the ReLU² output too (the down-projection's input)
    matmul_input_copies: bool = False  # a matmul-dtype copy of each matmul input when the stream is wider
    logit_gradients: int = 1  # logit-sized matmul-dtype tensors alive at once in the head's backward
    cuda_margin: float = 1.2  # the guard asks for this x the estimate free (gpt2024's H100 peaks: 1.09-1.16x)


@dataclass(frozen=True)
class Family:
    """What the rest of the package needs of a family."""

    name: str
    config_cls: type
    build: Callable[[Any], nn.Module]  # the family's model config → the model
    apply_schedule: Callable[[nn.Module, Any], None]  # a step's StepSchedule → the model
    flops_per_token: Callable[[nn.Module, int], int]  # (model, sequence length) → training FLOPs
    # gpt2024: the common count (its H100 peaks were 1.09-1.16x it)
    compiled_saves: CompiledSaves = CompiledSaves()


def _gpt2024() -> Family:
    from speedrun.config import ModelConfig
    from speedrun.model.gpt import GPT

    def apply(model: nn.Module, values: Any) -> None:  # the growing window (stages are gpt2026's)
        assert values.stage is None, "config checks: train.stages needs the gpt2026 family"
        if values.window > 0:
            model.set_attention_window(values.window)

    return Family("gpt2024", ModelConfig, GPT, apply, lambda m, t: m.flops_per_token(t))


def _gpt2026() -> Family:
    from speedrun.config_model import Gpt2026Config
    from speedrun.model.gpt2026 import windows
    from speedrun.model.gpt2026.model import GPT2026

    # the partition of the varlen step (docs/benchmarks.md): the estimate sits 0-9 % above the count, and
    # the count of record-2026-07 is 39,877 MiB against #89's 1xH100 log, 39,736: no margin on top
    saves = CompiledSaves(mlp_post=True, matmul_input_copies=True, logit_gradients=2, cuda_margin=1.0)
    return Family(
        "gpt2026", Gpt2026Config, GPT2026, windows.apply_schedule, lambda m, t: m.flops_per_token(t), saves
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


def flops_per_token(model: nn.Module, seq_len: int) -> int:
    return family_of(model.cfg).flops_per_token(model, seq_len)


__all__ = [
    "FAMILIES",
    "CompiledSaves",
    "Family",
    "apply_schedule",
    "build_model",
    "family_of",
    "flops_per_token",
]
