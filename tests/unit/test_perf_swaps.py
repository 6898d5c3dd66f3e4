"""The speed layer's switch (issue 44): named plain ops (speedrun/ops.py) that `speedrun.perf.swaps`
replaces from outside the algorithm, once, before the model is built; `train.perf=off`, and `auto` on the
CPU, leave every op its plain body, so a CPU run computes exactly what it did before the layer existed."""

from __future__ import annotations

import importlib

import pytest
import torch

from speedrun import ops
from speedrun.perf import swaps
from speedrun.perf.kernels import REPLACES
from tests.unit.test_import_rules import graphs

head = importlib.import_module("speedrun.model.gpt2026.head")
ortho = importlib.import_module("speedrun.optim.orthogonalize")

#: the algorithm: none of it imports the speed layer, at import time or inside a function
ALGORITHM = ("speedrun.model", "speedrun.optim", "speedrun.config", "speedrun.data", "speedrun.ops")
ALGORITHM_TRAIN = ("speedrun.train.step", "speedrun.train.schedule", "speedrun.train.stages")


def test_nothing_in_the_algorithm_imports_the_speed_layer():
    _, both = graphs()
    algorithm = [m for m in both if m.startswith(ALGORITHM) or m in ALGORITHM_TRAIN]
    assert len(algorithm) > 50, algorithm
    bad = {m: sorted(n for n in both[m] if n.startswith("speedrun.perf")) for m in algorithm}
    assert not any(bad.values()), {m: b for m, b in bad.items() if b}
    assert "speedrun.perf.swaps" in both["speedrun.train.loop"]  # the set-up installs it, from outside


def test_every_kernel_replaces_a_declared_op_and_install_puts_the_plain_bodies_back():
    assert set(REPLACES) <= set(ops.names())
    calls = []
    ops.install("gram", lambda x: calls.append(x.shape) or x @ x.mT)
    try:
        x = torch.randn(2, 3, 5)
        ortho.gram(x)
        assert calls == [(2, 3, 5)] and set(ops.installed()) == {"gram"}
    finally:
        assert swaps.install("auto", torch.device("cpu")) == ()
    assert ops.installed() == {}
    ortho.gram(x)
    assert len(calls) == 1


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_on_the_cpu_both_settings_choose_the_plain_ops(mode):
    assert swaps.chosen(mode, torch.device("cpu")) == ()
    assert swaps.describe(mode) == f"speed layer: plain ops (train.perf={mode})"


def test_on_cuda_auto_chooses_every_kernel_and_off_none(monkeypatch):
    monkeypatch.setattr(swaps, "on_cuda", lambda device: True)
    assert swaps.chosen("auto", torch.device("cpu")) == tuple(sorted(REPLACES))
    assert swaps.chosen("off", torch.device("cpu")) == ()
    monkeypatch.setattr(swaps, "has_triton", lambda: False)
    assert swaps.chosen("auto", torch.device("cpu")) == ()


def test_train_perf_is_a_typed_setting():
    from speedrun.errors import ConfigError
    from speedrun.recipes import load_recipe

    assert load_recipe("demo").train.perf == "auto"
    assert load_recipe("demo", ["train.perf=off"]).train.perf == "off"
    with pytest.raises(ConfigError, match="train.perf"):
        load_recipe("demo", ["train.perf=on"])


@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("mtp", [None, (1.0, 0.5, 0.25)])
def test_the_softcapped_training_loss_is_bit_for_bit_the_capped_logits_path(mtp, prefix):
    """The op the model's training forward now calls (raw logits → softcap → CE or MTP, plus #88's
    prefix term) against the path it replaced (capped_logits, then loss, then prefix.prefix_loss), in
    the record's bf16 cap and CE and in fp32."""
    from speedrun.config.gpt2026.head import HeadConfig
    from speedrun.model.gpt2026 import prefix as prefix_loss
    from speedrun.model.layers import CastedLinear

    torch.manual_seed(0)
    lm_head = CastedLinear(32, 96, bias=False)
    x = torch.randn(2, 9, 32)
    targets = torch.randint(0, 96, (2, 9))
    weights = None if mtp is None else torch.tensor(mtp)
    table = torch.randint(-40, 96, (96,)).clamp(min=-1) if prefix else None
    pw = torch.tensor(0.25) if prefix else None
    for bf16 in (False, True):
        part = HeadConfig(softcap=11.5, softcap_divisor=7.5, softcap_offset=5.0, softcap_in_bf16=bf16,
                          ce_bf16=bf16, fp8=False, mtp=0 if mtp is None else 3)  # fmt: skip
        lm_head.zero_grad()
        got = head.training_loss(lm_head, x, targets, part, weights, table, pw)
        got.backward()
        g = lm_head.weight.grad.clone()
        lm_head.zero_grad()
        logits = head.capped_logits(lm_head, x, part)
        want = head.loss(logits, targets, part, True, "mean", weights)
        if prefix:  # model.py's path before the op: on the capped logits, fp32 unless ce_bf16
            want = want + prefix_loss.prefix_loss(logits if bf16 else logits.float(), targets, table, pw)
        want.backward()
        assert torch.equal(got, want) and torch.equal(g, lm_head.weight.grad)


@pytest.mark.parametrize("transposed", [False, True])
def test_the_relu2_mlp_through_its_op_is_bit_for_bit_the_module_path(transposed):
    """The MLP's forward now calls `relu2_linear` with its up-projection's cast weight: the same values
    and gradients as calling the up-projection module, then ReLU, then square (#27's transposed one too)."""
    from speedrun.model.layers import MLP

    torch.manual_seed(0)
    mlp = MLP(16, 48, bias=False, relu2=True, fc_transposed=transposed)
    x = torch.randn(3, 5, 16)
    got = mlp(x)
    got.sum().backward()
    grads = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    want = mlp.c_proj(torch.relu(mlp.c_fc(x)).square())
    want.sum().backward()
    assert torch.equal(got, want)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, mlp.parameters(), strict=True))
