"""The gpt2026 switches #64 and #70–#78 add, each against its record's own lines
(records/track_1_short/2026-01-30_MimeticValueOutput for #64's mimetic_vo_init)."""

from __future__ import annotations

import re

import pytest
import torch

from speedrun.errors import ConfigError
from speedrun.model.families import build_model
from speedrun.recipes import load_recipe
from tests.recipe_matrix import replace
from tests.two_processes import SHARED

BASE = "banks-2026-01"


def record_64_mimetic_vo_init(attn_bank, model_dim, num_heads, head_dim, beta=0.05, noise_std=0.01):
    """#64's mimetic_vo_init on a (layers, 4·d, d) bank: Q/K uniform, V = √β·I_h per head, O = −√β·I_h,
    plus noise (#64 calls it with beta 0.05, noise_std 0.01)."""
    dim, sqrt_beta = model_dim, beta**0.5
    bound = 3**0.5 * model_dim**-0.5
    with torch.no_grad():
        attn_bank[:, : 2 * dim, :].uniform_(-bound, bound)
        for layer in range(attn_bank.shape[0]):
            w_v = torch.zeros(dim, dim)
            w_o = torch.zeros(dim, dim)
            for h in range(num_heads):
                s, e = h * head_dim, (h + 1) * head_dim
                w_v[s:e, s:e] = sqrt_beta * torch.eye(head_dim)
                w_o[s:e, s:e] = -sqrt_beta * torch.eye(head_dim)
            w_v += noise_std * torch.randn_like(w_v)
            w_o += noise_std * torch.randn_like(w_o)
            attn_bank[layer, 2 * dim : 3 * dim, :] = w_v
            attn_bank[layer, 3 * dim :, :] = w_o


def _small(cfg):
    return replace(cfg.model, n_head=4, n_embd=128, vocab_size=120, max_seq_len=256)


def test_mimetic_vo_init_is_64s():
    """Our V rows and output projection against #64's bank, layer by layer: the same deterministic part
    (the difference is two independent noises: std 0.01·√2, mean 0), Q/K as the bank's uniform law."""
    cfg = load_recipe(BASE, ["model.mimetic_vo_beta=0.05"])
    torch.manual_seed(0)
    model = build_model(_small(cfg))
    d, heads = 128, 4
    attn = [b.attn for b in model.blocks if b.attn is not None]
    bank = torch.empty(len(attn), 4 * d, d)
    record_64_mimetic_vo_init(bank, d, heads, d // heads)
    for a, rec in zip(attn, bank, strict=True):
        ours = torch.cat([a.c_attn.weight.detach(), a.c_proj.weight.detach()])
        diff = (ours - rec)[2 * d :]  # V and O
        assert abs(diff.std().item() / (0.01 * 2**0.5) - 1) < 0.05
        assert abs(diff.mean().item()) < 1e-3
        qk = ours[: 2 * d]
        assert abs(qk.std().item() / rec[: 2 * d].std().item() - 1) < 0.05
        assert qk.abs().max() <= 3**0.5 * d**-0.5
    off = build_model(_small(load_recipe(BASE)))  # #65: V uniform, O zero
    a = next(b.attn for b in off.blocks if b.attn is not None)
    assert a.c_proj.weight.abs().max() == 0 and abs(a.c_attn.weight[2 * d :].trace().item()) < 1.0


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (["model.mimetic_vo_beta=-0.1"], "model.init.mimetic_vo_beta must be >= 0"),
        (["model.mimetic_vo_beta=2"], "model.init.mimetic_vo_beta (#64) must be 0..1"),
        (["model.ve_gate_ve_dims=12"], "model.values.ve_dims (#70) must be 1..model.values.gate - 1"),
        (["model.value_embed_init_std=0.01"], "model.init.value_embed_std (#70) needs"),
    ],
)
def test_a_bad_switch_is_one_config_error_naming_it(overrides, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        load_recipe(BASE, overrides)


# ------------------------------------------------------------------ #70 (2026-02-03_VeTuned)

VE_70 = ["model.ve_gate_ve_dims=6", "model.value_embed_init_std=0.01", "model.value_embed_zero_init=false"]


def record_70_ve_mix(x, ve, v, ve_gate_w, num_heads):
    """#70's CausalSelfAttention, unpaired layers: the gate reads 6 dims of x and 6 of the embedding."""
    B, T = x.shape[:2]
    gate_in = torch.cat([x[..., :6], ve[None, ..., :6]], dim=-1)
    ve_gate_out = 2 * torch.sigmoid(torch.nn.functional.linear(gate_in, ve_gate_w)).view(B, T, num_heads, 1)
    return v + ve_gate_out * ve.view_as(v)


def test_the_value_embedding_gate_reads_x_and_ve_as_70s():
    cfg = load_recipe(BASE, VE_70)
    model = build_model(_small(cfg))
    gated = {i: b.attn.ve_gate for i, b in enumerate(model.blocks) if b.attn is not None and b.attn.ve_gate}
    paired = {s.index for s in model.specs if s.paired}
    assert gated and {i: g.ve_dims for i, g in gated.items()} == {i: 0 if i in paired else 6 for i in gated}
    gate = next(g for i, g in gated.items() if i not in paired)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        gate.proj.weight.copy_(torch.randn(gate.proj.weight.shape, generator=gen))
    T, H, C = 16, 4, 128
    x, ve, v = (
        torch.randn(1, T, C, generator=gen),
        torch.randn(T, C, generator=gen),
        torch.randn(1, T, H, C // H),
    )
    ours = v + gate.gate(ve.view(1, T, H, C // H), x)
    want = record_70_ve_mix(x, ve, v, gate.proj.weight, H)
    torch.testing.assert_close(ours, want, rtol=0, atol=0)


def test_value_embeddings_start_as_70s_normal_001():
    """#70: `0.01 * torch.randn(5 * vocab, d)` (the same law; the random streams differ)."""
    torch.manual_seed(0)
    model = build_model(_small(load_recipe(BASE, VE_70)))
    w = torch.cat([e.weight.detach().float().flatten() for e in model.value_embeds])
    rec = 0.01 * torch.randn(w.numel())
    assert abs(w.std().item() / rec.std().item() - 1) < 0.02 and abs(w.mean().item()) < 1e-4
    kurtosis = ((w - w.mean()) ** 4).mean() / w.var() ** 2  # normal: 3 (uniform: 1.8)
    assert abs(kurtosis.item() - 3) < 0.1


# ------------------------------------------------------------------ #72 (2026-02-10_ShortWindow)

#: #72 on banks-2026-01: 1,515 + 40 steps, the LR floor 0.15, stage 1's documents cut at 896 tokens and
#: stage 3's short window 2 blocks (its _STAGE1_SEQ and _WS_SHORT_STAGE3, set in advance_schedule)
SCHEDULE_72 = [
    "train.steps=1555",
    "optim.tie_until=1012",  # split_step = 1010 | 1 = 1011
    "train.final_lr_frac=0.15",
    "train.stages=tokens=131072 doc=896 windows=1/3 lr=1 frac=1/3 mtp=1,0.5,0.25>1,0.5,0; "
    "tokens=262144 doc=2048 windows=3/7 lr=1.52 frac=1/3 mtp=1,0.5>1,0; "
    "tokens=393216 doc=2048 windows=2/11 lr=1.73 frac=1/3; "
    "tokens=393216 doc=2048 windows=6/13 ext=40 val=6/20 yarn=13",
]


def record_72_lr(step: int, scheduled: int = 1515, cooldown_frac: float = 0.55) -> float:
    """#72's TrainingSchedule.get_lr (stage LR multipliers 1, 1.52, 1.73 at round(1515·k/3))."""
    ends = [0, round(scheduled / 3), round(2 * scheduled / 3), scheduled, scheduled + 40]
    lr = next((m for m, end in zip((1.0, 1.52, 1.73, 1.0), ends[1:], strict=True) if step < end), 1.0)
    cd_start = int(scheduled * (1 - cooldown_frac))
    if step >= cd_start:
        denom = scheduled - cd_start
        t = 1.0 if denom <= 0 else min(1.0, (step - cd_start) / denom)
        lr = lr * (1 - t) + 0.15 * t
    return lr


def record_72_seq_and_short_window(step: int) -> tuple[int, int]:
    """#72's advance_schedule: train_max_seq_len 896 from step 1 to 504, 2,048 from 505; the short
    window 2 blocks in 1010 … 1514, else the stage's."""
    seq = 896 if 1 <= step < 505 else 2048
    ends = [505, 1010, 1515]
    short = next((s for s, end in zip((1, 3, 5), ends, strict=True) if step < end), 6)
    return seq, 2 if 1010 <= step < 1515 else short


def test_72s_lr_floor_and_short_stage_1_sequence_at_every_step():
    """From step 1 on; at step 0 #72 still cuts documents at 2,048 (the new length is sent at step 1)."""
    from speedrun.train.schedule import schedule_at

    cfg = load_recipe(BASE, SCHEDULE_72)
    for step in range(1, 1555):
        got = schedule_at(step, cfg)
        assert got.lr == pytest.approx(record_72_lr(step), rel=1e-12, abs=1e-15), step
        assert (got.stage.max_doc_len, got.stage.short_window) == record_72_seq_and_short_window(step), step


# ------------------------------------------------------------------ #78 (2026-03-22_VarlenMaxDocs)

#: #78's TRAIN_MAX_NUM_DOCS: cu_seqlens entries per rank's chunk, fitted to FineWeb's document counts
TRAIN_MAX_NUM_DOCS_78 = {16384: 64, 32768: 96, 49152: 128}


def record_78_max_num_docs(num_tokens_local: int) -> int:
    """#78's distributed_data_generator: the table, else next_multiple_of_n(tokens // 300, n=128)."""
    v = num_tokens_local // 300
    return TRAIN_MAX_NUM_DOCS_78.get(
        num_tokens_local, next(x for x in range(128, v + 1 + 128, 128) if x >= v)
    )


def test_cu_seqlens_are_sized_as_78s_with_data_max_docs_0():
    """data.max_docs = 0 takes #78's sizes (64, 96, 128 for the three stages' 16K, 32K, 48K tokens per
    rank); #53–#72 (and banks-2026-01) used tokens // 300 rounded up to 128, the recipes' 256 holding
    the same boundaries."""
    from speedrun.config.stages import stage_plan
    from speedrun.data.bos_loader import record_max_docs

    for local in [*TRAIN_MAX_NUM_DOCS_78, 256, 8192, 8192 + 300 * 128, 65536, 4 * 64 * 1024]:
        assert record_max_docs(local) == record_78_max_num_docs(local), local
    cfg = load_recipe(BASE, ["data.max_docs=0"])
    sizes = [record_max_docs(s.batch_tokens // 8) for s in stage_plan(cfg).stages]
    assert sizes == [64, 96, 128, 128]
    assert load_recipe(BASE).data.max_docs == 256  # #65: 128, 128, 256 by stage (the same boundaries)


# ------------------------------------------------------------------ #71 (2026-02-06_SparseBigramGradient)


@pytest.mark.slow
@SHARED
def test_the_sparse_row_exchange_equals_the_dense_one_on_two_gloo_processes(library_results):
    """#71's all-to-all of the touched rows (optim/sparse_rows.py) against all-reduce + slice / world:
    equal bit for bit (two ranks add the same two numbers), including ranks that touched no row."""
    assert library_results["sparse_rows"] == {"max_abs_diff": 0.0, "equal": True}
