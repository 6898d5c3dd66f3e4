"""Host -> device transfer of token batches: pinned buffers and non-blocking copies on CUDA."""

from __future__ import annotations

import torch


class DeviceFeed:
    """Host -> device transfer: on CUDA through pinned buffers and non-blocking copies (a buffer is
    reused only after the event recorded behind its last copy has completed)."""

    def __init__(self, device: torch.device, shape: tuple[int, int], slots: int = 3):
        self.device = device
        self.cuda = device.type == "cuda"
        self._slots = []
        if self.cuda:
            for _ in range(slots):
                pair = tuple(torch.empty(shape, dtype=torch.int64).pin_memory() for _ in range(2))
                self._slots.append([pair, None])
        self._next = 0

    def claim(self) -> int:
        slot = self._next
        self._next = (self._next + 1) % max(1, len(self._slots))
        return slot

    def stage(self, slot: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy into the pinned slot (worker thread); a no-op off CUDA."""
        if not self.cuda:
            return x, y
        (hx, hy), event = self._slots[slot]
        if event is not None:
            event.synchronize()
        hx.copy_(x)
        hy.copy_(y)
        return hx, hy

    def send(self, slot: int, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Issue the device copies (calling thread's stream)."""
        if not self.cuda:
            return (x, y) if self.device.type == "cpu" else (x.to(self.device), y.to(self.device))
        dx, dy = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._slots[slot][1] = event
        return dx, dy
