"""#85's MUDD gate network and DC correction (model/gpt2026/mudd.py `MuddGate`, dc.py) in the model, against
HEAD's train_gpt.py lines transcribed here (`init_mudd_gate`, `forward_mudd_gate`, `unpack_*_mudd_gate`,
`dc_gate`, `CausalSelfAttention.forward`'s tail, `GPT.forward`'s loop; unchanged from #85 through #89) on
identical tiny weights, with #81's MUDD from tests/fidelity/test_mudd.py."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from speedrun.errors import ConfigError
from speedrun.model.families import build_model
from speedrun.recipes import load_recipe
from tests.conftest import inductor_cpu_codegen
from tests.decoding import assert_cached_decoding_is_the_forward
from tests.fidelity.test_mudd import (
    BASE,
    H_SRC,
    OVER,
    S_SRC,
    _batch,
    _cfg,
    _close,
    _count,
    _loss_and_grads,
    _model,
    _ours,
    record_forward_mudd,
)
from tests.recipe_matrix import replace  # fmt: skip

MUDD_ON = [
    "model.residual_form=sublayer",
    "model.x0_lambda_apart=false",
    "model.backout_layer=0",
    "model.mudd_sources=[7,3]",
]
G = 2  # the shrunk gate layer (the record's 4): pre gate for layers 0, 1, post for 2..5
GATED = dict(mudd_gate_layer=G, mudd_gate_attn_layers=[1, 5], xsa_layers=[1, 3, 4], attn_gate=0, skip_gate=0)


def record_init_mudd_gate(dim: int):
    """`GPT.init_mudd_gate` (HEAD, #85 v3): (w1, w2 (2, 41, 64), b2 (2, 41), scale 0.1)."""
    w1 = torch.empty(2, 64, dim)
    w2 = torch.zeros(2, 41, 64)
    for j in range(2):
        torch.nn.init.kaiming_uniform_(w1[j], a=math.sqrt(5))
    bs = torch.zeros(2, 41)
    s = 0.1
    bs[0, 12:18].fill_(0.25 / s)
    bs[0, 19:26:2].fill_(0.05 / s)
    bs[1, 12:18].fill_(0.25 / s)
    bs[1, 19:28:2].fill_(0.05 / s)
    bs[1, 28].fill_(0.5 / s)
    bs[1, 29:35].fill_(1.0 / s)
    return w1, w2, bs, torch.tensor(0.1)


def record_forward_mudd_gate(gate, x, id, num_coef):
    """`GPT.forward_mudd_gate`."""
    x = F.gelu(F.linear(x, gate.w1[id]))
    return (F.linear(x, gate.w2[id, :num_coef]) + gate.b2[id, :num_coef]) * gate.scale.type_as(x)


def record_attention(b, h, mask, other_v, xsa_alpha, attn_gate_w, dc_w=None, starts=None):
    """Our attention's projection and call, then the record's tail (HEAD CausalSelfAttention.forward):
    its DC correction (`dc_gate`, then the kernel's math, transcribed in test_record_2026_07_parts), #86's
    XSA with a per-token α and the gate-network gate, on its (B, T, H, D) layout."""
    from speedrun.model.attention import attend
    from tests.fidelity.test_record_2026_07_parts import record_85_dc_correction

    a = b.attn
    q, k, v, _ = a.project(h, other_v)
    k = a.attended_keys(k)
    y = attend(q, k, v, mask, a.scale)
    if dc_w is not None:
        w1 = F.rms_norm(dc_w[0].float(), (q.size(1),), eps=1.0e-6).type_as(h)
        w2 = dc_w[1].type_as(h)
        y = record_85_dc_correction(
            *(t[0].transpose(0, 1) for t in (y, q, k, v)), w1[0], w2[0], a.scale, 112, starts
        ).transpose(0, 1)[None]
    if a.paired:
        assert xsa_alpha is None and attn_gate_w is None
        return a.output(y, h)
    B, H, T, D = y.shape
    y, v = y.transpose(1, 2), v.transpose(1, 2)
    if xsa_alpha is not None:
        dot = (y * v).sum(-1, keepdim=True)
        denom = v.square().sum(-1, keepdim=True).clamp_min(1e-8)
        alpha = torch.tanh(xsa_alpha).type_as(y).view(B, T, H, 1)
        y = y - alpha * (dot / denom) * v
    if attn_gate_w is not None:
        y = y * attn_gate_w.type_as(y).view(B, T, H, 1)
    assert a.xsa is None and a.gate is None
    return a.output(y.transpose(1, 2), h)


def record_hidden_gated(model, idx, g=G, h_src=H_SRC, s_src=S_SRC, dc=False):
    """HEAD's `GPT.forward` loop (#85 on #81, DC and FP8 aside), shrunk: the pre gate from x0 unpacked
    into XSA α of layer 1, the attention gate of layer 1, x0/bigram gates of layers 0, 1; the post gate
    at the start of layer g into XSA α of 3, 4, the attention gate of 5, x0/bigram gates of 3, 4, the skip."""
    cfg, blocks, n, H = model.cfg, model.blocks, model.cfg.n_layer, model.cfg.n_head
    masks = model.layer_masks(idx)
    x = x0 = model.embed_norm(model.smear(model.wte(idx)))
    x0_bigram = model.bigram(idx)
    tables = [emb(idx) for emb in model.value_embeds]
    ve = [tables[j] if j >= 0 else None for j in cfg.value_embeds]
    xsa_alphas, attn_gates, x0_gates, bigram_gates = [None] * n, [None] * n, [None] * n, [None] * n
    dc_weights = [None] * n
    starts = [0] + (idx[0] == cfg.eot_id).nonzero().flatten().tolist()  # the packed row's documents
    gate = model.mudd_gate
    pre = record_forward_mudd_gate(gate, x0, 0, 2 * H + 4)
    xsa_alphas[1], attn_gates[1] = pre[..., 0:H], pre[..., H : 2 * H]
    for layer, off in zip((0, 1), range(2 * H, 2 * H + 4, 2), strict=True):
        x0_gates[layer], bigram_gates[layer] = pre[..., off : off + 1], pre[..., off + 1 : off + 2]
    x = x0.clone()
    x = x + x0_bigram * bigram_gates[0]
    cache = {0: x}
    post_skip_gate = None
    B, T, C = x.shape
    for i in range(n):
        b, mu = blocks[i], None
        if i == g:
            post = record_forward_mudd_gate(gate, x, 1, 5 * H + 5 if dc else 3 * H + 5)
            xsa_alphas[3], xsa_alphas[4] = post[..., 0:H], post[..., H : 2 * H]
            attn_gates[5] = post[..., 2 * H : 3 * H]
            for layer, off in zip((3, 4), range(3 * H, 3 * H + 4, 2), strict=True):
                x0_gates[layer], bigram_gates[layer] = post[..., off : off + 1], post[..., off + 1 : off + 2]
            post_skip_gate = post[..., 3 * H + 4 : 3 * H + 5]
            if dc:
                dc_weights[5] = (post[..., 3 * H + 5 : 4 * H + 5], post[..., 4 * H + 5 : 5 * H + 5])
        if b.attn is None:
            x = x + torch.sigmoid(model.skip_weights[0]) * post_skip_gate * cache[s_src]
        else:
            attn_in_normed = b.norm1(cache.get(h_src, x))
            if i == n - 1:
                cache[n - 2] = x
                mu = record_forward_mudd(model.mudd, x, id=0, num_coef=14)
                v_mudd = (mu[0] * cache[0] + mu[1] * cache[h_src] + mu[2] * x).view(B, T, H, C // H)
                x = (1 + mu[5]) * x + mu[3] * cache[0] + mu[4] * cache[h_src]
                ve_gate = torch.cat([mu[6], mu[7]], dim=-1).repeat_interleave(H // 2, dim=-1).unsqueeze(-1)
                aux_v = (ve_gate * ve[i].view(B, T, H, C // H) + v_mudd).view(B, T, -1)
                attn_out = record_attention(
                    b, attn_in_normed, masks[i], aux_v, xsa_alphas[i], attn_gates[i], dc_weights[i], starts
                )
            else:
                attn_out = record_attention(b, attn_in_normed, masks[i], ve[i], xsa_alphas[i], attn_gates[i])
            if mu is not None:
                x = mu[8] * x + mu[9] * attn_out + mu[10] * cache[0]
                x = x + mu[11] * x0_bigram
            else:
                x = b.lambdas[0] * x + b.post_lambdas[0] * attn_out + x0 * x0_gates[i]
                if i != 0:
                    x = x + x0_bigram * bigram_gates[i]
        if mu is not None:
            x = mu[12] * x + mu[13] * b.mlp(b.norm2(x))
        else:
            x = b.lambdas[1] * x + b.post_lambdas[1] * b.mlp(b.norm2(x))
        if i in (s_src, h_src):
            cache[i] = x
    mu = record_forward_mudd(model.mudd, x, id=1, num_coef=5)
    x = (
        x
        + mu[0] * cache[0]
        + mu[1] * cache[h_src]
        + mu[2] * cache[n - 2]
        + mu[3] * ve[1]
        + mu[4] * cache[s_src]
    )
    return model.norm_f(x)


def test_gate_network_trains_a_step_through_the_run_optimizer():
    from speedrun.optim.build import build_optimizer

    cfg = load_recipe(BASE, [])
    optim = replace(cfg.optim, skip_gate_lr=0.0)  # #85: no skip gate of its own
    cfg = replace(cfg, model=_cfg(**GATED, dc_layers=[5]), optim=optim)
    model = _model(**GATED, dc_layers=[5])
    opt = build_optimizer(model, cfg)
    idx, tgt = _batch()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("mudd")}
    for _ in range(2):  # the record's Adam steps on odd steps only
        model(idx, tgt).backward()
        opt.step()
        opt.zero_grad()
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters() if n in before)


def test_inductor_compiles_mudd_with_no_graph_break_and_matches_eager():
    """MUDD and its gate network with DC (a superset of MUDD alone) compiled fullgraph, static shapes, as
    CUDA compiles it: one frame, no recompile on the second step, the eager loss and gradients within fp32
    rounding of fused kernels."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = _model(**GATED, dc_layers=[5])
    idx, tgt = _batch()

    def step(net):
        model.zero_grad()
        loss = net(idx, tgt)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager = step(model)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=False)
    with inductor_cpu_codegen():
        got = step(compiled)
        step(compiled)
    assert sum(counters["graph_break"].values()) == 0 and counter.frame_count == 1
    torch.testing.assert_close(got[0], eager[0], rtol=1e-5, atol=1e-6)
    assert got[1].keys() == eager[1].keys() and {"mudd.w1", "mudd.w2", "mudd.b2"} <= got[1].keys()
    for n in eager[1]:
        _close(got[1][n], eager[1][n], 1e-4, n)


def test_gate_network_on_the_full_recipe_adds_the_records_parameter_count():
    """With DC on layer 10: 2·64·768 + 2·41·64 + 2·41 + 1 = 103,635, the record's, less what it replaces:
    the XSA α (4·6), the attention gates (10·6·12), the x0 (9: MUDD's layer has none already) and
    bigram (11) shares, the skip gate (12)."""
    xsa = _count([*OVER, "model.mudd_sources=[7,3]", "model.xsa_layers=[1,3,4,7]"])
    gated = _count(
        [*OVER, "model.mudd_sources=[7,3]", "model.xsa_layers=[1,3,4,7]", "model.mudd_gate_layer=4",
         "model.mudd_gate_attn_layers=[3,10]", "model.attn_gate=0", "model.skip_gate=0",
         "optim.skip_gate_lr=0", "optim.labels.skip_gate={}", "model.dc_layers=[10]"]
    )  # fmt: skip
    assert gated - xsa == 2 * 64 * 768 + 2 * 41 * 64 + 2 * 41 + 1 - 4 * 6 - 10 * 6 * 12 - 9 - 11 - 12


def test_gate_network_is_the_records_loop_loss_and_every_gradient():
    model = _model(**GATED)
    assert model.mudd_gate.widths == (2 * 2 + 4, 3 * 2 + 5)
    assert all(b.attn is None or (b.attn.xsa is None and b.attn.gate is None) for b in model.blocks)
    assert model.bigram.lambdas is None and model.skip_gate is None
    assert all(b.x0_lambda is None for b in model.blocks)
    idx, tgt = _batch()
    ours = _loss_and_grads(model, _ours, idx, tgt)
    ref = _loss_and_grads(model, record_hidden_gated, idx, tgt)
    torch.testing.assert_close(ours[0], ref[0], rtol=0, atol=0)
    assert ours[1].keys() == ref[1].keys()
    assert {"mudd_gate.w1", "mudd_gate.w2", "mudd_gate.b2", "mudd_gate.scale"} <= ours[1].keys()
    for n in ref[1]:
        _close(ours[1][n], ref[1][n], 1e-5, n)
    wrong = _loss_and_grads(model, lambda m, i: record_hidden_gated(m, i, g=1), idx, tgt)[0]
    assert abs(float(wrong - ours[0])) > 1e-6  # the post gate read at another layer is caught


def test_gate_network_init_is_the_records_on_the_record_layout():
    """On the record's composition (11 layers, 6 heads, XSA 1, 3, 4, 7, gates on 3, 10, post at 4) the
    columns and their starting biases are the record's, DC's 12 columns apart; at init every gate is
    its bias (W2 zero): attention gates 0.25, bigram shares 0.05, the skip 0.5, x0 shares and α 0."""
    from speedrun.model.gpt2026.mudd import MuddGate, gate_layouts

    cfg = replace(
        load_recipe(BASE, []).model, xsa_layers=[1, 3, 4, 7], mudd_gate_layer=4, mudd_gate_attn_layers=[3, 10]
    )
    layouts = gate_layouts(cfg)
    torch.manual_seed(11)
    gate = MuddGate(768, layouts)
    assert gate.widths == (26, 29)
    torch.manual_seed(11)
    w1, w2, bs, scale = record_init_mudd_gate(768)
    torch.testing.assert_close(gate.w1.data, w1, rtol=0, atol=0)
    torch.testing.assert_close(gate.scale.data, scale.view(1), rtol=0, atol=0)
    torch.testing.assert_close(gate.b2.data[0, :26], bs[0, :26], rtol=0, atol=0)
    torch.testing.assert_close(gate.b2.data[1, :29], bs[1, :29], rtol=0, atol=0)
    assert gate.w2.shape == (2, 29, 64) and float(gate.w2.detach().abs().sum()) == 0
    out = gate(torch.randn(1, 3, 768), 1)
    assert sorted(out) == sorted(
        [("xsa", 4), ("xsa", 7), ("attn", 10), ("skip", -1)]
        + [(k, i) for i in (4, 5, 7, 8, 9) for k in ("x0", "bigram")]
    )
    torch.testing.assert_close(out[("attn", 10)], torch.full((1, 3, 6), 0.25), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out[("skip", -1)], torch.full((1, 3, 1), 0.5), rtol=1e-6, atol=1e-7)


def test_gate_network_decodes_as_the_forward_and_trains_in_its_rows():
    from speedrun.config.gpt2026.mudd import GATE_LR_MUL as MUDD_GATE_LR_MUL
    from speedrun.config.labels import label_table
    from speedrun.optim.rules import adam_groups, param_rules

    model = _model(**GATED).eval()
    idx, _ = _batch()
    assert_cached_decoding_is_the_forward(model, idx, 40)
    o = load_recipe(BASE, []).optim
    entries = {e.name: e for e in param_rules(model, label_table(o, 32))}
    assert entries["mudd_gate.w1"].rule.group == entries["mudd_gate.w2"].rule.group == "mudd_gate"
    assert entries["mudd_gate.b2"].rule.group == entries["mudd_gate.scale"].rule.group == "mudd_gate_bias"
    groups = adam_groups(label_table(o, 32), {"mudd_gate", "mudd_gate_bias"})
    assert groups["mudd_gate"].lr == o.embed_lr * MUDD_GATE_LR_MUL
    assert groups["mudd_gate_bias"].weight_decay == 0


def _assert_varlen_is_the_masked_model(dense, varlen, idx, tgt):
    """The same weights under varlen attention (cu_seqlens from the row's documents) and under the dense
    document mask: the loss to 1e-6, every gradient to 1e-4."""
    from speedrun.train.evaluate import row_cu_seqlens

    cu = row_cu_seqlens(idx, type("Cfg", (), {"model": varlen.cfg})())
    out = []
    for model, args in ((dense, ()), (varlen, (cu,))):
        model.zero_grad()
        loss = model(idx, tgt, *args)
        loss.backward()
        out.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-6, atol=1e-6)
    for n in out[0][1]:
        _close(out[1][1][n], out[0][1][n], 1e-4, n)


def test_gate_network_under_varlen_attention_equals_the_masked_attention():

    dense = _model(**GATED)
    varlen = build_model(replace(dense.cfg, attention="varlen"))
    varlen.load_state_dict(dense.state_dict())
    idx, tgt = _batch()
    _assert_varlen_is_the_masked_model(dense, varlen, idx, tgt)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["model.mudd_gate_layer=4"], "model.mudd.sources"),
        ([*MUDD_ON, "model.mudd_gate_layer=10"], "a present layer 1..9 (4), got 10"),
        ([*MUDD_ON, "model.mudd_gate_layer=4"], "model.attn.gate=0"),
        ([*MUDD_ON, "model.mudd_gate_layer=4", "model.attn_gate=0"], "model.stream.skip_gate=0"),
        ([*MUDD_ON, "model.mudd_gate_layer=7", "model.attn_gate=0", "model.skip_gate=0"], "into a layer >="),
        ([*MUDD_ON, "model.mudd_gate_layer=4", "model.attn_gate=0", "model.skip_gate=0",
          "model.mudd_gate_attn_layers=[6]"], "distinct attention layers"),
        ([*MUDD_ON, "model.mudd_gate_layer=4", "model.attn_gate=0", "model.skip_gate=0",
          "model.dc_layers=[3]"], "model.mudd.dc_layers [3]: distinct unpaired attention layers >="),
        ([*MUDD_ON, "model.mudd_gate_layer=4", "model.attn_gate=0", "model.skip_gate=0",
          "model.dc_layers=[9]"], "model.mudd.dc_layers [9]: distinct unpaired"),  # paired
    ],
)  # fmt: skip
def test_a_bad_gate_setting_is_one_config_error_naming_it(overrides, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_recipe(BASE, overrides)


def test_memory_guard_estimates_the_full_size_model_with_both():
    """The memory estimate reads the new labels' Adam rows (a 1-element σ included) for 1 and 8 GPUs; the
    gate network and MUDD add their weights, gradients and fp32 Adam state (a few MB)."""
    from speedrun.train.plan.memory import estimate_peak_bytes

    over = [*MUDD_ON, f"model.attn_inputs=[{'-1,' * 8}7,7,7]", "model.xsa_layers=[1,3,4,7]"]
    gated = [*over, "model.mudd_gate_layer=4", "model.mudd_gate_attn_layers=[3,10]", "model.attn_gate=0"]
    gated += ["model.skip_gate=0", "optim.skip_gate_lr=0", "optim.labels.skip_gate={}"]
    for world in (1, 8):
        base = estimate_peak_bytes(load_recipe(BASE, []), world, True)
        ours = estimate_peak_bytes(load_recipe(BASE, gated), world, True)
        assert 0 < ours - base < 16 * 2**20, (world, ours - base)


def test_speedrun_train_runs_mudd_and_its_gate_network_shrunk(text_data, tmp_path):
    """The loop trains, validates and checkpoints a shrunk model with both (the Muon table: their labels in
    the scalars' group), and the loss falls."""
    import json

    from speedrun.train import loop
    from tests.e2e.test_stages_training import staged

    layout = [
        "model.n_layer=6", "model.windows=L,S,S,L,S,L", "model.attention_layers=[0,1,3,4,5]",
        "model.mlp_layers=[0,1,2,3,4,5]", "model.value_embeds=[-1,0,-1,-1,1,2]", "model.skips=[[1,2]]",
        "model.skip_gate_form=sigmoid", "model.value_mix=weights", "model.bigram_rows=500",
        "model.attn_inputs=[-1,-1,-1,-1,3,3]", "model.residual_form=sublayer", "model.x0_lambda_apart=false",
        "model.mudd_sources=[3,1]",
        "model.xsa_layers=[1,3,4]", "model.mudd_gate_layer=2", "model.mudd_gate_attn_layers=[1,5]",
    ]  # fmt: skip
    loop.train(load_recipe("demo", staged(text_data, *layout)), tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r["train_loss"] for r in records if "train_loss" in r]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) >= 2 and all(math.isfinite(v) for v in val + train)
    assert sum(train[-3:]) < sum(train[:3])


# --- #85's DC correction, its weights from the gate network ---------------------------------------------


def test_dc_on_the_attention_layout_is_the_packed_reference_rows_and_decode_rows():
    """dc_masked (B, H, T, D) with dc_valid's documents and window equals dc_correction (tested against the
    record's kernel) on a packed row, and its last rows from the new queries alone (cached decoding)."""
    from speedrun.model.contexts import near_keys as dc_valid
    from speedrun.model.gpt2026.dc import dc_masked
    from tests.model_refs import dc_correction

    T, H, D, window = 40, 3, 8, 7
    gen = torch.Generator().manual_seed(0)
    y, q, k, v = (torch.randn(T, H, D, generator=gen, dtype=torch.float64) for _ in range(4))
    w1, w2 = (torch.randn(T, H, generator=gen, dtype=torch.float64) for _ in range(2))
    cu = torch.tensor([0, 13, 14, 40])
    docs = torch.bucketize(torch.arange(T), cu[1:], right=True)[None]
    want = dc_correction(y, q, k, v, w1, w2, 0.12, window, cu)
    layout = [t.transpose(0, 1)[None] for t in (y, q, k, v)]
    got = dc_masked(*layout, w1[None], w2[None], 0.12, dc_valid(docs, docs, 0, window))
    torch.testing.assert_close(got[0].transpose(0, 1), want, rtol=1e-12, atol=1e-12)
    s = 30
    rows = dc_masked(
        layout[0][:, :, s:], layout[1][:, :, s:], *layout[2:], w1[None, s:], w2[None, s:], 0.12,
        dc_valid(docs[:, s:], docs, s, window),
    )  # fmt: skip
    torch.testing.assert_close(rows[0].transpose(0, 1), want[s:], rtol=1e-12, atol=1e-12)


def test_dc_in_the_model_is_the_records_loss_and_every_gradient():
    model = _model(**GATED, dc_layers=[5])
    assert model.mudd_gate.widths == (2 * 2 + 4, 5 * 2 + 5)
    idx, tgt = _batch()
    ours = _loss_and_grads(model, _ours, idx, tgt)
    ref = _loss_and_grads(model, lambda m, i: record_hidden_gated(m, i, dc=True), idx, tgt)
    torch.testing.assert_close(
        ours[0], ref[0], rtol=1e-6, atol=0
    )  # the kernel's exp2 softmax: not bit for bit
    assert ours[1].keys() == ref[1].keys()
    for n in ref[1]:
        _close(ours[1][n], ref[1][n], 1e-5, n)
    no_dc = _loss_and_grads(model, lambda m, i: record_hidden_gated(m, i), idx, tgt)[0]
    assert abs(float(no_dc - ours[0])) > 1e-5  # the correction counts


def test_dc_decodes_as_the_forward_and_varlen_equals_dense():

    dense = _model(**GATED, dc_layers=[5])
    idx, tgt = _batch()
    assert_cached_decoding_is_the_forward(dense.eval(), idx, 40)
    dense.train()
    varlen = build_model(replace(dense.cfg, attention="varlen"))
    varlen.load_state_dict(dense.state_dict())
    _assert_varlen_is_the_masked_model(dense, varlen, idx, tgt)
