"""#92's mixed-width attention (`model.attn.narrow_layers`, `narrow_v_layers`, `narrow_scale`) against
record #92's CausalSelfAttention (PR #360; the refactor's track_1_short/model/attention.py, its non-FP8
validation path): the banks keep full-width heads, a narrow layer reads the leading 64 of each head's
Q/K rows (the record's interleaved pairs: its rotating half), and a narrow-V layer the leading 64 of each
head's V rows and O columns; QK-norm over the narrow width, a fully rotating rotary on the record's 32
shared frequencies, the layer's own scale (0.13), and YaRN by the short window for the narrow chain.

The record's per-head math is #344's (tests/fidelity/test_qk_head_dim.py transcribes it: the λ0-scaled QKV of
cat(qk_w, v_w), QK-norm and interleaved rotary, the document-windowed attention, λ1·O), given the cut
weights; this file cuts them as #92 does and compares our layer's output and every gradient."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from speedrun.errors import ConfigError
from speedrun.model.families import build_model
from speedrun.model.gpt2026 import windows
from speedrun.train.stages import short_window_history
from tests.fidelity.test_qk_head_dim import record_344_attention, record_order, tiny

H, D = 4, 32  # tiny(): 4 heads of 32; the narrow width is 16 (#92: 64 of 128)


def record_92_freq(width: int) -> torch.Tensor:
    """#92's Yarn(width).angular_freq before any update: ROTARY_DIM = the narrow width, its frequencies
    (1/1024)^linspace(0, 1, width/2) each held twice, none stationary on a narrow head."""
    return (1 / 1024) ** torch.linspace(0, 1, steps=width // 2).repeat_interleave(2)


def with_attn(cfg, **fields):
    """The model config with `[model.attn]` fields replaced."""
    return dataclasses.replace(cfg, attn=dataclasses.replace(cfg.attn, **fields))


def narrow_model(narrow_v: bool, paired: bool):
    torch.manual_seed(0)
    cfg = tiny(0)
    layer = next(i for i in cfg.attention_layers if i not in cfg.attn.key_offset_layers)
    cfg = with_attn(cfg, narrow_layers=[layer], narrow_v_layers=[layer] if narrow_v else [])
    model = build_model(cfg).float()
    attn = model.blocks[layer].attn
    attn.paired, attn.gate, attn.xsa = paired, None, None
    return model, attn


@pytest.mark.parametrize("narrow_v,paired", [(False, False), (True, False), (True, True), (False, True)])
def test_a_narrow_layer_is_92s_layer_on_the_cut_bank_rows(narrow_v, paired):
    model, attn = narrow_model(narrow_v, paired)
    Dn, Dv = D // 2, D // 2 if narrow_v else D
    assert (attn.qk_dim, attn.v_dim) == (Dn, Dv)
    assert attn.c_attn.weight.shape == (3 * H * D, H * D), "the weights stay full width"
    with torch.no_grad():
        attn.c_attn.weight.normal_(0, 0.2)
        attn.c_proj.weight.normal_(0, 0.2)
        attn.lambdas.copy_(torch.tensor([0.7, 1.3]))
    T, window = 96, 40
    cu = torch.tensor([0, 30, 77, 96, 96], dtype=torch.int32)
    x = torch.randn(1, T, H * D, requires_grad=True)
    k = 2 if paired else 1
    out, _ = attn(x, windows.Packed(k * cu, window, k * T, k * T))
    g = torch.randn_like(out)
    (out * g).sum().backward()

    # the record's bank rows: ours with each head's Q/K rows in its interleaved order, then its cut
    w = attn.c_attn.weight.detach()
    bank_qk = w[: 2 * H * D][record_order(D, H)]
    qk_w = bank_qk.view(2 * H, D, -1)[:, :Dn].reshape(2 * H * Dn, -1).clone().requires_grad_(True)
    v_w = w[2 * H * D :].view(H, D, -1)[:, :Dv].reshape(H * Dv, -1).clone().requires_grad_(True)
    o_rec = attn.c_proj.weight.detach().view(-1, H, D)[:, :, :Dv].reshape(-1, H * Dv)  # [C, H·v_dim]
    o_w = o_rec.T.clone().requires_grad_(True)
    lam = attn.lambdas.detach().clone().requires_grad_(True)
    xr = x.detach()[0].clone().requires_grad_(True)
    ref = record_344_attention(xr, qk_w, v_w, o_w, lam, cu, window - 1, paired, False, H, 0.13,
                               record_92_freq(Dn))  # fmt: skip
    (ref * g[0]).sum().backward()
    close = dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(out[0], ref, **close)
    torch.testing.assert_close(x.grad[0], xr.grad, **close)
    gw = attn.c_attn.weight.grad
    g_bank = gw[: 2 * H * D][record_order(D, H)].view(2 * H, D, -1)
    torch.testing.assert_close(g_bank[:, :Dn].reshape(2 * H * Dn, -1), qk_w.grad, **close)
    assert g_bank[:, Dn:].abs().sum() == 0, "the rows a narrow head does not read get no gradient"
    g_v = gw[2 * H * D :].view(H, D, -1)
    torch.testing.assert_close(g_v[:, :Dv].reshape(H * Dv, -1), v_w.grad, **close)
    assert g_v[:, Dv:].abs().sum() == 0
    g_o = attn.c_proj.weight.grad.view(-1, H, D)
    torch.testing.assert_close(g_o[:, :, :Dv].reshape(-1, H * Dv), o_w.grad.T, **close)
    assert g_o[:, :, Dv:].abs().sum() == 0
    torch.testing.assert_close(attn.lambdas.grad, lam.grad, **close)


def record_yarn(freq: torch.Tensor, scale: float, wins: list[int]) -> tuple[torch.Tensor, float]:
    """#92's Yarn.apply(old, new) over `wins` (tokens), alpha 1, beta 32."""
    for old, new in zip(wins[:-1], wins[1:], strict=True):
        rotations = old * freq / (2 * torch.pi)
        factor = old / new
        weight = torch.clamp((rotations - 1) / (32 - 1), 0, 1)
        freq = freq * (factor + weight * (1 - factor))
        scale *= 0.2 * math.log(new / old) + 1
    return freq, scale


def test_the_narrow_chain_follows_the_short_windows_and_the_wide_the_long():
    """#92's ForwardConfig.at: yarn_wide.apply(old_long, long); the narrow tables apply(old_short, short)."""
    model, narrow = narrow_model(False, False)
    wide = [b.attn for b in model.blocks if b.attn is not None and not b.attn.narrow_qk]
    long, short = [384, 896, 1408], [128, 384, 640]
    windows.apply_yarn(model, long, short)
    f_n, s_n = record_yarn(record_92_freq(D // 2), 0.13, short)
    assert narrow.scale == pytest.approx(s_n, rel=1e-12)
    wide_freq = torch.cat([record_92_freq(D // 2), torch.zeros(D // 2)])  # a full head: half turns
    f_w, s_w = record_yarn(wide_freq, model.cfg.attn.scale, long)
    assert wide and all(a.scale == pytest.approx(s_w, rel=1e-12) for a in wide)
    for rotary, freq in ((narrow.rotary, f_n), (wide[0].rotary, f_w)):
        assert rotary.cos.shape[-1] == freq.numel() // 2
        theta = torch.outer(torch.arange(rotary.cos.size(0), dtype=torch.float32), freq[0::2])
        torch.testing.assert_close(rotary.cos.float(), theta.cos(), rtol=0, atol=1e-5)
        torch.testing.assert_close(rotary.sin.float(), theta.sin(), rtol=0, atol=1e-5)
    assert narrow.rotary is not wide[0].rotary


def test_the_short_window_history_of_a_stage_plan():
    from speedrun.config.stages import stage_plan
    from speedrun.recipes import load_recipe

    plan = stage_plan(load_recipe("record-2026-07"))  # windows 1/3, 3/7, 5/11, 6/13 (ext), val 6/20
    ends = [0, 459, 460, 920, 1380, 1389, 1390]
    got = [short_window_history(s, plan) for s in ends]
    assert got == [(1,), (1,), (1, 3), (1, 3, 5), (1, 3, 5, 6), (1, 3, 5, 6), (1, 3, 5, 6)]


def test_without_narrow_layers_the_model_is_unchanged_bit_for_bit():
    torch.manual_seed(0)
    a = build_model(tiny(0)).float()
    torch.manual_seed(0)
    b = build_model(with_attn(tiny(0), narrow_layers=[], narrow_v_layers=[])).float()
    idx = torch.randint(0, 119, (1, 64))
    assert torch.equal(a(idx, idx), b(idx, idx))


def test_bad_narrow_layers_are_refused_in_one_line():
    from speedrun.config.gpt2026 import check

    cfg = tiny(0)
    offset = cfg.attn.key_offset_layers[0]
    plain = next(i for i in cfg.attention_layers if i not in cfg.attn.key_offset_layers)
    cases = [
        (dict(narrow_layers=[offset]), "key offset"),
        (dict(narrow_layers=[plain], narrow_v_layers=[plain + 100]), "distinct layers"),
        (dict(narrow_layers=[], narrow_v_layers=[plain]), "among model.attn.narrow_layers"),
        (dict(narrow_layers=[plain], narrow_scale=0.0), "narrow_scale"),
        (dict(narrow_layers=[plain], qk_head_dim=24), "exclude each other"),
        (dict(narrow_scale=0.2), "read only with model.attn.narrow_layers"),
    ]
    for fields, message in cases:
        with pytest.raises(ConfigError, match=message):
            check(with_attn(cfg, **fields))


@pytest.mark.slow
def test_the_shrunk_record_with_a_narrow_paired_layer_trains_through_the_loop(text_data, tmp_path):
    """The loop on record-2026-07 shrunk, its short paired layer narrow in Q/K and V/O (#92's (64, 64)
    geometry on a paired layer): stages with YaRN on both chains, finite losses and a validation."""
    import json

    from speedrun.recipes import load_recipe
    from speedrun.train import loop
    from tests.recipe_matrix import shrink

    eot = json.loads((text_data / "meta.json").read_text())["eot_id"]
    over = [*shrink("record-2026-07"), f"data.dir={text_data}", "data.tokenizer=bpe:512",
            f"model.eot_id={eot}",
            "model.attn.narrow_layers=[1]", "model.attn.narrow_v_layers=[1]", "train.steps=6",
            "train.log_every=1", "data.max_docs=0", "train.val_tokens=1024"]  # fmt: skip
    cfg = load_recipe("record-2026-07", over)
    assert cfg.model.attn.yarn and cfg.model.attn.paired_layers == [1]
    loop.train(cfg, tmp_path / "run")
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train_loss"] for r in lines if "train_loss" in r]
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)
    assert any("val_loss" in r and math.isfinite(r["val_loss"]) for r in lines)
