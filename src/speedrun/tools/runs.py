"""Open a finished run (or one checkpoint) for inference: config, weights (`model.safetensors` only:
loading never runs code) and tokenizer, with paths relative to the run so a copied run works."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError

from speedrun.atomic import json_object
from speedrun.config import Config
from speedrun.config.families import model_facts
from speedrun.config.files import read_run_config
from speedrun.data.meta import data_dir_for, load_meta, tokenizer_for_data
from speedrun.data.tokenizers import Tokenizer, gpt2_tokenizer
from speedrun.errors import ConfigError, DataError, first_line
from speedrun.model.families import build_model
from speedrun.train.flops import config_model
from speedrun.train.plan.precision import effective_config
from speedrun.train.plan.precision import resolve as resolve_precision
from speedrun.train.run.checkpoint import (
    damaged_message,
    list_checkpoints,
    read_weights,
    trained_tokenizer_hash,
    verify_checkpoint,
)
from speedrun.train.run.rundir import MANIFEST
from speedrun.train.schedule import apply_to_model, schedule_at


def find_checkpoint(path: Path) -> Path:
    """`path` itself when it is a checkpoint folder, else the newest checkpoint of the run `path`."""
    path = Path(path)
    if (path / MANIFEST).is_file() or (
        (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    ):
        return path  # a checkpoint (its manifest names what it must hold: load_model checks it)
    if (path / "config.json").is_file():
        found = list_checkpoints(path)
        if not found:
            raise DataError(
                f"{path}: the run has no checkpoint; train with train.checkpoint_at_end=true "
                "(or train.checkpoint_every=N)"
            )
        return found[-1]
    raise DataError(f"{path}: neither a run directory nor a checkpoint (no config.json)")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: CUDA is not available on this machine")
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):  # meta, mps, xpu: nothing here runs there
        raise ConfigError(f"--device {name!r} is not a device this command runs on (cpu, cuda, cuda:1, auto)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"--device {name}: this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def load_model(path: Path, device: torch.device | str = "cpu") -> tuple[torch.nn.Module, Config, Path]:
    """(model in eval mode on `device`, config with the precision resolved for it, checkpoint folder): the one
    builder of a trained model for sample, eval and HellaSwag. A checkpoint that disagrees with its manifest
    is refused, as `--resume` refuses it; the model has the windows, stage and YaRN tables its run
    validated with at the checkpoint's step."""
    ckpt = find_checkpoint(path)
    problem = verify_checkpoint(ckpt)
    if problem is not None and (ckpt / MANIFEST).is_file():  # a saved checkpoint: before reading its files
        raise DataError(damaged_message(ckpt, problem))
    saved = read_run_config(ckpt, DataError)  # a folder made by hand: what its config lacks first
    if problem is not None:
        raise DataError(damaged_message(ckpt, problem))
    cfg = effective_config(saved, resolve_precision(saved, torch.device(device)))  # as fast as training ran
    shapes = {k: v.shape for k, v in config_model(cfg).state_dict().items()}  # on the meta device
    try:
        weights, metadata = read_weights(ckpt / "model.safetensors")
    except (OSError, SafetensorError, ValueError) as e:
        raise DataError(f"{ckpt / 'model.safetensors'} is damaged: {first_line(e)}") from None
    if any(k not in shapes or weights[k].shape != shapes[k] for k in weights):
        raise DataError(f"{ckpt}: the weights do not fit the model described by its config.json")
    model = build_model(cfg.model)
    missing = set(model.load_state_dict(weights, strict=False).missing_keys)
    tied = {"lm_head.weight", "wte.weight"} if model_facts(cfg.model).tie_embeddings else set()
    if missing - tied:
        raise DataError(f"{ckpt}: weights missing from the checkpoint: {', '.join(sorted(missing - tied))}")
    saved_step = str(metadata.get("step", ""))  # save_checkpoint writes it (and the manifest its hash)
    step = min(int(saved_step), cfg.train.steps) if saved_step.isdecimal() else cfg.train.steps
    apply_to_model(schedule_at(step, cfg), model)  # the validation's windows, stage and YaRN at `step`
    return model.to(device).eval(), cfg, ckpt


def run_tokenizer(cfg: Config, data_dir: Path | None = None, checkpoint: Path | None = None) -> Tokenizer:
    """The run's tokenizer (GPT-2 from the package, a BPE from its data folder or `data_dir`), hash-checked
    against that folder's meta.json and the vocabulary `checkpoint` was trained with."""
    if cfg.data.tokenizer == "gpt2" and data_dir is None:
        tok = gpt2_tokenizer()
    else:
        folder = Path(data_dir) if data_dir is not None else data_dir_for(cfg)
        if data_dir is None and not (folder / "meta.json").is_file():
            raise DataError(
                f"the run's tokenizer {cfg.data.tokenizer} lives in its data folder {folder}, which is "
                "missing here; pass --data DIR (a folder prepared with the same tokenizer)"
            )
        tok = tokenizer_for_data(folder, load_meta(folder))
    if tok.name != cfg.data.tokenizer or tok.vocab_size != cfg.model.vocab_size:
        raise DataError(
            f"tokenizer {tok.name} (vocab {tok.vocab_size}) does not match the run's "
            f"{cfg.data.tokenizer} (vocab {cfg.model.vocab_size})"
        )
    own = data_dir_for(cfg) / "meta.json"
    if data_dir is not None and own.is_file():  # a same-named BPE trained on other text is another vocabulary
        own_hash = json_object(own).get("tokenizer_hash")
        if own_hash is not None and own_hash != tok.hash:
            raise DataError(
                f"{data_dir} was tokenized with a different {tok.name} vocabulary (hash {tok.hash}) "
                f"than the run's data {own.parent} (hash {own_hash})"
            )
    trained = trained_tokenizer_hash(checkpoint) if checkpoint is not None else None
    if trained is not None and trained != tok.hash:
        raise DataError(
            f"the {tok.name} vocabulary found now (hash {tok.hash}) is not the one {checkpoint} was "
            f"trained with (hash {trained}): its data folder was prepared again; pass --data DIR with "
            "the run's vocabulary"
        )
    return tok
