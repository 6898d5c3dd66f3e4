"""Step 4 of issue 26 (record-2026-07's parts) against the record scripts' own lines, transcribed here as
independent references: #83's bigram sign trick, #88's prefix-token table and loss, #84/#89's FP8 MLP
forward (vs its bf16 twin and the record's scale formulas), #85's DC correction, #344's Q/K width and
#350's canonical-token validation mask. Each comparison uses identical tiny weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from speedrun.errors import ConfigError
from speedrun.model.families import build_model
from speedrun.model.gpt2026.bigram_sign import SignedBigramEmbed, sign_index
from speedrun.model.gpt2026.embeddings import bigram_hash
from speedrun.recipes import load_recipe
from tests.decoding import assert_cached_decoding_is_the_forward
from tests.fidelity.checks import jitter_
from tests.recipe_matrix import replace

BASE = "stages-2025-12"


def tiny(overrides: list[str], **shape):
    cfg = load_recipe(BASE, overrides)
    fields = dict(n_head=2, n_embd=64, vocab_size=120, max_seq_len=256, embed_dtype="fp32", fp8_head=False)
    fields.update(shape)
    return replace(cfg.model, **fields)


# ---- #83: the bigram sign trick ----------------------------------------------------------------------


def record_83_x0_bigram(input_seq, bigram_input_seq, bigram_embed_weight, bigram_sign_table):
    """#83's GPT.forward lines (HEAD 1535-1538) on a rank's flat sequence."""
    sign_idx = torch.zeros_like(input_seq)
    sign_idx[1:] = (input_seq[:-1] ^ input_seq[1:]) % bigram_sign_table.shape[0]
    bigram_signs = bigram_sign_table[sign_idx]
    return (F.embedding(bigram_input_seq, bigram_embed_weight) * bigram_signs)[None]


def test_sign_trick_rows_and_gradient_are_the_records():
    torch.manual_seed(0)
    rows, dim, signs = 1000, 16, 64
    emb = SignedBigramEmbed(rows, dim, 4, signs)
    assert emb.sign_table.dtype == torch.bfloat16 and set(emb.sign_table.unique().tolist()) == {-1.0, 1.0}
    with torch.no_grad():
        emb.embed.weight.normal_()
    seq = torch.randint(0, 50257, (300,), generator=torch.Generator().manual_seed(1))
    w = emb.embed.weight.detach().clone().requires_grad_(True)
    ref = record_83_x0_bigram(seq, bigram_hash(seq[None], rows)[0], w, emb.sign_table)
    ours = emb(seq[None])
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    g = torch.randn_like(ref)
    ours.backward(g)
    ref.backward(g)
    torch.testing.assert_close(emb.embed.weight.grad, w.grad, rtol=0, atol=0)
    # the sign rows matter: the plain #62 lookup differs
    assert not torch.equal(ours, F.embedding(bigram_hash(seq[None], rows), w)[None][0])


def test_sign_index_continues_across_cached_steps():
    seq = torch.randint(0, 50257, (1, 50), generator=torch.Generator().manual_seed(2))
    full = sign_index(seq, 8192)
    for start in (1, 2, 30):
        assert torch.equal(
            sign_index(seq[:, start:], 8192, seq[:, start - 1 : start], start), full[:, start:]
        )


def test_model_with_sign_trick_decodes_like_its_forward_and_refuses_it_without_the_table():
    cfg = tiny(["model.bigram_rows=1000", "model.bigram_sign_rows=64"])
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    assert isinstance(model.bigram, SignedBigramEmbed) and "bigram.sign_table" in model.state_dict()
    jitter_(model, 0.05)
    idx = torch.randint(0, 119, (1, 30), generator=torch.Generator().manual_seed(2))
    assert_cached_decoding_is_the_forward(model, idx, 20)
    with pytest.raises(ConfigError, match="bigram_sign_rows"):
        load_recipe(BASE, ["model.bigram_sign_rows=64"])


# ---- #88: the prefix-token auxiliary loss ----------------------------------------------------------


def record_88_build_prefix_table(byte_to_id, vocab_size):
    """#88's build_prefix_table (HEAD 1175-1198), the ranks passed in instead of read from tiktoken."""
    table = [-1] * vocab_size
    stack, stack_ids = [], []
    for b, tid in sorted(byte_to_id.items()):
        while stack and not b.startswith(stack[-1]):
            stack.pop()
            stack_ids.pop()
        if stack_ids:
            table[tid] = stack_ids[-1]
        stack.append(b)
        stack_ids.append(tid)
    return torch.tensor(table, dtype=torch.int64)


def test_prefix_table_is_the_records_on_the_gpt2_vocabulary():
    from speedrun.data.tokenizers import gpt2_tokenizer
    from speedrun.model.gpt2026.prefix import gpt2_prefix_table

    enc = gpt2_tokenizer().encoding
    ours = gpt2_prefix_table(50304)
    torch.testing.assert_close(
        ours, record_88_build_prefix_table(enc._mergeable_ranks, 50304), rtol=0, atol=0
    )
    speed, speedrun = enc.encode_single_token(b" speed"), enc.encode_single_token(b" speedy")
    assert ours[speedrun] == speed and ours[50256] == -1 and (ours >= 0).sum() == 50257 - 257


def record_88_prefix_term(logits, prefix_target_seq, prefix_weight):
    """The fused CE kernel's prefix term per row (triton_kernels.py HEAD 1066-1088):
    `total_loss += prefix_weight * (lse - z_target)` where `prefix_target >= 0`, summed over rows."""
    lse = torch.logsumexp(logits, dim=-1)
    total = torch.zeros((), dtype=torch.float64)
    for i in range(logits.size(0)):
        if prefix_target_seq[i] >= 0:
            total = total + prefix_weight * (lse[i] - logits[i, prefix_target_seq[i]]).double()
    return total


def test_prefix_loss_and_gradients_are_the_records_in_the_model():
    cfg = tiny(["model.prefix_loss_weight=0.25"], vocab_size=50257, max_seq_len=64, n_embd=32, ce_bf16=False,
        logit_softcap=11.5, softcap_divisor=7.5, softcap_offset=5.0, softcap_in_bf16=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg).train()
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.05)
    idx = torch.randint(0, 50257, (1, 64), generator=torch.Generator().manual_seed(3))
    targets = torch.randint(256, 50257, (1, 64), generator=torch.Generator().manual_seed(4))
    loss = model(idx, targets)
    hidden = model.hidden(idx, model.layer_contexts(idx)).detach().requires_grad_(True)
    head_w = model.lm_head.weight.detach().clone().requires_grad_(True)
    logits = 23 * torch.sigmoid((F.linear(hidden, head_w) + 5) / 7.5)  # #54's cap, fp32
    prefix_targets = model.prefix_table[targets[0]]
    assert (prefix_targets >= 0).sum() > 50
    main = F.cross_entropy(logits[0], targets[0], reduction="sum")  # #53's MTP weights (1, 0, …) at start
    ref = (main + record_88_prefix_term(logits[0], prefix_targets, 0.25).float()) / 64
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    loss.backward()
    ref.backward()
    torch.testing.assert_close(model.lm_head.weight.grad, head_w.grad, rtol=1e-4, atol=1e-7)
    model.eval()  # validation: plain cross-entropy
    with torch.no_grad():
        torch.testing.assert_close(model(idx, targets), main.detach() / 64, rtol=1e-5, atol=1e-6)


# ---- #84 / #89: FP8 MLP forward ------------------------------------------------------------------------

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


def record_quantize_mlp_fp8(up_weights, down_weights, next_scales, bootstrap_down):
    """#89's GPT.quantize_mlp_fp8 (HEAD 1403-1435) for one layer, with the Triton
    quantize_transpose_mlp_down_weights kernel + reduce (triton_kernels.py 525-565, 732-779) in torch.
    up_weights (hidden, d); down_weights (hidden, d) as the record's bank stores c_proj."""
    up_scales = up_weights.view(1, -1).abs().amax(dim=1).clamp(min=1e-12) / E4M3_MAX
    up_f8 = (up_weights / up_scales.view(1, 1)).to(torch.float8_e4m3fn)
    if bootstrap_down:
        next_scales = (down_weights.view(1, -1).abs().amax(dim=1).clamp(min=1e-12) / E4M3_MAX).float()
    values = down_weights.float()
    quantized = torch.maximum(torch.minimum(values / next_scales, torch.tensor(448.0)), torch.tensor(-448.0))
    down_f8_storage = quantized.t().to(torch.float8_e4m3fn)  # (d, hidden)
    used = next_scales.clone()
    new_next = torch.maximum(values.abs().max(), torch.tensor(1.0e-12)) * (1.12 / 448.0)
    return up_f8, up_scales.float(), down_f8_storage, used, new_next.reshape(1)


def record_fp8_mlp_forward(normed, up_f8, up_scale, down_f8_storage, down_scale, act_scale):
    """#89's MLP lines in GPT.forward (HEAD 1643-1668) and FusedLinearReLUSquareFunction.forward with
    linear_relu_square_kernel's FP8 epilogue, written with torch._scaled_mm in place of Triton."""
    amax = normed.detach().abs().max().clamp(min=1e-12)
    x_f8 = (normed.detach() * (448.0 / amax)).to(torch.float8_e4m3fn)
    dequant = torch.ones(1).copy_(up_scale).mul_(amax).div_(448.0)
    acc = torch._scaled_mm(x_f8, up_f8.t(), scale_a=dequant, scale_b=torch.ones(()), out_dtype=normed.dtype)
    post = torch.maximum(acc, torch.zeros(())) * torch.maximum(acc, torch.zeros(()))
    inverse_activation_scale = 1.0 / act_scale
    post_fp8 = torch.minimum(post.float() * inverse_activation_scale, torch.tensor(448.0)).to(
        torch.float8_e4m3fn
    )
    x3 = torch._scaled_mm(
        post_fp8, down_f8_storage.t(), out_dtype=normed.dtype, scale_a=act_scale, scale_b=down_scale,
        use_fast_accum=True,
    )  # fmt: skip
    next_act = torch.maximum(post.float().max(), torch.tensor(1.0e-12)) * (1.80 / 448.0)
    return x3, post, next_act.reshape(1)


@pytest.fixture
def real_scaled_mm(monkeypatch):
    from speedrun.model import fp8

    monkeypatch.setattr(fp8, "SCALED_MM_ON_CPU", True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_mlp_forward_scales_and_gradients_are_the_records(real_scaled_mm, dtype):
    from speedrun.model.gpt2026.fp8_mlp import Fp8MLP

    torch.manual_seed(0)
    d, hidden, N = 64, 256, 48
    mlp = Fp8MLP(d, hidden).train()
    mlp.c_fc.to(dtype), mlp.c_proj.to(dtype)  # the scales stay fp32, as the record's buffers
    with torch.no_grad():
        mlp.c_proj.weight.normal_(0, 0.02)
    next_scale = torch.ones(1)
    for step in (0, 1, 15, 16, 17):  # bootstrapped refreshes, then delayed weight scales
        with torch.no_grad():
            mlp.c_fc.weight.mul_(1.1)
            mlp.c_proj.weight.mul_(1.3)
        ref = record_quantize_mlp_fp8(
            mlp.c_fc.weight.detach(), mlp.c_proj.weight.detach().t().contiguous(), next_scale, step < 16
        )
        mlp.refresh_fp8(step)
        up_f8, up_scale, down_f8, used, next_scale = ref
        assert torch.equal(mlp.up_f8.view(torch.uint8), up_f8.view(torch.uint8)), step
        assert torch.equal(mlp.down_f8.view(torch.uint8), down_f8.view(torch.uint8)), step
        torch.testing.assert_close(mlp.up_scale, up_scale, rtol=0, atol=0)
        torch.testing.assert_close(mlp.down_scale, used, rtol=0, atol=0)
        torch.testing.assert_close(mlp.down_next_scale, next_scale, rtol=0, atol=0)
    # two forwards: the second uses the activation scale the first measured (delayed)
    act = torch.ones(1)
    for seed in (1, 2):
        x = torch.randn(1, N, d, generator=torch.Generator().manual_seed(seed)).to(dtype).requires_grad_(True)
        out_ref, post, next_act = record_fp8_mlp_forward(
            x[0], mlp.up_f8, mlp.up_scale, mlp.down_f8, mlp.down_scale, act
        )
        out = mlp(x)
        torch.testing.assert_close(out[0], out_ref, rtol=0, atol=0)
        torch.testing.assert_close(mlp.act_scale, next_act, rtol=0, atol=0)
        act = next_act
    # gradients: the record's bf16 backward from `post` (FusedLinearReLUSquareFunction.backward)
    w1 = mlp.c_fc.weight.detach().clone().requires_grad_(True)
    w2 = mlp.c_proj.weight.detach().clone().requires_grad_(True)
    g = torch.randn_like(out)
    out.backward(g)
    pre_relu = post.sqrt()
    grad_pre = (g[0] @ w2) * 2 * pre_relu
    tol = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(mlp.c_proj.weight.grad, (post.t() @ g[0]).t(), **tol)
    torch.testing.assert_close(mlp.c_fc.weight.grad, grad_pre.t() @ x[0].detach(), **tol)
    torch.testing.assert_close(x.grad[0], grad_pre @ w1.detach(), **tol)


def test_fp8_mlp_is_its_bf16_twin_within_fp8_error_and_the_twin_at_eval(real_scaled_mm):
    from speedrun.model.gpt2026.fp8_mlp import Fp8MLP

    torch.manual_seed(0)
    mlp = Fp8MLP(64, 256).train()
    mlp.c_fc.bfloat16(), mlp.c_proj.bfloat16()
    with torch.no_grad():
        mlp.c_proj.weight.normal_(0, 0.05)
    mlp.refresh_fp8(0)
    x = torch.randn(2, 32, 64).bfloat16()
    mlp(x)  # measures the activation scale
    fp8_out = mlp(x)
    twin = F.linear(F.relu(F.linear(x, mlp.c_fc.weight)).square(), mlp.c_proj.weight)
    err = (fp8_out.float() - twin.float()).norm() / twin.float().norm()
    assert 1e-4 < err < 0.06, err  # e4m3 has 3 mantissa bits: a few percent, but not exact
    mlp.eval()
    torch.testing.assert_close(mlp(x), twin, rtol=0, atol=0)


def test_model_with_fp8_mlp_trains_near_its_twin_and_evaluates_as_it(real_scaled_mm):
    twin_cfg = tiny([], max_seq_len=64)
    torch.manual_seed(0)
    twin = build_model(twin_cfg).train()
    model = build_model(replace(twin_cfg, mlp_fp8=True)).train()
    assert sum(type(b.mlp).__name__ == "Fp8MLP" for b in model.blocks if b.mlp is not None) > 0
    weights = {n: p.detach() + 0.02 * torch.randn_like(p) for n, p in twin.named_parameters()}
    twin.load_state_dict(weights, strict=False)
    model.load_state_dict(weights, strict=False)
    model.refresh_fp8(-1)
    idx = torch.randint(0, 119, (1, 64), generator=torch.Generator().manual_seed(5))
    cu = torch.tensor([0, 64], dtype=torch.int32)
    model(idx, idx, cu)  # the first forward measures the activation scales
    loss, ref = model(idx, idx, cu), twin(idx, idx, cu)
    assert 0 < abs(loss.item() - ref.item()) < 0.02 * ref.item()
    model.eval(), twin.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(idx, idx, cu), twin(idx, idx, cu), rtol=0, atol=0)
    with pytest.raises(ConfigError, match="model.mlp.fp8"):
        load_recipe(BASE, ["model.mlp_fp8=true", "model.mlp_fc_transposed=true"])


def test_the_step_4_switches_train_shrunk_together():
    """#83 + #88 + #84/#89 on the shrunk #53 recipe: a few steps through the training step, finite and
    falling (the FP8 copies refreshed before each step, as the loop does)."""
    from speedrun.train.schedule import apply_schedule, schedule_at
    from speedrun.train.step import train_step
    from tests.recipe_matrix import autocast_dtype, batch, build, rows, shrunk

    extra = ["model.bigram_rows=500", "model.bigram_sign_rows=64", "model.prefix_loss_weight=0.25"]
    cfg = shrunk(BASE, *extra, "model.mlp_fp8=true")
    model, optimizer = build(cfg)
    losses = []
    for step in range(6):
        sched = schedule_at(step, cfg)
        apply_schedule(sched, optimizer, model)
        model.refresh_fp8(step - 1)
        x, y = batch(0, cfg)  # one batch over and over: the loss must fall
        parts = iter(range(x.size(0)))

        def next_batch(x=x, y=y, parts=parts):
            i = next(parts)
            return rows(cfg, x[i : i + 1], y[i : i + 1])

        loss = train_step(model, optimizer, next_batch, x.size(0), autocast_dtype(cfg), 0.0, sched.grad_scale)
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses


# ---- #85: the lightweight DC correction -------------------------------------------------------------


def record_85_dc_correction(base, q, k, v, post_w1, post_w2, scaling, window, seq_lens):
    """_dc_postonly_corr_fwd_wsmall_cached_kernel with its head helpers (dc_triton_kernels.py 90-440),
    one query row at a time: the window's keys in the query's document, exp2 softmax,
    a_acc = Σ_h w1_h·p_h, out_h = base_h + (w2_h·a_acc) @ v_h."""
    T, H, _ = q.shape
    out = []
    for t in range(T):
        doc_start = max(int(s) for s in seq_lens if s <= t)
        k_start = max(t - window + 1, doc_start)
        ks = list(range(k_start, t + 1))
        a_acc = 0
        for h in range(H):
            score = (k[ks, h] @ q[t, h]) * (scaling * 1.4426950408889634)
            p = torch.exp2(score - score.max())
            a_acc = a_acc + post_w1[t, h] * (p / p.sum())
        out.append(torch.stack([base[t, h] + (post_w2[t, h] * a_acc) @ v[ks, h] for h in range(H)]))
    return torch.stack(out)


def test_dc_correction_and_its_gradients_are_the_records_kernel():
    from speedrun.model.gpt2026.dc import dc_gate
    from tests.model_refs import dc_correction

    T, H, D, window = 40, 3, 8, 7
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(T, H, D, generator=gen, dtype=torch.float64) for _ in range(4)]
    raw = [torch.randn(T, H, generator=gen, dtype=torch.float64) for _ in range(2)]
    cu = torch.tensor([0, 13, 14, 40], dtype=torch.int32)
    ours_in = [t.clone().requires_grad_(True) for t in tensors + raw]
    ref_in = [t.clone().requires_grad_(True) for t in tensors + raw]
    w1, w2 = dc_gate(*ours_in[4:], ours_in[0])
    ours = dc_correction(*ours_in[:4], w1, w2, 0.12, window, cu)
    rw1 = F.rms_norm(ref_in[4].float(), (H,), eps=1.0e-6).double()  # the record's dc_gate
    ref = record_85_dc_correction(*ref_in[:4], rw1, ref_in[5], 0.12, window, cu.tolist()[:-1])
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)  # fp32 probabilities in ours
    g = torch.randn(T, H, D, generator=gen, dtype=torch.float64)
    ours.backward(g)
    ref.backward(g)
    for name, a, b in zip(["y", "q", "k", "v", "w1", "w2"], ours_in, ref_in, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert (ours - tensors[0]).abs().max() > 0.1  # the correction is not nothing


# ---- #350: the canonical-token validation mask -------------------------------------------------------


def record_350_build_canonical_mask(ranks, vocab_size):
    """PR #350's build_canonical_mask and its helpers (3b8dd5d9 train_gpt.py 1202-1290), the ranks
    passed in instead of read from tiktoken."""
    import unicodedata

    import numpy as np

    _CLS = "SNLO?"
    _SEAM_OK = np.ones((len(_CLS), len(_CLS)), dtype=bool)
    _SEAM_OK[:, _CLS.index("?")] = False
    _SEAM_OK[_CLS.index("S"), _CLS.index("S")] = False
    _SEAM_OK[_CLS.index("O"), _CLS.index("L")] = False
    _CONTRACTIONS = ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d")

    def _char_cls(ch):
        if ch.isspace() and not "\x1c" <= ch <= "\x1f":
            return "S"
        cat = unicodedata.category(ch)[0]
        return cat if cat in "LN" else "O"

    def _edge_cls(b, first):
        for n in range(1, 5):
            try:
                s = (b[:n] if first else b[-n:]).decode()
            except UnicodeDecodeError:
                continue
            return _CLS.index(_char_cls(s[0] if first else s[-1]))
        return _CLS.index("?")

    def _ends_contraction(text):
        for c in _CONTRACTIONS:
            if text.endswith(c):
                before = text[: -len(c)]
                return not before or _char_cls(before[-1]) in "LN"
        return False

    tok = {v: k for k, v in ranks.items()}
    never = 1 << 30
    firsts, lasts, rules = {}, {}, {}
    for tid, b in tok.items():
        pieces = [bytes([c]) for c in b]
        first_traj, last_traj = [(0, pieces[0])], [(0, pieces[-1])]
        while len(pieces) > 1:
            best = best_i = None
            for i in range(len(pieces) - 1):
                r = ranks.get(pieces[i] + pieces[i + 1])
                if r is not None and (best is None or r < best):
                    best, best_i = r, i
            if best is None:
                break
            rules[tid] = (pieces[best_i], pieces[best_i + 1])
            pieces[best_i : best_i + 2] = [pieces[best_i] + pieces[best_i + 1]]
            if best_i == 0:
                first_traj.append((best + 1, pieces[0]))
            if best_i == len(pieces) - 1:
                last_traj.append((best, pieces[-1]))
        firsts[tid], lasts[tid] = first_traj, last_traj

    def by_piece(trajs):
        idx = {}
        for tid, traj in trajs.items():
            for i, (start, piece) in enumerate(traj):
                end = traj[i + 1][0] if i + 1 < len(traj) else never
                if start < end:
                    idx.setdefault(piece, []).append((start, end, tid))
        return idx

    by_last, by_first = by_piece(lasts), by_piece(firsts)
    end_cls = np.full(vocab_size, _CLS.index("?"), dtype=np.intp)
    start_cls = np.full(vocab_size, _CLS.index("?"), dtype=np.intp)
    closed = np.zeros(vocab_size, dtype=bool)
    for tid, b in tok.items():
        end_cls[tid], start_cls[tid] = _edge_cls(b, first=False), _edge_cls(b, first=True)
        try:
            closed[tid] = _ends_contraction(b.decode())
        except UnicodeDecodeError:
            pass
    mask = np.zeros((vocab_size, vocab_size), dtype=bool)
    for rank, (a, b) in rules.items():
        ps = np.array([p for s, e, p in by_last.get(a, ()) if s <= rank < e], dtype=np.intp)
        ps = ps[~closed[ps]]
        xs = np.array([x for s, e, x in by_first.get(b, ()) if s <= rank < e], dtype=np.intp)
        if len(ps) and len(xs):
            mask[np.ix_(ps, xs)] |= _SEAM_OK[np.ix_(end_cls[ps], start_cls[xs])]
    return torch.from_numpy(np.packbits(mask, axis=1, bitorder="little"))


def test_canonical_mask_is_the_records_on_a_gpt2_sub_vocabulary():
    """The first 6,000 GPT-2 ranks are a vocabulary of their own (a merge's parts rank below it)."""
    from speedrun.data.tokenizers import gpt2_tokenizer
    from speedrun.model.gpt2026.canonical import canonical_mask

    V = 6000
    ranks = {b: r for b, r in gpt2_tokenizer().encoding._mergeable_ranks.items() if r < V}
    ours = canonical_mask(ranks, V)
    ref = record_350_build_canonical_mask(ranks, V)
    assert ours.dtype == torch.uint8 and ours.shape == (V, V // 8)
    assert torch.equal(ours, ref), (ours != ref).sum()
    assert ours.bool().sum() > 1000  # it drops pairs


def test_canonical_mask_drops_what_the_tokenizer_never_emits_at_validation_only():
    from speedrun.data.tokenizers import gpt2_tokenizer
    from speedrun.model.gpt2026.canonical import canonical_mask, mask_logits

    enc = gpt2_tokenizer().encoding
    V = 6000
    packed = canonical_mask({b: r for b, r in enc._mergeable_ranks.items() if r < V}, V)
    # real text re-encodes to itself: none of its own pairs is dropped
    ids = enc.encode_ordinary("The cat sat on the mat, and then it ran away.")
    assert max(ids) < V
    bits = [(packed[p, x // 8] >> (x % 8)) & 1 for p, x in zip(ids, ids[1:], strict=False)]
    assert sum(int(b) for b in bits) == 0
    # the record's forward lines (PR #350 train_gpt.py 1810-1813) on random logits
    logits = torch.rand(1, 5, V) * 23
    idx = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(0))
    shifts = torch.arange(8, dtype=torch.uint8)
    dropped = (packed[idx.view(-1), :, None] >> shifts & 1).view(5, V).bool()
    ref = logits.view(5, V).masked_fill(dropped, -60.0)
    torch.testing.assert_close(mask_logits(logits, idx, packed).view(5, V), ref, rtol=0, atol=0)


def test_model_masks_validation_only():
    from speedrun.model.gpt2026.canonical import DROPPED_LOGIT

    cfg = tiny(["model.canonical_val_mask=true"], vocab_size=600, max_seq_len=64, n_embd=32, ce_bf16=False)
    torch.manual_seed(0)
    model = build_model(cfg)
    plain = build_model(replace(cfg, canonical_val_mask=False))
    assert "canonical_mask" not in model.state_dict() and model.canonical_mask.shape == (640, 80)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.1)
    plain.load_state_dict(model.state_dict())
    idx = torch.randint(256, 600, (1, 64), generator=torch.Generator().manual_seed(1))
    cu = torch.tensor([0, 64], dtype=torch.int32)
    model.train(), plain.train()
    torch.testing.assert_close(model(idx, idx, cu), plain(idx, idx, cu), rtol=0, atol=0)
    model.eval(), plain.eval()
    with torch.no_grad():
        hidden = plain.hidden(idx, plain.layer_contexts(idx))
        logits = plain.capped_logits(hidden).float()
        shifts = torch.arange(8, dtype=torch.uint8)
        dropped = (model.canonical_mask[idx[0], :, None] >> shifts & 1).view(64, -1).bool()
        assert dropped.any()
        ref = F.cross_entropy(logits[0].masked_fill(dropped, DROPPED_LOGIT), idx[0])
        torch.testing.assert_close(model(idx, idx, cu), ref, rtol=1e-5, atol=1e-6)
        # where the target itself is a pair the tokenizer emits, masking only lowers its loss
        kept = ~dropped.gather(1, idx[0, :, None])[:, 0]
        ours, theirs = model(idx, idx, cu, reduction="none")[0], plain(idx, idx, cu, reduction="none")[0]
        assert (ours[kept] <= theirs[kept] + 1e-6).all() and (ours[kept] < theirs[kept]).any()


def record_88_prefix_weights(scheduled, extension, durations, starts, ends):
    """HEAD's TrainingSchedule.__init__/lookup (train_gpt.py 1932-1967): the prefix weight per step."""
    from itertools import accumulate, pairwise

    total = scheduled + extension
    bounds = list(pairwise([0, *[round(c * scheduled) for c in accumulate(durations)], total]))
    out = []
    for step in range(total + 1):
        stage, t = len(bounds) - 1, 1.0
        for i, (start, end) in enumerate(bounds):
            if step < end:
                stage, t = i, (step - start) / (end - start)
                break
        out.append(starts[stage] + (ends[stage] - starts[stage]) * t)
    return out


def test_prefix_weight_follows_the_records_stages_at_every_step():
    from speedrun.train.schedule import apply_to_model, schedule_at

    stages = (
        "tokens=131072 doc=896 windows=1/3 lr=1 frac=1/3 prefix=0.25; "
        "tokens=262144 doc=2048 windows=3/7 lr=1.52 frac=1/3 prefix=0.25>0; "
        "tokens=393216 doc=2048 windows=5/11 lr=1.73 frac=1/3 prefix=0; "
        "tokens=393216 doc=2048 windows=6/13 ext=15 val=6/20 yarn=13 prefix=0"
    )
    cfg = load_recipe(
        BASE, [f"train.stages={stages}", "train.steps=1285", "train.stage_bounds=round", "model.mtp=0",
               "model.prefix_loss_weight=0.25"],
    )  # fmt: skip
    cfg.model = replace(cfg.model, n_head=2, n_embd=32, vocab_size=120, max_seq_len=256)
    model = build_model(cfg.model)
    ref = record_88_prefix_weights(1270, 15, [1 / 3] * 3, [0.25, 0.25, 0, 0], [0.25, 0.0, 0, 0])
    ours = []
    for step in range(1286):
        apply_to_model(schedule_at(step, cfg), model)
        ours.append(model.prefix_weight.item())
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref, dtype=torch.float32), rtol=0, atol=0)
    assert ours[0] == 0.25 and ours[-1] == 0.0 and 0 < ours[635] < 0.25


@pytest.mark.slow  # end to end through the CLI
def test_speedrun_train_runs_the_step_4_switches_with_fp8_refreshed_by_the_loop(text_data, tmp_path):
    import json
    import math

    from speedrun.train import loop
    from tests.e2e.test_stages_training import staged

    switches = [
        "model.bigram_rows=500", "model.bigram_sign_rows=64", "model.prefix_loss_weight=0.25",
        "model.mlp_fp8=true", "model.canonical_val_mask=true",
    ]  # fmt: skip
    seen = []
    real = loop.train_step

    def recording_step(model, *args):
        mlp = next(b.mlp for b in getattr(model, "module", model).blocks if b.mlp is not None)
        seen.append((mlp.up_scale.item(), mlp.down_scale.item()))
        return real(model, *args)

    from speedrun.data.prepare import prepare

    # #88's prefix table and #350's mask hold GPT-2 ids: the same documents in GPT-2 tokens
    gpt2_data = prepare(
        f"text:{text_data.parent / 'docs.jsonl'}", "gpt2", tmp_path / "gpt2", log=lambda *_: None
    )
    loop.train_step = recording_step
    try:
        over = staged(gpt2_data, *switches, "model.vocab_size=50257", "data.tokenizer=gpt2")
        loop.train(load_recipe("demo", over), tmp_path / "run")
    finally:
        loop.train_step = real
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) >= 2 and all(math.isfinite(v) for v in val)
    assert len(seen) == 14 and all(up != 1.0 for up, _ in seen)  # refreshed before every step


@pytest.mark.parametrize("switch", ["model.prefix_loss_weight=0.25", "model.canonical_val_mask=true"])
def test_gpt2_id_tables_need_the_gpt2_tokenizer(switch, capsys):
    """#88's prefix table and #350's mask hold GPT-2 BPE ids: with another tokenizer they would weight or
    mask unrelated tokens, so the config refuses it in one line (exit 2)."""
    from speedrun.cli import main

    assert main(["train", "--dry-run", "--recipe", "banks-2026-01", switch, "data.tokenizer=bpe:4096"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs data.tokenizer = gpt2, got bpe:4096" in err[0], err
    assert main(["train", "--dry-run", "--recipe", "banks-2026-01", switch]) == 0  # GPT-2 ids: fine
