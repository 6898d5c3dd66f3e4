"""Which precision a run computes in, chosen once, before step 0, from what the device runs fast.

A CPU without bf16 instructions emulates it ~100x slower than fp32, so `train.dtype="auto"` is bf16
only where bf16 matmuls are fast, and a recipe's pinned `bf16` falls back to fp32 (with its bf16
parameters, and a log line) on such a CPU; a `bf16` the user gave (`cfg.fixed`) is kept, logged as
slow. `fast_bf16` reads the CPU flags and torch's own checks (a robust probe only where they are silent).

Decided once per run: a new run records its choice in config.json (`decide`: the `decided` entry),
and every `--resume` keeps it, whatever the host it continues on says (a run moved to a host without
fast bf16 would otherwise train half in bf16, half in fp32); each start records its precision."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from speedrun.config import Config, canonical_key, key_type
from speedrun.config.files import set_value
from speedrun.hardware import fast_bf16


@dataclass(frozen=True)
class Precision:
    """The resolved precision: autocast dtype (None = fp32, no autocast) and why, for the log and summary."""

    dtype: str  # "bf16" | "fp32"
    reason: str

    @property
    def autocast(self) -> torch.dtype | None:
        return torch.bfloat16 if self.dtype == "bf16" else None

    def describe(self) -> str:
        return f"precision {self.dtype} ({self.reason})"


def resolve(cfg: Config, device: torch.device) -> Precision:
    """The precision `cfg` runs in on `device` (see the module doc)."""
    asked = cfg.train.dtype
    if asked == "fp32":
        return Precision("fp32", "train.dtype=fp32")
    fast, why = fast_bf16(device.type)
    if fast:
        return Precision("bf16", f"train.dtype={asked}: {why}")
    if asked == "auto":
        return Precision("fp32", f"train.dtype=auto: {why}")
    if "train.dtype" in cfg.fixed:  # the user asked for bf16: kept (principle 15), slow as it may be
        return Precision("bf16", f"train.dtype=bf16 as given, though slow here: {why}")
    return Precision("fp32", f"train.dtype=bf16 falls back to fp32: {why}")


def decide(
    cfg: Config, device: torch.device, saved: dict[str, str] | None
) -> tuple[Precision, Config, dict[str, str]]:
    """The run's precision, the config it computes with, and the choices to record (config.json's
    `decided`: the dtype and Muon's iteration dtype). `saved`: what the run's first start recorded,
    kept whatever this host runs fast; None: decided here."""
    if saved is None:
        precision = resolve(cfg, device)
        ns = cfg.optim.muon_ns_dtype
        if ns == "auto":  # Muon's iterations: the same rule (optim/build.muon_ns_dtype)
            ns = "bf16" if fast_bf16(device.type)[0] else "fp32"
    else:
        dtype, ns = saved["dtype"], saved["muon_ns_dtype"]
        fast, why = fast_bf16(device.type) if dtype == "bf16" else (True, "")
        slow = "" if fast else f", though slow here: {why}"
        precision = Precision(dtype, f"train.dtype={cfg.train.dtype}: {dtype} as the run started{slow}")
    rcfg = effective_config(cfg, precision)
    rcfg = dataclasses.replace(rcfg, optim=dataclasses.replace(rcfg.optim, muon_ns_dtype=ns))
    return precision, rcfg, {"dtype": precision.dtype, "muon_ns_dtype": ns}


def effective_config(cfg: Config, precision: Precision) -> Config:
    """A copy of `cfg` with the dtype resolved, as the model, the step and validation use it. When a
    pinned bf16 recipe falls back, its bf16 parameter storage falls back too (it would also crawl),
    except a storage field the user set (`cfg.fixed`: an automatic choice leaves it alone)."""
    train = dataclasses.replace(cfg.train, dtype=precision.dtype)
    model = cfg.model
    if precision.dtype == "fp32" and cfg.train.dtype != "fp32":  # each family's bf16 storage fields
        holder = dataclasses.replace(cfg, model=copy.deepcopy(cfg.model))
        storage = {"model.bf16_model": False, "model.embed_dtype": "fp32", "model.block_dtype": "fp32"}
        for key, value in storage.items():
            key = canonical_key(model, key)
            if key_type(type(model), key.removeprefix("model.")) is not None and key not in cfg.fixed:
                set_value(holder, key, value)
        model = holder.model
    return dataclasses.replace(cfg, train=train, model=model)
