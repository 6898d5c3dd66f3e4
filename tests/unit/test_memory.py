"""The memory guard (train/plan/memory.py): its estimate against a fake-tensor measurement of full-size
recipes (tests/fake_memory.py), and the one-line refusal naming the setting that fits."""

from __future__ import annotations

import pytest
import torch

from speedrun.errors import SpeedrunError
from speedrun.recipes import load_recipe
from speedrun.train.plan import memory
from speedrun.train.plan.memory import check_fits, estimate_memory, estimate_peak_bytes, guarded_bytes
from tests.fake_compiled_memory import compiled_saved_bytes
from tests.fake_memory import fake_peak_bytes

GiB = 2**30
CUDA = torch.device("cuda", 0)  # a device object only: nothing is allocated on it


def full_size(recipe: str, accumulation: int, *extra: str):
    """The recipe at full size in bf16, as CUDA runs it, with `accumulation` micro-batches a step."""
    cfg = load_recipe(recipe, ["train.dtype=bf16", *extra])
    batch = accumulation * cfg.train.micro_batch_tokens
    return load_recipe(recipe, ["train.dtype=bf16", f"train.global_batch_tokens={batch}", *extra])


@pytest.mark.parametrize(
    "recipe, accumulation",
    [("record-2025-01", 1), ("unet-value-embed-2024-12", 2)],  # 8 GPUs' shape; gradients kept alive
)
def test_estimate_is_within_15_percent_of_a_fake_tensor_measurement(recipe, accumulation):
    cfg = full_size(recipe, accumulation)
    measured = fake_peak_bytes(cfg)
    estimate = estimate_memory(cfg, 1, compiled=False)
    assert estimate.weights == measured["weights"]  # parameters and buffers, exactly
    assert estimate.backward_start == pytest.approx(measured["peak"], rel=0.15), (estimate, measured)
    assert estimate.validation == pytest.approx(measured["validation"], rel=0.15), (estimate, measured)
    assert estimate.total > 40 * GiB  # the 65,536-token logits dominate: this is the full-size step


@pytest.mark.parametrize(
    "recipe, log_mib",
    [
        ("record-2025-01", 37653),  # records/track_1_short/2025-01-16_Sub3Min/*.txt
        ("bos-align-2025-07", 33644),  # records/track_1_short/2025-07-12_BosAlign/0c5449cc-….txt
        ("yarn-2025-09", 32470),  # records/track_1_short/2025-09-10_Yarn/0ecdb695-….txt
    ],
)
def test_compiled_estimate_is_near_the_records_own_peak(recipe, log_mib):
    """The record logs (8xH100, compiled) end with `peak memory allocated: <log_mib> MiB`; the 2025-07
    one is its validation forward (4 x 65,536-token rows)."""
    estimate = estimate_peak_bytes(load_recipe(recipe, ["train.dtype=bf16"]), 8, compiled=True)
    assert estimate == pytest.approx(log_mib * 2**20, rel=0.15)


def device_with(monkeypatch, free_gib: float, total_gib: float = 80.0) -> None:
    """The guard's one reading of the device, injected (the CUDA branch, tested on CPU)."""
    monkeypatch.setattr(memory, "device_memory", lambda device: (int(free_gib * GiB), int(total_gib * GiB)))


def refusal(cfg, world: int, compiled: bool) -> str:
    with pytest.raises(SpeedrunError) as info:
        check_fits(cfg, world, compiled, CUDA)
    assert info.value.exit_code == 1
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_step_that_fits_passes_and_returns_its_estimate(monkeypatch):
    cfg = load_recipe("record-2025-01", ["train.dtype=bf16"])
    device_with(monkeypatch, free_gib=79)
    assert check_fits(cfg, 8, True, CUDA) == estimate_peak_bytes(cfg, 8, True)


def test_eager_that_does_not_fit_is_told_to_compile(monkeypatch):
    cfg = load_recipe("record-2025-01", ["train.dtype=bf16"])
    free = (estimate_peak_bytes(cfg, 8, True) + estimate_peak_bytes(cfg, 8, False)) / 2 / GiB
    device_with(monkeypatch, free_gib=free)
    message = refusal(cfg, 8, compiled=False)
    assert message.endswith("run with train.compile=on (eager saves more)"), message
    assert f"{estimate_peak_bytes(cfg, 8, False) / GiB:,.1f} GiB per process" in message


def suggested(message: str, recipe: str, *base: str):
    overrides = message.split("run with ")[1].split()
    return overrides, load_recipe(recipe, [*base, *overrides])


@pytest.mark.parametrize("recipe", ["untied-2024-11", "record-2025-01"])
def test_too_large_a_micro_batch_is_told_the_largest_that_fits(monkeypatch, recipe):
    """untied: 64 rows of 1,024 tokens, fewer rows fit; record: one row of 65,536, a shorter row fits."""
    base = ["train.dtype=bf16", "train.compile=on"]
    cfg = load_recipe(recipe, base)
    free = 0.6 * estimate_peak_bytes(cfg, 1, True)
    device_with(monkeypatch, free_gib=free / GiB)
    overrides, fitted = suggested(refusal(cfg, 1, compiled=True), recipe, *base)
    assert guarded_bytes(fitted, 1, True) <= free
    key = overrides[-1].split("=")[0]
    assert key == "train.micro_batch_tokens", overrides
    t = fitted.train
    larger = [n for n in range(t.micro_batch_tokens + t.seq_len, cfg.train.micro_batch_tokens, t.seq_len)]
    for micro in larger:  # every larger micro-batch of the same rows that divides the step does not fit
        if t.global_batch_tokens % micro == 0:
            bigger = load_recipe(recipe, [*base, *overrides[:-1], f"train.micro_batch_tokens={micro}"])
            assert guarded_bytes(bigger, 1, True) > free


def test_a_compiled_step_needs_the_measured_margin_free(monkeypatch):
    """Free memory between the estimate and 1.2x of it: a compiled step is refused (the H100 peaks
    measured 1.09-1.16x the compiled estimate), an eager one of the same estimate would start."""
    cfg = load_recipe("record-2025-01", ["train.dtype=bf16"])
    estimate = estimate_peak_bytes(cfg, 8, True)
    device_with(monkeypatch, free_gib=1.1 * estimate / GiB)
    assert "x1.2 measured margin" in refusal(cfg, 8, compiled=True)
    device_with(monkeypatch, free_gib=1.21 * estimate / GiB)
    assert check_fits(cfg, 8, True, CUDA) == estimate


def test_nothing_fits_says_so(monkeypatch):
    cfg = load_recipe("record-2025-01", ["train.dtype=bf16"])
    device_with(monkeypatch, free_gib=1)
    assert refusal(cfg, 8, compiled=True).endswith("and no smaller micro-batch fits")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["record-2026-07", "stages-2025-12"])  # FP8 MLP; bf16 MLP
def test_compiled_estimate_is_within_15_percent_of_the_compiled_varlen_partition(recipe):
    """What inductor's min-cut partition of the compiled varlen step saves, plus its backward's largest
    working set (tests/fake_compiled_memory.py), against the guard's compiled activations and logits, at
    the record's micro-batch (49,152 tokens; fake tensors, so full size costs only the trace)."""
    cfg = load_recipe(recipe, ["train.dtype=bf16"])
    counted = compiled_saved_bytes(cfg)
    estimate = estimate_memory(cfg, 1, compiled=True)
    assert estimate.weights == pytest.approx(counted["weights"], abs=2**10)  # the same model
    modelled = estimate.activations + estimate.logits
    assert modelled == pytest.approx(counted["saved"] + counted["backward"], rel=0.15), (estimate, counted)


def test_the_estimate_counts_the_ships_accumulators_as_the_ships_allocate_them():
    """#92's terminal ships hold fp32 accumulators of this process's chunk of each shipped bank: the
    estimate's optimizer share grows by exactly what `Ships` allocates on one process, and by a world's
    chunk on 8."""
    from speedrun.model.families import build_model
    from speedrun.optim.ships import Ships, accumulator_bytes
    from tests.recipe_matrix import shrink

    cfg = load_recipe("anvil-2026-08", shrink("anvil-2026-08"))
    off = ["tail_ema_window=0", "tail_avg_window=0", "value_embed_window=0", "bank_blend_window=0"]
    off = [f"optim.ships.{o}" for o in [*off, "decontract=false"]]
    without = load_recipe("anvil-2026-08", [*shrink("anvil-2026-08"), *off])
    assert cfg.optim.ships.on() and not without.optim.ships.on()
    model = build_model(cfg.model)
    ships = Ships(model, cfg.optim.ships, cfg.train.steps)
    held = sum(a.numel() * a.element_size() for ship in ships.ships for a in ship.acc.values())
    assert held > 0 and accumulator_bytes(model, cfg.optim.ships, cfg.train.steps, 1) == held
    for world in (1, 8):
        grown = (
            estimate_memory(cfg, world, False).optimizer - estimate_memory(without, world, False).optimizer
        )
        assert grown == accumulator_bytes(model, cfg.optim.ships, cfg.train.steps, world)
    assert accumulator_bytes(model, cfg.optim.ships, cfg.train.steps, 8) < held  # each process its chunk
