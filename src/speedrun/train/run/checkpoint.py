"""Checkpoints: written atomically, verified on load, loaded without executing code.

`checkpoints/step_000100/` holds model.safetensors (weights), state.pt (optimizers, loader, RNG, step,
timers), config.json and manifest.json (sha256 and size of each file, and the step). It is written as
`step_000100.tmp/`, fsynced, manifest last, then renamed: a crash leaves only a `.tmp` folder. Loading
re-hashes every file and checks the step, so a changed byte is never trained on; a damaged newest
checkpoint is refused (naming the newest intact one), never skipped. Rank 0 writes, every rank reads."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save_file

from speedrun.atomic import file_mode, json_object, write_atomic
from speedrun.errors import DataError, SpeedrunError, first_line
from speedrun.train.run.rundir import CHECKPOINT_DIR, MANIFEST, STEP_DIR

FILES = ("model.safetensors", "state.pt", "config.json")
MANIFEST_FORMAT = "speedrun-checkpoint"


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINT_DIR / f"step_{step:06d}"


def checkpoint_step(path: Path) -> int:
    """The step a checkpoint folder's name says it holds."""
    m = STEP_DIR.fullmatch(Path(path).name)
    if not m:
        raise DataError(f"{path}: not a checkpoint folder (expected a name like step_000100)")
    return int(m.group(1))


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Finished (renamed into place; `load_checkpoint` verifies) checkpoint folders, oldest first by the
    step number in their names, never by name sort; `.tmp` folders are ignored."""
    root = run_dir / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_DIR.fullmatch(p.name)]
    return sorted(found, key=lambda p: (checkpoint_step(p), p.name))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _row_sharded(model: torch.nn.Module) -> list[str]:
    """Names of the parameters each process holds only some rows of (#92's n-gram table, optim/table_rows.py):
    the optimizer's state gathers them whole, and the weights file holds them whole."""
    return [name for name, p in model.named_parameters() if getattr(p, "row_sharded", False)]


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State dict with tied tensors stored once (safetensors refuses shared storage), without row-sharded
    parameters (this process's rows only)."""
    seen: dict[int, str] = {}
    out = {}
    sharded = set(_row_sharded(model))
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen or name in sharded:
            continue
        seen[t.data_ptr()] = name
        out[name] = t.detach().cpu().contiguous()
    return out


def _write_failure(e: BaseException, run_dir: Path) -> str:
    """What went wrong, in the user's words: torch.save on a full disk says `enforce fail at
    inline_container.cc` (issue 46), so a writer's RuntimeError with the disk (nearly) full is "no space"."""
    if isinstance(e, RuntimeError | SafetensorError) and ("inline_container" in str(e) or "write" in str(e)):
        try:
            free = shutil.disk_usage(run_dir).free
        except OSError:
            free = None
        if free is not None and free < 64 * 2**20:
            return f"no space left on device ({free / 2**20:.1f} MiB free on the disk of {run_dir})"
    return first_line(e)


def save_checkpoint(
    run_dir: Path,
    step: int,
    model: torch.nn.Module,
    state: dict[str, Any],
    config: dict[str, Any],
    keep: int,
    tokenizer_hash: str | None = None,
) -> Path:
    """Write checkpoint `step` atomically, then keep only the newest `keep`; `tokenizer_hash` lets
    `sample`/`eval` refuse a vocabulary prepared again. Any write failure is one SpeedrunError line."""
    final = checkpoint_path(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    try:
        if final.parent.is_dir():  # leftovers of killed writers (the run directory is locked: ours)
            for stale in final.parent.glob("step_*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
        weights, state = _weights(model), _table_to_weights(model, state)
        save_file(
            weights | state.pop("row_sharded", {}), tmp / "model.safetensors", metadata={"step": str(step)}
        )
        torch.save(state, tmp / "state.pt")
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        files = {}
        for name in FILES:
            os.chmod(tmp / name, file_mode())  # safetensors creates 0600 files
            _fsync(tmp / name)
            files[name] = {"sha256": _sha256(tmp / name), "bytes": (tmp / name).stat().st_size}
        manifest = {"format": MANIFEST_FORMAT, "version": 1, "step": step, "files": files}
        if tokenizer_hash:
            manifest["tokenizer_hash"] = tokenizer_hash
        write_atomic(tmp / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
        if final.exists():  # re-saving the same step (e.g. final step after a signal): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync(final.parent)
    except (OSError, RuntimeError, SafetensorError, ValueError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SpeedrunError(f"cannot write checkpoint {final}: {_write_failure(e, run_dir)}") from None
    except BaseException:  # Ctrl-C, SystemExit: still leave nothing half-written behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep > 0:
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _table_to_weights(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """The state with a row-sharded table moved from the optimizer's gathered state (its "ngram_rows" part)
    into `row_sharded` {parameter name: whole table}, for the weights file: one file for any world size."""
    names = _row_sharded(model)
    if not names:
        return state
    (name,) = names
    rows = dict(state["optimizer"]["ngram_rows"])
    table = rows.pop("table")
    return {**state, "optimizer": {**state["optimizer"], "ngram_rows": rows}, "row_sharded": {name: table}}


def trained_tokenizer_hash(path: Path) -> str | None:
    """The hash of the vocabulary checkpoint `path` was trained with (None: not recorded or unreadable;
    `verify_checkpoint` reports a damaged manifest)."""
    value = json_object(Path(path) / MANIFEST).get("tokenizer_hash")
    return value if isinstance(value, str) else None


def verify_checkpoint(path: Path) -> str | None:
    """None if every file of checkpoint `path` matches its manifest, else what is wrong (one phrase); a file
    we may not read is `permission denied: FILE`, not damage."""
    try:
        return _verify(Path(path))
    except PermissionError as e:
        raise SpeedrunError(f"permission denied: {e.filename or path}") from None


def _verify(path: Path) -> str | None:
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        files = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
            return f"{MANIFEST} is not a speedrun checkpoint manifest"
    except FileNotFoundError:
        return f"{MANIFEST} is missing"
    except PermissionError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({first_line(e)})"
    if STEP_DIR.fullmatch(path.name) and manifest.get("step") != checkpoint_step(path):  # a renamed copy
        return f"{MANIFEST} is for step {manifest.get('step')}, the folder for {checkpoint_step(path)}"
    present = {p.name for p in path.iterdir()} - {MANIFEST}
    if missing := sorted(set(files) - present):
        return f"missing file {', '.join(missing)}"
    if extra := sorted(present - set(files)):
        return f"unexpected file {', '.join(extra)}"
    for name, entry in files.items():
        try:
            if (path / name).stat().st_size != entry["bytes"] or _sha256(path / name) != entry["sha256"]:
                return f"{name} does not match its sha256 in {MANIFEST}"
        except PermissionError:
            raise
        except OSError as e:
            return f"{name} is unreadable ({first_line(e)})"
        except (KeyError, TypeError):
            return f"{MANIFEST} has a bad entry for {name}"
    return None


def damaged_message(path: Path, problem: str) -> str:
    """Why `path` cannot be used, and exactly what the user can do instead."""
    path = Path(path)
    if not STEP_DIR.fullmatch(path.name):  # a checkpoint copied out of its run under another name
        return f"checkpoint {path} is damaged ({problem})"
    step = checkpoint_step(path)
    older = [p for p in list_checkpoints(path.parent.parent) if checkpoint_step(p) < step]
    intact = next((p for p in reversed(older) if verify_checkpoint(p) is None), None)
    if intact is None:  # with no checkpoint, --resume starts the run over (RunDir.start_over)
        root = path.parent
        advice = (
            f"no older checkpoint is intact; to start the run over from step 0, mv {root} "
            f"{root.with_name('damaged-' + root.name)} and resume again"
        )
    else:
        aside = path.parent.parent / f"damaged-{path.name}"
        advice = (
            f"the newest intact one is {intact.name}: to resume from it, mv {path} {aside} and resume again"
        )
    return f"checkpoint {path} is damaged ({problem}); {advice}"


def read_weights(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The CPU tensors and metadata of a safetensors file, read through Python's file layer (safetensors'
    opener takes only UTF-8 paths); SafetensorError or ValueError for a file that is not one."""
    data = Path(path).read_bytes()
    tensors = load(data)  # checks the format first: the header below is then a JSON object
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    return tensors, header.get("__metadata__") or {}


def load_checkpoint(path: Path, model: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """Verify checkpoint `path`, load its weights into `model` and return (state, config); anything damaged,
    missing, extra or inconsistent is a DataError naming the checkpoint."""
    path = Path(path)
    problem = verify_checkpoint(path)
    if problem is not None:
        raise DataError(damaged_message(path, problem))
    step = checkpoint_step(path)
    try:
        weights, metadata = read_weights(path / "model.safetensors")
        weights_step = metadata.get("step")
        state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, SafetensorError, RuntimeError, ValueError, EOFError) as e:
        raise DataError(damaged_message(path, f"unreadable: {first_line(e)}")) from None
    if not isinstance(state, dict) or state.get("step") != step or weights_step != str(step):
        found = state.get("step") if isinstance(state, dict) else None
        raise DataError(damaged_message(path, f"state.pt holds step {found}, weights step {weights_step}"))
    expected = _weights(model)
    sharded = {name: weights.pop(name, None) for name in _row_sharded(model)}  # whole, for the optimizer
    if set(weights) != set(expected) or any(weights[k].shape != expected[k].shape for k in expected):
        raise DataError(f"checkpoint {path} holds weights of a different model")
    for name, table in sharded.items():  # the n-gram table's rows of this process: optim/table_rows.py
        optimizer = state.get("optimizer")
        rows = optimizer.get("ngram_rows") if isinstance(optimizer, dict) else None
        if table is None or not isinstance(rows, dict):
            raise DataError(f"checkpoint {path} holds no whole {name} and its row state")
        rows["table"] = table
    # tied tensors were stored once; their other names come back as "missing" and share the storage
    model.load_state_dict(weights, strict=False)
    return state, config
