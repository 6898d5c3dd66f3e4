"""Stopping on SIGINT/SIGTERM at a step boundary, with every rank agreeing on the step."""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any

from speedrun.errors import SpeedrunError


class RunInterrupted(SpeedrunError):
    """SIGINT/SIGTERM: a checkpoint was saved at a step boundary; the run can be resumed."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum  # the shell convention: 130 for SIGINT, 143 for SIGTERM


class StopSignals:
    """First SIGINT/SIGTERM asks for a clean stop at the next step boundary; a second one exits at once."""

    def __init__(self, announce: bool = True) -> None:
        self.received: int | None = None
        self.announce = announce  # rank 0 says at once that the signal was heard
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None:
            os._exit(128 + signum)
        self.received = signum
        if self.announce:  # os.write: safe inside a signal handler, unlike print
            name = signal.Signals(signum).name
            os.write(
                2,
                f"\n{name} received: stopping at the next log point with a checkpoint "
                "(send it again to exit at once, without one)\n".encode(),
            )

    def install(self) -> StopSignals:
        with contextlib.suppress(ValueError):  # signals can only be caught in the main thread
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
