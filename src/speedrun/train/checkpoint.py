"""Checkpoints: written atomically, loaded without executing code, checked against the run's config.

Layout inside a run directory:
    checkpoints/step_000100/model.safetensors   weights (safetensors: loading never runs code)
    checkpoints/step_000100/state.pt            optimizers, loader position, RNG, step, timers
    checkpoints/step_000100/config.json         the resolved config the checkpoint belongs to
A checkpoint is first written to `step_000100.tmp/`, every file fsynced, then renamed: a crash
mid-write leaves only a `.tmp` folder, which loading ignores, and the previous checkpoint intact.
Optimizer state is replicated on every rank (DDP gradients, Muon's replicated momentum), so rank 0
writes it and every rank reads it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from speedrun.errors import DataError, SpeedrunError

CHECKPOINT_DIR = "checkpoints"
FILES = ("model.safetensors", "state.pt", "config.json")


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINT_DIR / f"step_{step:06d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (unfinished `.tmp` folders are ignored)."""
    root = run_dir / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp")]
    return sorted(d for d in done if all((d / f).exists() for f in FILES))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State dict with tied tensors stored once (safetensors refuses shared storage)."""
    seen: dict[int, str] = {}
    out = {}
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:
            continue
        seen[t.data_ptr()] = name
        out[name] = t.detach().cpu().contiguous()
    return out


def save_checkpoint(
    run_dir: Path, step: int, model: torch.nn.Module, state: dict[str, Any], config: dict[str, Any], keep: int
) -> Path:
    """Write checkpoint `step` atomically, then delete all but the newest `keep` checkpoints."""
    final = checkpoint_path(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(_weights(model), tmp / "model.safetensors", metadata={"step": str(step)})
        torch.save(state, tmp / "state.pt")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        for name in FILES:
            _fsync(tmp / name)
        if final.exists():  # re-saving the same step (e.g. final step after a signal): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(final.parent)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SpeedrunError(f"cannot write checkpoint {final}: {e.strerror or e}") from None
    if keep > 0:
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, model: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load weights into `model` (in place) and return (state, config). Damaged files → DataError."""
    try:
        weights = load_file(path / "model.safetensors", device="cpu")
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, SafetensorError, RuntimeError, ValueError, EOFError, json.JSONDecodeError) as e:
        raise DataError(
            f"checkpoint {path} is damaged or unreadable: {str(e).splitlines()[0][:200]}"
        ) from None
    expected = _weights(model)
    if set(weights) != set(expected) or any(weights[k].shape != expected[k].shape for k in expected):
        raise DataError(f"checkpoint {path} holds weights of a different model")
    # tied tensors were stored once; their other names come back as "missing" and share the storage
    model.load_state_dict(weights, strict=False)
    return state, config
