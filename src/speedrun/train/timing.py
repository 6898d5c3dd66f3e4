"""Training time without per-step host syncs: the device is waited for only when the clock stops."""

from __future__ import annotations

import time
from typing import Any

import torch


def wait_for_device(device: torch.device) -> None:
    """Block until queued work on `device` is done (CUDA runs asynchronously; the CPU never lags)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """Wall time of training steps, measured where the loop waits anyway: `start()` before a step, `stop()`
    at log and validation points; time while stopped never counts, nor steps in the timing warm-up.
    `starts` lists every start of the run (step, processes, hardware, timing warm-up); it travels in the
    checkpoints, so a resumed run's summary says how every step was timed (`verify`).
    `timed_through` (the last step a timed interval closed at: #344's extension steps are timed) and
    `eval_writes` (validations that wrote a weight or a gradient: #205) travel with them; None when
    resumed from a checkpoint that did not record them."""

    def __init__(self, device: torch.device):
        self.device = device
        self.timed_s = 0.0
        self.timed_steps = 0
        self._interval_s = 0.0  # running interval, across validation pauses inside it
        self._since: float | None = None
        self.starts: list[dict[str, Any]] = []
        self.timed_through: int | None = 0
        self.eval_writes: int | None = 0

    def start(self) -> None:
        if self._since is None:
            wait_for_device(self.device)  # the device is idle here: this returns at once
            self._since = time.perf_counter()

    def stop(self, steps: int = 0, timed: bool = False, through: int = 0) -> float:
        """Pause. With `steps` > 0, close the interval of those steps (ending after step `through`) and
        return its seconds."""
        if self._since is not None:
            wait_for_device(self.device)
            self._interval_s += time.perf_counter() - self._since
            self._since = None
        if steps <= 0:
            return 0.0
        seconds, self._interval_s = self._interval_s, 0.0
        if timed:
            self.timed_s += seconds
            self.timed_steps += steps
            if self.timed_through is not None:
                self.timed_through = max(self.timed_through, through)
        return seconds

    def mean_step_s(self, fallback: float = 0.0) -> float:
        """Mean seconds per timed step (`fallback` before any step was timed)."""
        return self.timed_s / self.timed_steps if self.timed_steps else fallback

    def state_dict(self) -> dict[str, Any]:
        return {
            "timed_s": self.timed_s,
            "timed_steps": self.timed_steps,
            "starts": self.starts,
            "timed_through": self.timed_through,
            "eval_writes": self.eval_writes,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.timed_s, self.timed_steps = float(state["timed_s"]), int(state["timed_steps"])
        # a checkpoint from before starts were kept: the earlier starts are unknown (only their step 0)
        self.starts = [dict(s) for s in state.get("starts", [{"step": 0}])]
        self.timed_through, self.eval_writes = state.get("timed_through"), state.get("eval_writes")


def format_duration(seconds: float, unknown: bool = False) -> str:
    """`1h05m` from an hour on, else `4m07s`; `?` when `unknown` (e.g. estimated from a compile step)."""
    if unknown:
        return "?"
    seconds = max(0, int(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"
