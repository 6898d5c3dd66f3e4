"""The training step accumulates as the records do: each micro-batch back-propagates its own mean loss,
and the summed gradients are divided by the number of micro-batches after the last backward."""

import pytest
import torch

from speedrun.optim.build import RunOptimizer
from speedrun.train.step import train_step


class Probe(torch.nn.Module):
    """A linear model whose loss records the gradient that flows into it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 1)
        self.loss_grads: list[float] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = ((self.lin(x).squeeze(-1) - y) ** 2).mean()
        loss.register_hook(lambda g: self.loss_grads.append(float(g)))
        return loss


class Recorder(torch.optim.Optimizer):
    """Keeps the gradients it is asked to step with; changes nothing."""

    def __init__(self, params):
        super().__init__(params, {"lr": 0.0})
        self.seen: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        self.seen.append([p.grad.clone() for g in self.param_groups for p in g["params"]])


def test_each_micro_batch_backpropagates_its_own_loss_and_the_sum_is_divided_after():
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 8, generator=gen), torch.randn(4, generator=gen)) for _ in range(3)]
    model = Probe()
    recorder = Recorder(model.parameters())
    it = iter(batches)
    loss = train_step(model, RunOptimizer({"adam": recorder}), lambda: next(it), 3, dtype=None)
    assert model.loss_grads == [1.0, 1.0, 1.0]  # the records' loss.backward(), not (loss / 3).backward()
    # the record's order: accumulate the three gradients, then p.grad /= 3
    reference = Probe()
    for x, y in batches:
        reference(x, y).backward()
    for got, p in zip(recorder.seen[0], reference.parameters(), strict=True):
        torch.testing.assert_close(got, p.grad / 3, rtol=0, atol=0)
    assert float(loss) == pytest.approx(sum(float(Probe()(x, y)) for x, y in batches) / 3, rel=1e-6)
