"""The parts #54–#65 add, each against the record's own lines (records/track_1_short/
2025-12-26_LogitRescale, 2025-12-29_VeSkipGates, 2026-01-07_PairedHeadAttention,
2026-01-19_BigramHashEmbedding, 2026-01-26-UntieValueEmbeddings and 2026-01-30_VeFused, the code at
the top of each log): #54's asymmetric softcap 23·sigmoid((z + 5) / 7.5); #55's gates on the value
embeddings and on the skip, #58's paired heads, #62's bigram hash embedding and #63's five value
embeddings, in #55's model written here from its code with #58's, #62's and #63's lines
(stages-2025-12 with the new switches on: fp32 loss and gradients); #62's hash against
get_bigram_hash; cached decoding with paired heads and the bigram table; #65's Adam table (its
param_table: the gates in Adam #56, per-label betas #57); the optimizer table's rows for the gates and
the bigram table; one ConfigError for each bad new switch. The banks-2026-01 recipe itself is not
built yet (docs/roadmap.md)."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from speedrun.errors import ConfigError
from speedrun.model.families import build_model
from speedrun.model.gpt2026.embeddings import bigram_hash
from speedrun.model.layers import softcap
from speedrun.optim.build import build_table_optimizer, model_rules
from speedrun.optim.table import build_rows
from speedrun.recipes import load_recipe
from speedrun.train.schedule import apply_to_model, schedule_at
from tests.decoding import assert_cached_decoding_is_the_forward
from tests.fidelity.checks import (
    assert_loss_and_gradients_are_the_records,
    fp32_model,
    jitter_,
    two_documents,
)
from tests.fidelity.refs.head import record_54_loss
from tests.fidelity.refs.yarn import windows_passed, yarn_through
from tests.fidelity.test_stages_recipe import (
    BLOCK,
    EXT,
    WS,
    WS_POST_YARN,
    N,
    record_bs_ws,
    record_key_shift,
    record_mtp,
)
from tests.recipe_matrix import replace

BASE = "stages-2025-12"
#: #54 and #55's model switches on #53's recipe (#55's schedule, LRs and decay are not here)
GATED = [
    "model.logit_softcap=11.5", "model.softcap_divisor=7.5", "model.softcap_offset=5",
    "model.ve_gate=12", "model.skip_gate=12", "optim.skip_gate_lr=0.0004",
]  # fmt: skip


def test_asymmetric_softcap_is_the_records_line_bit_for_bit():
    z = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 30
    ours = softcap(z, 11.5, "sigmoid", 7.5, 5.0)
    torch.testing.assert_close(ours, 23 * torch.sigmoid((z + 5) / 7.5), rtol=0, atol=0)  # #54
    z16 = z.bfloat16()  # the record caps the bf16 head output
    torch.testing.assert_close(
        softcap(z16, 11.5, "sigmoid", 7.5, 5.0), 23 * torch.sigmoid((z16 + 5) / 7.5), rtol=0, atol=0
    )
    # asymmetric: the range is (0, 23), reached at z = -5 ± ∞, centre 11.5 at z = -5, not 0
    assert softcap(torch.tensor([-5.0]), 11.5, "sigmoid", 7.5, 5.0).item() == 11.5
    # an offset of 0 leaves the older records' op order (z / 7.5, no add)
    plain = softcap(z, 15.0, "sigmoid", 7.5, 0.0)
    torch.testing.assert_close(plain, 30 * torch.sigmoid(z / 7.5), rtol=0, atol=0)


BIGRAM = 50304 * 5  # #62's args.bigram_vocab_size


def record_bigram_hash(x, bigram_vocab_size=BIGRAM):
    """#62's get_bigram_hash (a rank's flat token sequence)."""
    rand_int_1 = 36313
    rand_int_2 = 27191
    mod = bigram_vocab_size - 1
    x = x.to(torch.int32).clone()
    x[0] = mod
    x[1:] = torch.bitwise_xor(rand_int_1 * x[1:], rand_int_2 * x[:-1]) % mod
    return x


def test_bigram_hash_is_the_records_and_continues_across_cached_steps():
    seq = torch.randint(0, 50257, (4096,), generator=torch.Generator().manual_seed(3))
    seq[:4] = torch.tensor([50256, 50256, 0, 50255])  # the extremes: no int32 overflow
    ours = bigram_hash(seq[None], BIGRAM)[0]
    assert torch.equal(ours, record_bigram_hash(seq)) and ours.dtype == torch.int32
    assert ours.min() >= 0 and (ours == BIGRAM - 1).nonzero().tolist() == [[0]]
    for start in (1, 2, 100):  # cached decoding; position 1 hashes with the reserved value (the record's)
        tail = bigram_hash(seq[None, start:], BIGRAM, prev=seq[None, start - 1 : start], start=start)[0]
        assert torch.equal(tail, ours[start:]), start


def record_58_paired_qkv(q, k, v, cos, sin):
    """#58's PairedHeadCausalSelfAttention between QK-norm and the attention call, its YarnPairedHead
    tables (theta1 = outer(2t, freq), theta2 = outer(2t + 1, freq), concatenated) in #53's rotary layout
    (ours: each half of a head's dims rotated by `record_rotary`)."""
    from tests.fidelity.test_polar_recipe import record_rotary

    B, T, H, hd = q.shape
    q = q.view(B, T, H // 2, hd * 2)
    k = k.view(B, T, H // 2, hd * 2)
    v = v.reshape(B, T * 2, H // 2, hd)
    even, odd = slice(0, 2 * T, 2), slice(1, 2 * T, 2)

    def rotary(x):  # factor1 = cat(cos(theta1), cos(theta2)): first head of the pair at 2t, second at 2t+1
        a, b = x.split(hd, dim=-1)
        return torch.cat([record_rotary(a, cos[even], sin[even]), record_rotary(b, cos[odd], sin[odd])], -1)

    q, k = rotary(q), rotary(k)
    return q.view(B, T * 2, H // 2, hd), k.view(B, T * 2, H // 2, hd), v


def record_55_forward(
    w, input_seq, target_seq, seqlens, ws, yarn, scale, mtp, heads, dim, training, paired=()
):
    """#55's GPT.forward (fp32: no FP8), the summed (MTP) loss in training: #53's with
    `ve_gate_out = 2 * sigmoid(value_embed_gate(x[..., :12]))`, `v = v + ve_gate_out * ve`,
    `skip_gate_out = sigmoid(skip_lambda) * 2 * sigmoid(skip_gate(x0[..., :12]))` and
    `logits = 23 * sigmoid((logits + 5) / 7.5)` (#54); #58's paired heads on the layers `paired`."""
    from tests.fidelity.test_polar_recipe import record_rotary
    from tests.fidelity.test_yarn_recipe import fa3_reference, norm, record_qkvo

    L, hd, T = 11, dim // heads, len(input_seq)
    cos, sin = yarn.cos.bfloat16().float(), yarn.sin.bfloat16().float()
    skip_connections, skip_in, skip_out, backout_layer = [], [3], [6], 7
    short_bm, long_bm = ws[0] * BLOCK, ws[1] * BLOCK
    bm_sizes = [short_bm] * 3 + [long_bm] + [short_bm] * 2 + [None] + [short_bm] * 3 + [long_bm]
    x = F.embedding(input_seq, w["wte.weight"])
    if "value_embeds.4.weight" in w:  # #63's five tables, ".01...234"
        ve = [F.embedding(input_seq, w[f"value_embeds.{i}.weight"]) for i in range(5)]
        ve = [ve[0], ve[1]] + [None] * (L - 5) + [ve[2], ve[3], ve[4]]
    else:
        ve = [F.embedding(input_seq, w[f"value_embeds.{i}.weight"]) for i in range(3)]
        ve = [ve[1], ve[2]] + [None] * (L - 5) + [ve[0], ve[1], ve[2]]
    smear_gate = w["smear.gate.weight"]
    gate_out = w["smear.lamb"] * torch.sigmoid(F.linear(x[1:, : smear_gate.size(-1)], smear_gate))
    x = torch.cat([x[:1], x[1:] + gate_out * x[:-1]])
    x = x0 = norm(x[None])
    bigram = "bigram.embed.weight" in w  # #62's lines (bigram_lambdas are our bigram.lambdas)
    if bigram:
        x0_bigram = F.embedding(record_bigram_hash(input_seq), w["bigram.embed.weight"])[None]
    x_backout = None
    for i in range(L):
        if i in skip_out:
            skip_gate = w["skip_gate.proj.weight"]
            skip_gate_out = (
                torch.sigmoid(w["skip_weights"][0]) * 2 * torch.sigmoid(F.linear(x0[..., :12], skip_gate))
            )
            x = x + skip_gate_out * skip_connections.pop()
        resid, x0_lambda = w[f"blocks.{i}.lambdas"][0], w[f"blocks.{i}.x0_lambda"][0]
        if bigram and i == 0:
            x = (resid + x0_lambda) * x + w["bigram.lambdas"][0] * x0_bigram
        elif bigram:
            x = resid * x + x0_lambda * x0 + w["bigram.lambdas"][i] * x0_bigram
        else:
            x = (resid + x0_lambda) * x if i == 0 else resid * x + x0_lambda * x0
        if bm_sizes[i] is not None:
            h = norm(x)
            sa = w[f"blocks.{i}.attn.lambdas"]
            qkvo_w = record_qkvo(w, i, dim)
            q, k, v = (
                F.linear(h, sa[0] * qkvo_w[:3].flatten(end_dim=1)).view(1, T, 3 * heads, hd).chunk(3, dim=-2)
            )
            q, k = norm(q), norm(k)
            n = 2 if i in paired else 1  # #58: 2T positions of H/2 heads, seqlens x2
            if i in paired:
                q, k, v = record_58_paired_qkv(q, k, v, cos, sin)
            else:
                q, k = record_rotary(q, cos, sin), record_rotary(k, cos, sin)
            if bm_sizes[i] == long_bm:
                k = record_key_shift(k)
            if ve[i] is not None:
                ve_gate = w[f"blocks.{i}.attn.ve_gate.proj.weight"]
                ve_gate_out = 2 * torch.sigmoid(F.linear(h[..., :12], ve_gate)).view(1, n * T, heads // n, 1)
                v = v + ve_gate_out * ve[i].view_as(v)
            y = fa3_reference(q[0], k[0], v[0], n * seqlens, bm_sizes[i], scale)  # FA3: contiguous
            y = y.contiguous().view(1, T, heads, hd)
            gate = w[f"blocks.{i}.attn.gate.proj.weight"]
            y = y * torch.sigmoid(F.linear(h[..., : gate.size(-1)], gate)).view(1, T, heads, 1)
            x = x + F.linear(y.contiguous().view(1, T, dim), sa[1] * qkvo_w[3])
        h = F.linear(norm(x), w[f"blocks.{i}.mlp.c_fc.weight"])
        x = x + F.linear(F.relu(h).square(), w[f"blocks.{i}.mlp.c_proj.weight"])
        if i in skip_in:
            skip_connections.append(x)
        if i == backout_layer:
            x_backout = x
    return record_54_loss(w, x, x_backout, target_seq, mtp, training)


@pytest.mark.parametrize(
    ("step", "later"), [(700, False), (N + EXT, False), (100, True), (N + EXT, True)]
)  # MTP 2 after YaRN 3 → 7; validation; with #58's paired heads, #62's bigram table and #63's layout
def test_forward_loss_and_gradients_match_the_55_model_in_fp32(step, later):
    from tests.fidelity.test_yarn_recipe import RecordYarn

    heads, dim, T, vocab = 2 + 2 * later, 64, 1024, 120  # paired: two pairs of heads
    later_switches = [
        f"model.bigram_rows={BIGRAM}",
        "model.value_embeds=[0, 1, -1, -1, -1, -1, -1, -1, 2, 3, 4]",  # #63's untied tables
        "model.paired_layers=[0, 2, 5, 9]",
    ]
    cfg, model = fp32_model(
        BASE, GATED + later_switches * later, n_head=heads, n_embd=dim, vocab_size=vocab, max_seq_len=T
    )
    assert [b.attn is not None and b.attn.paired for b in model.blocks] == [
        i in (0, 2, 5, 9) and later for i in range(11)
    ]
    gates = [n for n, p in model.named_parameters() if "gate" in n and p.abs().sum() == 0]
    assert len(gates) == 1 + 11 - 1 + 5 + 1  # smear, 10 attention gates, 5 value-embedding gates, skip: zero
    jitter_(model, 0.02)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "ve_gate" in n or "skip_gate" in n:  # gates far from 1
                p.copy_(torch.randn_like(p))
            if n == "bigram.embed.weight":  # rows of the size of the token embedding's
                p.normal_(std=0.5)
    x, y, cu = two_documents(vocab, T)
    training = step < N + EXT
    model.train(training)
    apply_to_model(schedule_at(step, cfg), model)
    _, ws_short, ws_long = record_bs_ws(step)
    ws_long = WS_POST_YARN if not training else ws_long
    yarn = RecordYarn(dim // heads, 2 * T)  # #58 on: 2·max_seq_len tables
    seen = windows_passed(WS[0], lambda s: record_bs_ws(s)[2], min(step, N + EXT - 1))
    scale = yarn_through(yarn, seen)
    weights = {n: p.detach().clone().requires_grad_(training) for n, p in model.named_parameters()}
    with torch.set_grad_enabled(training):
        loss = model(x[None], y[None], cu)
        ref = record_55_forward(
            weights,
            x,
            y,
            cu,
            (ws_short, ws_long),
            yarn,
            scale,
            record_mtp(step),
            heads,
            dim,
            training,
            (0, 2, 5, 9) if later else (),
        )
    assert_loss_and_gradients_are_the_records(model, loss, ref, weights, T, training)


def test_untied_value_embeddings_are_the_63_layout():
    """#63: `ve = [ve[0], ve[1]] + [None] * (num_layers - 5) + [ve[2], ve[3], ve[4]]`."""
    cfg = load_recipe(BASE, ["model.value_embeds=[0, 1, -1, -1, -1, -1, -1, -1, 2, 3, 4]"])
    model = build_model(replace(cfg.model, n_head=2, n_embd=64, vocab_size=120, max_seq_len=256))
    layout = [s.value_embed for s in model.specs]
    assert layout == [0, 1] + [None] * 6 + [2, 3, 4] and len(model.value_embeds) == 5


def test_cached_decoding_with_bigram_table_and_paired_heads_equals_the_forward():
    cfg = load_recipe(BASE, GATED + ["model.bigram_rows=1000"])
    cfg.model = replace(
        cfg.model, n_layer=4, n_head=4, n_embd=64, vocab_size=100, max_seq_len=64, embed_dtype="fp32",
        fp8_head=False, eot_id=99, windows=["L", "S", "S", "L"], attention_layers=[0, 1, 3],
        mlp_layers=[0, 1, 2, 3], value_embeds=[-1, -1, -1, 0], backout_layer=2, skips=[[1, 2]],
        key_offset_layers=[0, 3], paired_layers=[1],
    )  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    jitter_(model, 0.05)
    idx = torch.randint(0, 99, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = assert_cached_decoding_is_the_forward(model, idx, 25)
        model.blocks[1].attn.paired = False
        assert not torch.allclose(model(idx), full)  # pairing changes what the model computes
        model.blocks[1].attn.paired = True
        model.bigram.embed.weight.zero_()
        assert not torch.allclose(model(idx), full)  # so does the table


def test_the_gates_rows_are_the_records():
    """#55: the value-embedding gates with the attention gates in NorMuon (`is_gate = 'gate' in label`:
    one statistic per head), the skip gate in the main Adam at its own LR (label skip_gate)."""
    cfg = load_recipe(BASE, GATED)
    model = build_model(replace(cfg.model, n_head=2, n_embd=64, vocab_size=120, max_seq_len=256))
    assert cfg.optim.normuon_gate_row_stats
    rows = {r.name: r for r in build_rows(model_rules(model, cfg), 1)}
    ve_gates = [n for n in rows if ".ve_gate." in n]
    assert ve_gates == [f"blocks.{i}.attn.ve_gate.proj.weight" for i in (0, 1, 8, 9, 10)]
    assert all((rows[n].rule, rows[n].gate_rows, rows[n].lr_mul) == ("normuon", True, 1.0) for n in ve_gates)
    assert (rows["skip_gate.proj.weight"].rule, rows["skip_gate.proj.weight"].label) == ("adam", "skip_gate")
    cfg = load_recipe(BASE, GATED + ["model.bigram_rows=1000"])
    model = build_model(replace(cfg.model, n_head=2, n_embd=64, vocab_size=120, max_seq_len=256))
    rows = {r.name: r for r in build_rows(model_rules(model, cfg), 8)}
    assert (rows["bigram.embed.weight"].label, rows["bigram.embed.weight"].sharded) == ("value_embed", True)
    assert rows["bigram.lambdas"].label == "scalar"  # #62: in the record's scalars (their own Adam)


#: #65's TrainingManager.param_table, its Adam rows: label → (adam_betas, lr_mul, wd_mul), with
#: adam_defaults lr 0.008, eps 1e-10, weight_decay 0.005 (every Adam row decays cautiously: lr²·wd·wd_mul)
RECORD_65_ADAM = {
    "scalars": ((0.9, 0.99), 5.0, 0.0),
    "value_embed": ((0.75, 0.95), 75.0, 5.0),
    "bigram_embed": ((0.75, 0.95), 75.0, 5.0),
    "smear_gate": ((0.9, 0.99), 0.01, 0.0),
    "skip_gate": ((0.9, 0.99), 0.05, 0.0),
    "attn_gate_bank": ((0.9, 0.99), 1.0, 1.0),
    "ve_gate_bank": ((0.9, 0.99), 1.0, 1.0),
    "x0_lambdas": ((0.65, 0.95), 5.0, 0.0),
    "lm_head": ((0.5, 0.95), 1.0, 150.0),
    "embed": ((0.5, 0.95), 1.0, 150.0),
}
#: the switches that give #65's Adam table on top of GATED (its LRs as stages-2025-12's)
ADAM_65 = [
    "optim.eps=1e-10", "optim.embed_betas=[0.5,0.95]", "optim.value_embed_betas=[0.75,0.95]",
    "optim.embed_wd_mul=150", "optim.value_embed_wd_mul=5", "optim.gate_lr=0.008", "optim.gate_betas=scalar",
    "optim.x0_betas=[0.65,0.95]", "model.bigram_rows=1000",
]  # fmt: skip


def record_65_label(name: str) -> str:
    """Our parameter name → the record's label for it."""
    for end, label in [
        ("wte.weight", "embed"), ("lm_head.weight", "lm_head"), ("bigram.embed.weight", "bigram_embed"),
        ("smear.gate.weight", "smear_gate"), ("skip_gate.proj.weight", "skip_gate"),
        (".attn.gate.proj.weight", "attn_gate_bank"), (".attn.ve_gate.proj.weight", "ve_gate_bank"),
        (".x0_lambda", "x0_lambdas"),
    ]:  # fmt: skip
        if name.endswith(end):
            return label
    return "value_embed" if name.startswith("value_embeds.") else "scalars"


def test_the_adam_table_is_the_65_records():
    """#56: the attention and value-embedding gates leave NorMuon for Adam; #57/#65: per-label betas."""
    cfg = load_recipe(BASE, GATED + ADAM_65)
    cfg.model = replace(cfg.model, n_head=2, n_embd=64, vocab_size=120, max_seq_len=256)
    model = build_model(cfg.model)
    opt = build_table_optimizer(model, cfg)
    seen = set()
    for row in opt.adam_rows:
        betas, lr_mul, wd_mul = RECORD_65_ADAM[record_65_label(row.name)]
        seen.add(record_65_label(row.name))
        got = opt.adam[row.label]
        assert (got.betas, got.eps) == (betas, 1e-10), row.name
        assert math.isclose(got.lr, 0.008 * lr_mul) and math.isclose(got.weight_decay, 0.005 * wd_mul), (
            row.name
        )
    assert seen == set(RECORD_65_ADAM)
    muon = {r.name.split(".", 2)[-1] for r in opt.rows if r.rule == "normuon"}
    assert muon == {"attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"}


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["model.logit_softcap=0", "model.softcap_offset=5"], "model.head.softcap_offset"),
        (
            ["model.ve_gate=12", "model.value_embeds=[]", "model.value_embed_zero_init=false"],
            "model.values.gate (#55)",
        ),
        (["model.skip_gate=800"], "model.stream.skip_gate (#55)"),
        (["model.skip_gate=12"], "model.skip_gate and optim.skip_gate_lr"),
        (["optim.skip_gate_lr=0.0004"], "model.skip_gate and optim.skip_gate_lr"),
        (["model.bigram_rows=1"], "model.embed.bigram_rows (#62)"),
        (["optim.gate_lr=0.008", "model.attn_gate=0"], "optim.gate_lr (#56"),
        (["model.paired_layers=3"], "model.attn.paired_layers [3] must name layers"),  # a key-offset layer
        (["model.paired_layers=6"], "model.attn.paired_layers [6] must name layers"),  # no attention
        (["model.paired_layers=0,x"], "model.attn.paired_layers: expected an integer"),
        (["model.paired_layers=0", "model.n_head=3", "model.n_embd=768"], "needs an even model.n_head"),
    ],
)
def test_a_bad_new_switch_is_one_config_error_naming_it(overrides, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_recipe(BASE, overrides)
