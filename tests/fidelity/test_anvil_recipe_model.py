"""anvil-2026-08 (record #92, ANVIL2, PR #360): its transformer's tensors against the record's, its
dry run, and the forward and every gradient of a reduced-width #92 model against the record's loop
(`track_1_short/model/gpt.py`, GPT.forward at commit f380c1f0) transcribed below in fp32.

The reference takes each attention sublayer as an op (our `Attention` on the layer's normed input, its
value rows and gates): that op is checked against #92's attention layer in
tests/fidelity/test_mixed_width_attention.py.
What is transcribed here is everything around it: the gate network's lanes, the injection sites, the
resting layer 7, the skip, the cached input of the late layers, MUDD on the last layer, the parallel MLP
and the ten-source post-loop mix per channel group."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from speedrun.cli import main
from speedrun.model.families import build_model
from speedrun.recipes import load_recipe

V, D, L = 50304, 768, 11
ROWS = 84_602_880


def record_92_param_count(world: int = 8) -> int:
    """#92's GPT.__init__ tensors (the n-gram table lives in NgramTable, apart): embed, lm_head, four
    value-embedding planes, ve_gate_bank (3, 6, 12), qk_bank (7 slots x 6 head-pair groups, padded to the
    world, of 2·128 rows), vo_bank (14, padded), mlp_bank (12, 2, 2816, 768), smear_gate, post/resid
    lambdas (11, 2), scalars (11 SA pairs, smear, skip, padding), MUDD (w1, w2, b2 and w2g (14, 12, 64))
    and the gate network (scale, w1, w2 (2, 23, 64), b2 (2, 23))."""
    pad = lambda n: -(-n // world) * world  # noqa: E731
    embeddings = 2 * V * D + 4 * V * D
    ve_gates = 3 * 6 * 12
    banks = pad(42) * 256 * D + pad(14) * D * D + 12 * 2 * 2816 * D
    lambdas = 11 * 2 + 11 * 2
    scalars = 11 * 2 + 2 + (-11 * 2 - 2) % world
    mudd = 2 * 64 * D + 2 * 14 * 64 + 2 * 14 + 14 * 12 * 64
    gate = 1 + 2 * 64 * D + 2 * 23 * 64 + 2 * 23
    return 12 + embeddings + ve_gates + banks + lambdas + scalars + mudd + gate


def test_the_transformer_is_the_records_less_what_it_allocates_unread():
    """Ours = #92's tensors at world size 1 less layer 7's dead MLP slot, the SA pairs of the four layers
    without attention (4, 6, 7, 9), layer 10's resid pair (MUDD's mu) and the post pairs of 7 (it rests)
    and 10; the table is 84,602,880 x 768 apart."""
    with torch.device("meta"):
        model = build_model(load_recipe("anvil-2026-08").model)
    table = model.bigram.table if hasattr(model.bigram, "table") else None
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    ngram = [n for n, s in shapes.items() if s == (ROWS, D)]
    assert len(ngram) == 1, ngram
    ours = sum(p.numel() for n, p in model.named_parameters() if n != ngram[0])
    assert ours == record_92_param_count(world=1) - 2 * 2816 * D - 4 * 2 - 2 - 2 * 2
    assert record_92_param_count(world=8) - record_92_param_count(world=1) == 6 * 256 * D + 2 * D * D
    assert table is None or tuple(table.shape) == (ROWS, D)
    # the four value-embedding planes, one per layer 1, 2, 8, 10
    assert [tuple(e.weight.shape) for e in model.value_embeds] == [(V, D)] * 4
    assert [s.value_embed for s in model.specs] == [None, 0, 1, None, None, None, None, None, 2, None, 3]
    # depth: attention on 0, 1, 2, 3, 5, 8, 10; layer 7 rests; the parallel MLP on 8
    assert [i for i, b in enumerate(model.blocks) if b.attn is not None] == [0, 1, 2, 3, 5, 8, 10]
    assert [i for i, b in enumerate(model.blocks) if b.mlp is None] == [7] and model.specs[7].rests
    assert [i for i, b in enumerate(model.blocks) if b.mlp2 is not None] == [8]
    assert all(tuple(b.mlp.c_fc.weight.shape) in ((2816, D), (D, 2816)) for b in model.blocks if b.mlp)
    # widths: Q/K 64 on 0, 1, 2, 5, 8; V/O 64 on 1, 8; the carriers 3, 10 at 128
    widths = {i: (b.attn.qk_dim, b.attn.v_dim) for i, b in enumerate(model.blocks) if b.attn is not None}
    assert widths == {0: (64, 128), 1: (64, 64), 2: (64, 128), 3: (128, 128), 5: (64, 128), 8: (64, 64),
                      10: (128, 128)}  # fmt: skip
    # MUDD: w2g (14, 12, 64); the gate network's 23 pre and 13 post lanes
    assert tuple(model.mudd.w2g.shape) == (14, 12, 64) and model.mudd.groups == 12
    assert model.mudd_gate.widths == (23, 13) and tuple(model.mudd_gate.w2.shape) == (2, 23, 64)


def test_dry_run_prints_about_65_3_billion_parameters(capsys):
    assert main(["train", "--recipe", "anvil-2026-08", "--dry-run"]) == 0
    out = capsys.readouterr().out
    params = int(out.split("params: ")[1].split()[0])
    table = ROWS * D
    assert params == table + record_92_param_count(world=1) - 2 * 2816 * D - 14 == 65_271_119_333
    assert f"ngram       {table:,} params" in out
    assert f"without the n-gram table {params - table:,} params" in out.replace("  ", " ").replace("  ", " ")
    # memory per process: the table's rows split over 8 (15.13 GiB of bf16 rows each, issue 43), whole on 1
    mem = {int(w): float(g) for w, g in re.findall(r"(\d) process(?:es)?: ([\d.,]+) GiB", out)}
    one, eight = mem[1], mem[8]
    assert one > table * 2 / 2**30 > 80  # one process holds the whole table: more than any 80 GB GPU
    assert eight < 80 and one - eight > 7 / 8 * table * 2 / 2**30


# --- the forward and every gradient at reduced width, against #92's loop --------------------------------

SMALL = [
    "model.n_embd=64", "model.n_head=2", "model.vocab_size=512", "model.eot_id=511", "model.max_seq_len=128",
    "model.mlp.hidden=96", "model.ngram.rows=4096", "model.mudd.mix_groups=4", "model.head.sampled_stride=0",
    "model.head.canonical_val_mask=false", "model.head.prefix_loss_weight=0", "model.mtp=0",
    "model.mlp.fp8=false", "model.attn.fp8_qkv=false", "model.yarn=false", "train.stages=",
    "train.cooldown_start=int", "train.stage_bounds=round", "train.seq_len=128",
    "train.micro_batch_tokens=128", "train.global_batch_tokens=128", "train.dtype=fp32",
    "train.val_seq_len=0",
]  # fmt: skip


FULL_WIDTH = ["model.n_embd=768", "model.n_head=6", "model.mlp.hidden=2816", "model.mudd.mix_groups=12"]


def _small_model(width: list[str] = ()):
    cfg = load_recipe("anvil-2026-08", [*SMALL, *width])
    torch.manual_seed(0)
    model = build_model(cfg.model).float()
    with torch.no_grad():  # every weight away from its init, so each zero-initialised path carries a gradient
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def _norm(x):
    return F.rms_norm(x, (x.size(-1),))


def _mlp_coefs(x, w1, w2, b2, n, scale):
    h = F.gelu(F.linear(x, w1))
    return (F.linear(h, w2[:n]) + b2[:n]) * scale, h


def record_forward(model, idx, contexts):
    """#92's GPT.forward up to the final norm, its constants at this width (H heads per gate lane)."""
    H = model.cfg.n_head
    blocks, mg, mudd = model.blocks, model.mudd_gate, model.mudd
    x = model.embed_norm(model.smear(model.wte(idx), None))  # the embedding (smear, norm): enter's
    x0 = x
    bigram = model.bigram(idx, None, 0)
    ve = [emb(idx) for emb in model.value_embeds]  # planes of layers 1, 2, 8, 10
    ve_of = {1: ve[0], 2: ve[1], 8: ve[2], 10: ve[3]}
    pre, _ = _mlp_coefs(x0, mg.w1[0], mg.w2[0], mg.b2[0], 3 * H + 5, mg.scale)
    # pre lanes: xsa[1, 3] (H each), attn gate[3] (H), x0[0, 1, 2], bigram[0, 1]
    xsa = {1: pre[..., :H], 3: pre[..., H : 2 * H]}
    attn_gate = {3: pre[..., 2 * H : 3 * H]}
    x0_g = {k: pre[..., 3 * H + j : 3 * H + j + 1] for j, k in enumerate((0, 1, 2))}
    bg_g = {k: pre[..., 3 * H + 3 + j : 3 * H + 4 + j] for j, k in enumerate((0, 1))}
    x = x0 + bigram * bg_g[0]
    cache = {0: x}
    skip_gate = None

    def inject(i, x):
        if i in (0, 1, 2, 4, 5, 7):
            x = x + x0 * x0_g[i]
        if i in (0, 1, 4, 5, 9) and i != 0:
            x = x + bigram * bg_g[i]
        return x

    for i in range(L):
        b = blocks[i]
        mu = None
        if i == 4:  # post lanes: attn gate[10] (H), x0[4, 5, 7], bigram[4, 5, 9], skip
            post, _ = _mlp_coefs(x, mg.w1[1], mg.w2[1], mg.b2[1], H + 7, mg.scale)
            attn_gate[10] = post[..., :H]
            x0_g.update({k: post[..., H + j : H + j + 1] for j, k in enumerate((4, 5, 7))})
            bg_g.update({k: post[..., H + 3 + j : H + 4 + j] for j, k in enumerate((4, 5, 9))})
            skip_gate = post[..., H + 6 : H + 7]
        if i == 6:
            x = x + torch.sigmoid(model.skip_weights[0]) * skip_gate * cache[3]
        elif i in (4, 7, 9):
            x = inject(i, b.lambdas[0] * x)
        else:
            h = _norm(cache.get(7, x))
            aux = ve_of.get(i)
            if i == L - 1:
                cache[9] = x
                c, _ = _mlp_coefs(x, mudd.w1[0], mudd.w2[0], mudd.b2[0], 14, 0.1)
                mu = c.split(1, dim=-1)
                B, T, C = x.shape
                v_mudd = (mu[0] * cache[0] + mu[1] * cache[7] + mu[2] * x).view(B, T, H, C // H)
                x = (1 + mu[5]) * x + mu[3] * cache[0] + mu[4] * cache[7]
                gate = torch.cat([mu[6], mu[7]], dim=-1).repeat_interleave(H // 2, dim=-1).unsqueeze(-1)
                aux = (gate * aux.view(B, T, H, C // H) + v_mudd).view(B, T, C)
            dyn = {k: g[i] for k, g in (("xsa", xsa), ("attn", attn_gate)) if i in g}
            y = b.attn(h, contexts[i], aux, dyn)[0]
            if mu is not None:
                x = mu[8] * x + mu[9] * y + mu[10] * cache[0] + mu[11] * bigram
            else:
                x = inject(i, b.lambdas[0] * x + b.post_lambdas[0] * y)
        if i == 7:
            x = b.lambdas[1] * x
            cache[7] = x
            continue
        mlp_in = _norm(x)
        if mu is not None:
            x = mu[12] * x + mu[13] * b.mlp(mlp_in)
        else:
            x = b.lambdas[1] * x + b.post_lambdas[1] * b.mlp(mlp_in)
        if i == 8:
            x = x + b.post_lambdas[1] * b.mlp2(mlp_in)
        if i == 3:
            cache[3] = x
    sources = [cache[0], cache[7], cache[9], ve[0], cache[3], ve[1], ve[3], ve[2], mlp_in, _norm(cache[7])]
    n, G = len(sources), mudd.groups
    c, hid = _mlp_coefs(x, mudd.w1[1], mudd.w2[1], mudd.b2[1], n, 0.1)
    deltas = torch.einsum("btd,kgd->btkg", hid, mudd.w2g[:n]) * 0.1
    mixed = x.unflatten(-1, (G, -1))
    for k, src in enumerate(sources):
        mixed = mixed + (c[..., k : k + 1] + deltas[..., k, :]).unsqueeze(-1) * src.unflatten(-1, (G, -1))
    return _norm(mixed.flatten(-2))


@pytest.mark.parametrize("width", [[], FULL_WIDTH], ids=["reduced-width", "full-width"])
def test_the_forward_and_every_gradient_are_the_records_loop(width):
    """Reduced width (64 dims, 2 heads) and #92's own (768, 6 heads of 128, MLP 2,816, 12 MUDD groups), with
    a small table and vocabulary."""
    model = _small_model(width)
    d = model.cfg.n_embd
    gen = torch.Generator().manual_seed(3)
    idx = torch.randint(0, 511, (1, 128), generator=gen)
    idx[0, 40] = 511
    cu = torch.tensor([0, 40, 128], dtype=torch.int32)
    contexts = model.layer_contexts(idx, cu)
    probe = torch.randn(1, 128, d, generator=gen)
    params = dict(model.named_parameters())

    def run(forward):
        model.zero_grad(set_to_none=True)
        out = forward()
        (out * probe).sum().backward()
        return out.detach(), {n: p.grad.clone() if p.grad is not None else None for n, p in params.items()}

    ours, g_ours = run(lambda: model.hidden(idx, contexts))
    ref, g_ref = run(lambda: record_forward(model, idx, contexts))
    assert torch.equal(ours, ref)  # the same ops in the same order
    assert g_ours.keys() == g_ref.keys()
    for n in params:
        if g_ref[n] is None:
            assert g_ours[n] is None or not g_ours[n].any(), n
            continue
        assert g_ours[n] is not None, n
        scale = g_ref[n].abs().max().item()  # fp32 sums in another order: to 1e-5 of the gradient's size
        torch.testing.assert_close(g_ours[n], g_ref[n], rtol=1e-4, atol=1e-5 * scale, msg=n)
    # the #92 paths carry gradient: the post-loop deltas, the parallel MLP, layer 7's resid lambdas
    for n in ("mudd.w2g", "blocks.8.mlp2.c_fc.weight", "blocks.7.lambdas"):
        assert n in params and g_ours[n].abs().sum() > 0, n
