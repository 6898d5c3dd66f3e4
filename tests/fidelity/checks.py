"""The check every whole-model fidelity test ends with: our loss against the record's, then (in training)
every parameter's gradient against the record's gradient of the same weights."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def assert_loss_and_gradients_are_the_records(
    model: torch.nn.Module, loss: Tensor, ref: Tensor, weights: dict[str, Tensor], T: int, training: bool
) -> None:
    """In training the record's summed loss over T tokens is our step's mean; at evaluation both are means.
    The loss to 1e-6 relative; every gradient to rtol 1e-4, atol 1e-6, named by its parameter."""
    ref = ref / T if training else ref
    assert math.isclose(loss.item(), ref.item(), rel_tol=1e-6), (loss.item(), ref.item())
    if not training:
        return
    loss.backward()
    ref.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, weights[name].grad, rtol=1e-4, atol=1e-6, msg=name)
