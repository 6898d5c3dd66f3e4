"""Reductions launched from backward hooks (speedrun/perf/overlap.py) against the optimizer's own
post-backward launch (optim/sharded.py): on 2 gloo processes (tests/overlap_check.py, in
tests/two_processes.py's one launch) the parameters after 4 steps are equal bit for bit, the wire
carries the same collectives in the same order, and most of them, the first included, are issued while
the backward runs; in one process, the hooks launch in the step's order whatever order autograd
finishes the gradients in, only on the last micro-batch, and leave the gradients as they were."""

from __future__ import annotations

import pytest
import torch

from speedrun.perf import overlap
from speedrun.perf.overlap import BackwardReductions
from tests.two_processes import SHARED


@pytest.mark.slow
@SHARED
@pytest.mark.parametrize("recipe", ["demo-normuon", "record-2026-07"])
def test_hooked_reductions_equal_the_post_backward_path_bit_for_bit_on_two_processes(recipe, library_results):
    found = library_results["overlap"][recipe]
    assert found["equal"] and found["equal_across_ranks"], found
    assert found["same_collectives"], found  # same kinds and shapes, same order
    assert found["in_backward_plain"] == 0 and found["first_in_backward"], found
    # every bank on every step, and the Adam rows up to the tied head
    assert found["in_backward_hooked"] >= found["reductions"] // 2, found
    assert found["accumulation"] == 2  # the hooks armed on the second micro-batch only


class FakeTable:
    """reduction_order/launch as ShardedNorMuonAdam has them; records what is launched when."""

    def __init__(self, rows, order):
        self.rows, self._order, self.launched = rows, order, []

    def reduction_order(self):
        return self._order

    def launch(self, item, finish):
        grads = [finish(r.param.grad.clone()) for r in (item if isinstance(item, list) else [item])]
        self.launched.append((item.name if not isinstance(item, list) else "bank", grads))


class FakeRow:
    def __init__(self, name, param):
        self.name, self.param = name, param


def test_hooks_launch_in_the_steps_order_on_the_last_micro_batch_with_train_steps_scaling(monkeypatch):
    """A chain a → b → c: autograd finishes c's gradient first, a's last. The order asks for a, then c,
    then b: a's launch waits for a (the last to finish), then c and b follow at once; on the first of two
    micro-batches nothing launches; each launched copy is divided by 2 and scaled by 0.7 with the foreach
    ops train_step uses, and the gradients themselves stay unscaled."""
    a, b, c = (torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16)) for _ in range(3))
    rows = [FakeRow(n, p) for n, p in zip("abc", (a, b, c), strict=True)]
    monkeypatch.setattr(overlap, "_needs", lambda item: {id(item.param)})
    table = FakeTable(rows, [rows[0], rows[2], rows[1]])
    hooks = BackwardReductions(table)
    finished = []
    for p, name in ((a, "a"), (b, "b"), (c, "c")):
        p.register_post_accumulate_grad_hook(lambda _, name=name: finished.append(name))
    x = torch.randn(4, dtype=torch.bfloat16)
    (((x * a).sum() * b).sum() * c).sum().backward()  # micro-batch 1: not armed
    assert table.launched == []
    with hooks.last_backward(2, 0.7):
        (((x * a).sum() * b).sum() * c).sum().backward()
    assert finished[-3:] == ["c", "b", "a"]  # autograd's order
    assert [name for name, _ in table.launched] == ["a", "c", "b"]  # the step's order
    for (name, (got,)), row in zip(table.launched, [rows[0], rows[2], rows[1]], strict=True):
        want = [row.param.grad.clone()]
        torch._foreach_div_(want, 2)
        torch._foreach_mul_(want, 0.7)
        assert torch.equal(got, want[0]), name
    hooks.remove()
