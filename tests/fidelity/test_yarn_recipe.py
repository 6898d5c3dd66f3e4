"""Recipe `yarn-2025-09` against record #31's script (records/track_1_short/2025-09-10_Yarn, the code at
the top of each log), its formulas written here: the schedules (LR, momentum, windows, YaRN) at every
step, the tokens and cu_seqlens of every step on the record's 8 ranks, the fp32 forward loss and
gradients of its model (FA3 replaced by a dense document-causal window mask of FA3's semantics), three
steps of its Muon and DistAdam, and 1 vs 2 processes training the recipe shrunk."""

from __future__ import annotations

import math
import re
from itertools import accumulate
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from speedrun.errors import ConfigError
from speedrun.model.families import build_model
from speedrun.model.gpt2026.yarn import yarn_after
from speedrun.recipes import load_recipe
from speedrun.train.evaluate import row_cu_seqlens
from speedrun.train.plan.run_data import RunData, open_loader
from speedrun.train.schedule import apply_schedule, apply_to_model, schedule_at
from tests import two_processes
from tests.fidelity.checks import fp32_model, jitter_, shrunk_with_optimizer, two_documents
from tests.fidelity.test_bos_align_optimizer import record_adam_step
from tests.fidelity.test_bos_align_recipe import _ctx, assert_one_and_two_processes_train_alike
from tests.fidelity.test_bos_loader import BOS, make_shards
from tests.recipe_matrix import shrink

RECIPE = "yarn-2025-09"
ROOT = Path(__file__).resolve().parents[2]
N, BLOCK, WS_SCHEDULE, WS_VALIDATE = 1670, 128, (3, 7, 11), 13


def next_multiple_of_n(v, *, n):
    return next(x for x in range(n, int(v) + 1 + n, n) if x >= v)


def record_lr(step: int) -> float:
    x = step / N
    assert 0 <= x < 1
    lr = 1.0
    if x >= 1 - 0.5:
        w = (1 - x) / 0.5
        lr = w * 1.0 + (1 - w) * 0.1
    return lr


def record_ws(step: int) -> int:
    if step == N:
        return WS_VALIDATE
    x = step / (1 + N)
    assert 0 <= x < 1
    return WS_SCHEDULE[int(len(WS_SCHEDULE) * x)]


class RecordYarn:
    """#31's GPT.setup_yarn and GPT.apply_yarn."""

    def __init__(self, head_dim: int, max_seq_len: int):
        self.max_seq_len = max_seq_len
        angular_freq = (1 / 1024) ** torch.linspace(0, 1, steps=head_dim // 4, dtype=torch.float32)
        self.angular_freq = torch.cat([angular_freq, angular_freq.new_zeros(head_dim // 4)])
        theta = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), self.angular_freq)
        self.cos, self.sin = theta.cos(), theta.sin()
        windows = list(dict.fromkeys(list(WS_SCHEDULE) + [WS_VALIDATE]))
        factors = [
            0.2 * math.log(curr / prev) + 1 for prev, curr in zip(windows[:-1], windows[1:], strict=True)
        ]
        self.attn_scales = dict(
            zip(windows, accumulate([0.1] + factors, lambda acc, f: acc * f), strict=True)
        )

    def apply_yarn(self, old_window: int, new_window: int, alpha: int = 1, beta: int = 32) -> None:
        rotations = BLOCK * old_window * self.angular_freq / (2 * torch.pi)
        scaling_factor = old_window / new_window
        interpolation_weight = torch.clamp((rotations - alpha) / (beta - alpha), 0, 1)
        self.angular_freq *= scaling_factor + interpolation_weight * (1 - scaling_factor)
        theta = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float32), self.angular_freq)
        self.cos, self.sin = theta.cos(), theta.sin()


def test_schedules_at_every_step():
    cfg = load_recipe(RECIPE)
    assert cfg.train.steps == N
    rec, ws, seen = RecordYarn(128, 4), record_ws(0), None
    for step in range(N + 1):  # step N: the final validation
        new_ws = record_ws(step)
        if new_ws != ws:  # the record's training loop
            rec.apply_yarn(ws, new_ws)
            ws = new_ws
        got = schedule_at(step, cfg)
        if step < N:
            assert got.lr == pytest.approx(record_lr(step), rel=1e-12, abs=1e-15), step
        frac = min(step / 300, 1)
        assert got.muon_momentum == pytest.approx((1 - frac) * 0.85 + frac * 0.95, rel=1e-15), step
        v = got.stage
        assert (v.short_window, v.long_window) == (ws // 2, ws), step
        assert (v.batch_tokens, v.max_doc_len) == (2048 * 24 * 8, 128 * 16), step
        if got.yarn != seen:
            seen = got.yarn
            freqs, scale = yarn_after([b * BLOCK for b in got.yarn], 128, cfg.model.attn.scale)
        torch.testing.assert_close(freqs, rec.angular_freq, rtol=1e-6, atol=0, msg=str(step))
        assert scale == pytest.approx(rec.attn_scales[ws], rel=1e-12), step


def record31_generator(streams, num_tokens, max_seq_len, rank, world_size=8):
    """#31's BOSFinder.next_batch and distributed_data_generator (align_to_bos, grad_accum_steps 1)."""

    def next_batch(bos_idx, size, i, num_tokens_local):
        n = len(bos_idx)
        starts, ends = [[] for _ in range(world_size)], [[] for _ in range(world_size)]
        idx = i
        for r in range(world_size):
            cur_len = 0
            while cur_len <= num_tokens_local:
                if idx >= n:
                    raise StopIteration
                cur = bos_idx[idx]
                starts[r].append(cur)
                end = min(
                    bos_idx[idx + 1] if idx + 1 < n else size,
                    cur + max_seq_len,
                    cur + num_tokens_local - cur_len + 1,
                )
                ends[r].append(end)
                cur_len += end - cur
                idx += 1
            assert cur_len == num_tokens_local + 1
        return starts, ends, idx

    it = iter(streams)
    tokens = next(it)
    bos_idx, i = np.flatnonzero(tokens == BOS), 0
    while True:
        local = num_tokens // world_size
        max_num_docs = next_multiple_of_n(local // 300, n=128)
        try:
            starts, ends, i = next_batch(bos_idx, len(tokens), i, local)
        except StopIteration:
            tokens = next(it)
            bos_idx, i = np.flatnonzero(tokens == BOS), 0
            continue
        s, e = np.array(starts[rank]), np.array(ends[rank])
        buf = np.concatenate([tokens[a:b] for a, b in zip(s, e, strict=True)])
        e[-1] -= 1
        cum = np.cumsum(e - s)
        cu = np.full(max_num_docs, local)
        cu[0] = 0
        cu[1 : len(cum) + 1] = cum
        yield buf[:-1].astype(np.int64), buf[1:].astype(np.int64), cu


@pytest.mark.parametrize("world", [8, 2])
def test_tokens_and_cu_seqlens_of_every_step_are_the_records_8_ranks(tmp_path, world):
    local, doc = 256, 100
    stage = f"tokens={8 * local} doc={doc} windows=1/3"
    cfg = load_recipe(RECIPE, [f"train.micro_batch_tokens={local}", f"train.seq_len={local}",
                               f"train.global_batch_tokens={8 * local}",
                               f"train.stages={stage} frac=1; {stage} ext=0", "data.max_docs=0"])  # fmt: skip
    # the record's cu_seqlens length, next_multiple_of_n(local // 300, n=128): the table's for 256 tokens,
    # the recipe's data.max_docs for its 48K chunks
    full = load_recipe(RECIPE)
    assert full.data.max_docs == next_multiple_of_n(49152 // 300, n=128)
    val_row = torch.zeros(1, full.train.val_seq_len, dtype=torch.int64)  # validation: #31's val formula
    assert len(row_cu_seqlens(val_row, full)) == next_multiple_of_n(full.train.val_seq_len // 300, n=128)
    files, streams = make_shards(tmp_path, [16000, 18000, 17000, 20000], max_doc=300)
    data = RunData(files, files, local, None, None, BOS)
    loaders = [open_loader(cfg, data, _ctx(r, world)) for r in range(world)]
    record = [record31_generator(streams, 8 * local, doc, r) for r in range(8)]
    for _ in range(10):  # crosses shard boundaries
        want = [next(gen) for gen in record]
        got = [None] * 8
        for k in range(8 // world):
            for r, loader in enumerate(loaders):
                got[k * world + r] = loader.next_batch()
        for (x, y, cu), (wx, wy, wcu) in zip(got, want, strict=True):
            np.testing.assert_array_equal(x.flatten().numpy(), wx)
            np.testing.assert_array_equal(y.flatten().numpy(), wy)
            np.testing.assert_array_equal(cu.numpy(), wcu)
    assert loaders[0].state_dict()["shard"] >= 2
    for loader in loaders:
        loader.close()


# ------------------------------------------------------------------ record #31's model, from its code


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def rotary(x_BTHD, cos, sin):
    cos, sin = cos[None, : x_BTHD.size(-3), None, :], sin[None, : x_BTHD.size(-3), None, :]
    x1, x2 = x_BTHD.to(dtype=torch.float32).chunk(2, dim=-1)
    return torch.cat((x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos), 3).type_as(x_BTHD)


def fa3_reference(q, k, v, cu_seqlens, left, scale):
    """flash_attn_varlen_func(causal=True, window_size=(left, 0)) on packed (T, H, D): a query sees
    the keys of its own document from `left` positions back to itself."""
    pos = torch.arange(q.size(0))
    docs = (pos[:, None] >= cu_seqlens[None, 1:]).sum(1)
    back = pos[:, None] - pos[None, :]
    mask = (docs[:, None] == docs[None, :]) & (back >= 0) & (back <= left)
    y = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, scale=scale
    )
    return y.transpose(0, 1)


def record_qkvo(w, i, dim):
    """The record's (4, d, d) qkvo_w of layer i: our fused QKV's three matrices and the output."""
    return torch.cat(
        [w[f"blocks.{i}.attn.c_attn.weight"].view(3, dim, dim), w[f"blocks.{i}.attn.c_proj.weight"][None]]
    )


def record_forward(w, input_seq, target_seq, seqlens, ws, yarn: RecordYarn, L, heads, dim):
    """#31's GPT.forward (fp32, no FP8: its eval-mode matmul), loss summed as in training."""
    hd, T = dim // heads, len(input_seq)
    ve = [F.embedding(input_seq, w[f"value_embeds.{i}.weight"]) for i in range(3)]
    ve = [ve[0], ve[1], ve[2]] + [None] * (L - 6) + [ve[0], ve[1], ve[2]]
    long_bm, short_bm = ws * BLOCK, (ws // 2) * BLOCK
    bm_sizes = [long_bm, short_bm, short_bm, short_bm, long_bm, short_bm, short_bm, long_bm, short_bm,
                short_bm, short_bm, long_bm]  # fmt: skip
    x = x0 = norm(F.embedding(input_seq, w["wte.weight"])[None])
    skips, n = [], L // 2
    for i in range(L):
        if i >= n:
            x = x + w["skip_weights"][i - n] * skips.pop()
        lam = w[f"blocks.{i}.lambdas"]
        x = lam[0] * x + lam[1] * x0
        if i != 7:
            h = norm(x)
            qkvo_w = record_qkvo(w, i, dim)
            q, k, v = F.linear(h, qkvo_w[:3].flatten(end_dim=1)).view(1, T, 3 * heads, hd).chunk(3, dim=-2)
            q, k = norm(q), norm(k)
            q, k = rotary(q, yarn.cos, yarn.sin), rotary(k, yarn.cos, yarn.sin)
            sa = w[f"blocks.{i}.attn.lambdas"]
            v = sa[0] * v + sa[1] * ve[i].view_as(v) if ve[i] is not None else sa[0] * v
            y = fa3_reference(q[0], k[0], v[0], seqlens, bm_sizes[i], yarn.attn_scales[ws])
            y = y.view(1, T, heads, hd)
            gate = w[f"blocks.{i}.attn.gate.proj.weight"]
            y = y * torch.sigmoid(F.linear(h[..., : gate.size(-1)], gate)).view(1, T, heads, 1)
            x = x + F.linear(y.contiguous().view(1, T, dim), qkvo_w[3])
        if i != 0:
            h = F.linear(norm(x), w[f"blocks.{i}.mlp.c_fc.weight"].T)
            x = x + F.linear(F.relu(h).square(), w[f"blocks.{i}.mlp.c_proj.weight"])
        if i < n:
            skips.append(x)
    logits = F.linear(norm(x), w["lm_head.weight"]).float()
    logits = 30 * torch.sigmoid(logits / 7.5)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), target_seq, reduction="sum")


def test_forward_loss_and_gradients_match_the_records_model_in_fp32():
    L, heads, dim, vocab, T, step = 12, 2, 64, 120, 1024, 557  # step 557: windows 3/7 blocks, YaRN 3 → 7
    cfg, model = fp32_model(RECIPE, n_layer=L, n_head=heads, n_embd=dim, vocab_size=vocab, max_seq_len=T)
    jitter_(model, 0.02)  # the record zero-inits the projections, the gates and the head: give them values
    apply_to_model(schedule_at(step, cfg), model)
    x, y, cu = two_documents(vocab, T)
    loss = model(x[None], y[None], cu)
    loss.backward()
    weights = {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}
    yarn = RecordYarn(dim // heads, T)
    yarn.apply_yarn(3, 7)
    ref = record_forward(weights, x, y, cu, record_ws(step), yarn, L, heads, dim)
    assert math.isclose(loss.item(), ref.item() / T, rel_tol=1e-6)
    (ref / T).backward()  # the record trains on the summed loss; our step on the mean
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, weights[name].grad, rtol=1e-4, atol=1e-6, msg=name)


# ------------------------------------------------------------------ record #31's optimizer, from its code


def newton_schulz_triton(G: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """#31's newton_schulz_triton (G.bfloat16() there): each line one kernel that accumulates in fp32
    and rounds once to `dtype`, the upper triangle of the symmetric products mirrored."""

    def kernel(out: torch.Tensor) -> torch.Tensor:
        return out.to(dtype)

    def sym(t: torch.Tensor) -> torch.Tensor:  # ns_line_1/2 compute the upper triangle and mirror it
        upper = torch.triu(t)
        return upper + torch.triu(t, 1).mT

    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.to(dtype)
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(5):
        A = kernel(sym(X.float() @ X.float().mT))  # ns_line_1: A = X·Xᵀ
        B = kernel(sym(c * (A.float() @ A.float().mT) + b * A.float()))  # ns_line_2(A, alpha=c, beta=b)
        X = kernel(a * X.float() + B.float() @ X.float())  # ns_line_3: baddbmm / addmm(X, B, X, beta=a)
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


@torch.no_grad()
def record_muon_step(params, state, lr, momentum, dtype):
    """#31's Muon.step for world_size 1 (weight decay 0)."""
    for p in params:
        grad = p.grad
        eff_lr = lr * max(1, p.size(-2) / p.size(-1)) ** 0.5
        buf = state.setdefault(id(p), torch.zeros_like(grad))
        buf.lerp_(grad, 1 - momentum)
        grad = grad.lerp_(buf, momentum)
        p.add_(other=newton_schulz_triton(grad, dtype), alpha=-eff_lr)


def record_layout(name: str, t: torch.Tensor, dim: int) -> torch.Tensor:
    """A tensor of ours in the record's layout: #31 stores c_fc as (dim, 4·dim) (#27), whatever we store,
    so its Muon's √max(1, rows/cols) gives it 1."""
    return t.T if name.endswith("mlp.c_fc.weight") and t.shape[0] != dim else t


@pytest.mark.parametrize("ns_dtype", ["fp32", "bf16"])
def test_three_steps_equal_record_31s_optimizer(ns_dtype):
    extra = ["model.embed_dtype=fp32", "model.fp8_head=false", f"optim.muon_ns_dtype={ns_dtype}"]
    cfg, model, opt, ours = shrunk_with_optimizer(RECIPE, extra)
    dim = cfg.model.n_embd
    rec = {}  # the record's parameters: blocks' matrices (qkvo_w per layer) to Muon, the rest to DistAdam
    for name, p in ours.items():
        if name.endswith("attn.c_proj.weight"):
            continue
        if name.endswith("attn.c_attn.weight"):
            name = name.replace("c_attn", "qkvo")
            w = torch.cat([p.detach().view(3, dim, dim), ours[name.replace("qkvo", "c_proj")].detach()[None]])
        else:
            w = record_layout(name, p.detach(), dim)
        rec[name] = torch.nn.Parameter(w.clone())
        # lr_mul: embed and value_embeds 75 (our wte is its embed), lm_head 1.0, scalars 5
        rec[name].lr_mul = (
            75.0 if name.startswith(("wte.", "value_embeds.")) else 1.0 if "lm_head" in name else 5.0
        )
    muon = [p for n, p in rec.items() if n.startswith("blocks.") and p.ndim >= 2]
    adam = [p for n, p in rec.items() if not (n.startswith("blocks.") and p.ndim >= 2)]
    assert any(n.endswith("gate.proj.weight") for n in rec)  # #28: the gate is a Muon matrix
    start = {n: p.detach().clone() for n, p in ours.items()}
    muon_state, adam_state = {}, {}
    gen = torch.Generator().manual_seed(1)
    for step in (0, 5, 8):  # LR 1 then in the cool-down; momentum warming up
        apply_schedule(schedule_at(step, cfg), opt, model)
        for p in ours.values():
            p.grad = torch.randn(p.shape, generator=gen)
        for name, w in rec.items():
            if "qkvo" in name:
                qkv, o = ours[name.replace("qkvo", "c_attn")].grad, ours[name.replace("qkvo", "c_proj")].grad
                w.grad = torch.cat([qkv.view(3, dim, dim), o[None]])
            else:
                w.grad = record_layout(name, ours[name].grad, dim).clone()
        opt.step()
        opt.zero_grad()
        lr = record_lr_shrunk(step, cfg.train.steps)
        frac = min(step / 300, 1)
        record_adam_step(adam, adam_state, 0.008 * lr)
        dtype = torch.bfloat16 if ns_dtype == "bf16" else torch.float32
        record_muon_step(muon, muon_state, 0.05 * lr, (1 - frac) * 0.85 + frac * 0.95, dtype)
    for name, p in ours.items():
        if "attn.c_" in name:
            q = rec[name.replace("c_attn", "qkvo").replace("c_proj", "qkvo")].detach()
            want = (q[:3].reshape(-1, dim) if "c_attn" in name else q[3]) - start[name]
        else:
            r = rec[name].detach()
            want = (r if r.shape == p.shape else r.T) - start[name]
        got = p.detach() - start[name]
        # fp32: measured <= 1e-6. bf16: Triton's kernels and bmm sum in different fp32 orders, so
        # roundings differ in the last bit (measured 0.4%); the 11-10 op order is 2.7% off
        assert (got - want).norm() <= (2e-6 if ns_dtype == "fp32" else 1e-2) * want.norm(), name


def record_lr_shrunk(step: int, n: int) -> float:
    """#31's get_lr for a run of n steps."""
    x = step / n
    w = (1 - x) / 0.5
    return 1.0 if x < 0.5 else w * 1.0 + (1 - w) * 0.1


def shrunk_overrides(text_data: Path) -> list[str]:
    """The recipe shrunk for the whole path on 1 and 2 processes (tests/two_processes.py)."""
    from speedrun.data.meta import load_meta

    eot = load_meta(text_data)["eot_id"]
    tiny = [o for o in shrink(RECIPE) if not o.startswith(("train.", "model.eot_id", "model.max_seq_len"))]
    stage = "tokens=1024 doc=128 windows="
    return tiny + [
        f"data.dir={text_data}", "data.tokenizer=bpe:512", f"model.eot_id={eot}", "model.max_seq_len=256",
        "train.seq_len=256", "train.micro_batch_tokens=256", "train.global_batch_tokens=1024",
        "train.val_seq_len=256", "train.val_tokens=2048", "train.steps=6", "train.val_every=3",
        "train.log_every=1", "train.dtype=fp32", "train.compile=off", "model.fp8_head=false",
        "model.embed_dtype=fp32", "optim.muon_backend=svd",
        f"train.stages={stage}1/1 frac=1/2; {stage}1/2 frac=1/2; {stage}1/2 ext=0",
    ]  # fmt: skip


two_processes.job(RECIPE, lambda data: ["--recipe", RECIPE, *shrunk_overrides(data)])


@pytest.mark.slow
@two_processes.SHARED
def test_trains_shrunk_on_one_and_two_processes_with_equal_losses(text_data, tmp_path, tmp_path_factory):
    """The whole path: DocumentLoader (packed, documents cut), varlen attention, stages, YaRN, validation
    rows, the loop; 2 gloo processes under torchrun."""
    overrides = shrunk_overrides(text_data)
    assert_one_and_two_processes_train_alike(RECIPE, overrides, text_data, tmp_path, tmp_path_factory)


def test_a_forward_without_cu_seqlens_masks_as_the_varlen_call():
    """Cached decoding and generation call the model without cu_seqlens: documents from the BOS tokens
    and the stage's windows give the logits of the varlen forward."""
    cfg = load_recipe(RECIPE, [*shrink(RECIPE), "model.max_seq_len=512", "model.embed_dtype=fp32"])
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    apply_to_model(schedule_at(cfg.train.steps, cfg), model)  # windows 1/2 blocks: 129 and 257 tokens
    idx = torch.randint(0, cfg.model.eot_id, (1, 512), generator=torch.Generator().manual_seed(2))
    idx[0, [0, 40, 200]] = cfg.model.eot_id
    cu = torch.full((128,), 512, dtype=torch.int32)
    cu[:3] = torch.tensor([0, 40, 200])
    with torch.no_grad():
        torch.testing.assert_close(model(idx), model(idx, cu_seqlens=cu), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "override, words",
    [
        ("model.mlp_layers=[1,12]", "model.mlp_layers [1, 12]: distinct layers 0..11"),
        ("model.mlp_layers=first", "model.mlp_layers: expected an integer"),
        ("model.attn_gate=769", "model.attn.gate (769) must not exceed model.n_embd (768)"),
        ("model.window_pattern=LS", "model.window_pattern is a gpt2024 key; this model is gpt2026"),
    ],
)
def test_a_bad_new_switch_is_one_config_error_naming_it(override, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_recipe(RECIPE, [override])


def test_transposed_linear_and_attention_gate_are_their_formulas():
    """#27: TransposedLinear stores (in, out) and maps as nn.Linear with the transposed weight. #28: the
    gate multiplies head h at position t by sigmoid(W[h] · x[t, :k]) and starts at one half."""
    from speedrun.model.gpt2026.gates import AttentionGate
    from speedrun.model.layers import TransposedLinear

    gen = torch.Generator().manual_seed(3)
    lin = TransposedLinear(8, 24)
    x = torch.randn(2, 5, 8, generator=gen)
    assert lin.weight.shape == (8, 24)
    torch.testing.assert_close(lin(x), x @ lin.weight)
    gate = AttentionGate(3, 2)
    y = torch.randn(2, 2, 5, 4, generator=gen)  # (B, H, T, D)
    torch.testing.assert_close(gate(y, x), y / 2)
    with torch.no_grad():
        gate.proj.weight.normal_(generator=gen)
    want = torch.stack(
        [y[:, h] * torch.sigmoid(x[..., :3] @ gate.proj.weight[h])[..., None] for h in range(2)], 1
    )
    torch.testing.assert_close(gate(y, x), want)
