"""TensorBoard events read back with tensorboard's own reader; W&B only when asked; MFU helpers."""

import importlib.util
import itertools
import time

import pytest
import torch

from speedrun.errors import ConfigError
from speedrun.train.run.tracking import Tracker, datasheet_peak, format_mfu, measured_matmul_peak, mfu


def test_scalars_are_readable_with_tensorboards_reader(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = Tracker(tmp_path)
    logged = {1: 5.5, 2: 5.25, 3: 4.875}
    for step, loss in logged.items():
        tracker.log(step, {"train_loss": loss, "lr": 0.5 * step, "val_bpb": None})
    tracker.log(3, {"val_loss": 4.75})
    tracker.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"train_loss", "lr", "val_loss"}  # None is skipped
    assert [(e.step, e.value) for e in events.Scalars("train_loss")] == list(logged.items())
    assert [(e.step, e.value) for e in events.Scalars("lr")] == [(1, 0.5), (2, 1.0), (3, 1.5)]
    assert [(e.step, e.value) for e in events.Scalars("val_loss")] == [(3, 4.75)]


def test_disabled_tracker_writes_nothing(tmp_path):
    tracker = Tracker(tmp_path, enabled=False)
    tracker.log(1, {"train_loss": 1.0})
    tracker.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed")
def test_wandb_asked_for_but_missing_is_a_clear_config_error(tmp_path):
    with pytest.raises(ConfigError, match="needs the wandb package"):
        Tracker(tmp_path, wandb_project="speedrun")


def test_mfu_and_datasheet_peaks():
    # 6 * 124M params per token at 1M tokens/s on an H100 SXM: 744 TFLOP/s of 989.4
    assert mfu(6 * 124e6, 1e6, 989.4e12) == pytest.approx(6 * 124e6 * 1e6 / 989.4e12)
    assert datasheet_peak("NVIDIA H100 80GB HBM3") == 989.4e12
    assert datasheet_peak("NVIDIA H100 PCIe") == 756.5e12
    assert datasheet_peak("NVIDIA H200") == 989.4e12
    assert datasheet_peak("NVIDIA A100-SXM4-80GB") == 312e12
    assert datasheet_peak("cpu") is None
    with pytest.raises(AssertionError):  # the peak is matmul_peak's, never zero
        mfu(1.0, 1.0, 0.0)


def test_mfu_is_never_above_100_percent():
    assert mfu(1.0, 2.0, 4.0) == 0.5 and mfu(1.0, 4.0, 4.0) == 1.0
    assert mfu(1.0, 5.0, 4.0) is None and mfu(1.0, 1.0, None) is None  # above the peak, no peak: none
    assert format_mfu(0.4123) == "41.2%" and format_mfu(None) == "-"


def test_the_probe_is_a_median_of_one_thread_calls_for_at_least_its_budget(monkeypatch):
    """A short best-of probe under-measured the peak (the demo printed MFU 92.6-100 %): the probe repeats
    one-thread calls for at least its budget and takes their median, times the run's threads."""
    from speedrun.train.run import tracking

    rates = itertools.chain([1e12], itertools.cycle([2e9, 9e9, 2e9, 1e9, 2e9]))  # sizing, a spike, a dip
    seen = []

    def fake(device, size, dtype):
        seen.append(torch.get_num_threads())
        return next(rates)

    monkeypatch.setattr(tracking, "measured_matmul_peak", fake)
    threads = torch.get_num_threads()
    start = time.perf_counter()
    peak = tracking.probe_matmul_peak(torch.device("cpu"), torch.float32, budget_s=0.05)
    assert time.perf_counter() - start >= 0.05
    assert peak == 2e9 * threads and set(seen) == {1} and torch.get_num_threads() == threads


def test_measured_matmul_peak_is_a_plausible_rate():
    flops = measured_matmul_peak(torch.device("cpu"), 128, torch.bfloat16)
    assert 1e6 < flops < 1e15  # a real CPU does far more than a MFLOP/s and far less than a PFLOP/s
