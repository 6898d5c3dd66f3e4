"""Stopping on SIGINT/SIGTERM/SIGHUP at a step boundary, with every rank agreeing on the step (SIGHUP, a
closed terminal, would otherwise kill the run and lose the steps since the last checkpoint)."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path
from typing import Any

from speedrun.errors import Stopped

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class RunInterrupted(Stopped):
    """SIGINT/SIGTERM/SIGHUP: a checkpoint was saved at a step boundary and the run can be resumed; the
    CLI prints `speedrun: <message>` (no "error:") and exits with 128 + the signal number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum  # the shell convention: 130 SIGINT, 143 SIGTERM, 129 SIGHUP

    @classmethod
    def after(cls, signum: int, step: int, checkpoint: Path | None, run_dir: Path) -> RunInterrupted:
        """The standard stop: what stopped it, what was saved, and the command that goes on."""
        name = signal.Signals(signum).name
        saved = f"saved checkpoint {checkpoint}" if checkpoint is not None else "saved a checkpoint"
        return cls(
            f"stopped by {name} after step {step}; {saved}; resume with: speedrun train --resume {run_dir}",
            signum,
        )


class StopSignals:
    """The first stop signal asks for a clean stop at the next step boundary; a second exits at once."""

    def __init__(self, announce: bool = True) -> None:
        self.received: int | None = None
        self.announce = announce  # rank 0 says at once that the signal was heard
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, _frame: object) -> None:
        if self.received is not None:
            os._exit(128 + signum)
        self.received = signum
        if self.announce:  # say at once that the signal was heard (rank 0 only)
            name = signal.Signals(signum).name
            note = (
                f"\nspeedrun: {name} received: stopping at the next log point and saving a checkpoint "
                "(send it again to quit at once without saving)\n"
            )
            with contextlib.suppress(OSError):
                os.write(2, note.encode())  # os.write: safe inside a signal handler, unlike print

    def install(self) -> StopSignals:
        with contextlib.suppress(ValueError):  # signals can only be caught in the main thread
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
