"""Step 4 of issue 26 (record-2026-07's parts) against the record scripts' own lines, transcribed here as
independent references: #83's bigram sign trick, #88's prefix-token table and loss, #84/#89's FP8 MLP
forward (vs its bf16 twin and the record's scale formulas), #85's DC correction, #344's Q/K width and
#350's canonical-token validation mask. Each comparison uses identical tiny weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from speedrun.errors import ConfigError
from speedrun.model.families import build_model
from speedrun.model.gpt2026.bigram_sign import SignedBigramEmbed, sign_index
from speedrun.model.gpt2026.embeddings import bigram_hash
from speedrun.model.kv_cache import KVCache, forward_cached
from speedrun.recipes import load_recipe

BASE = "stages-2025-12"


def tiny(overrides: list[str], **shape):
    cfg = load_recipe(BASE, overrides)
    fields = dict(n_head=2, n_embd=64, vocab_size=120, max_seq_len=256, embed_dtype="fp32", fp8_head=False)
    fields.update(shape)
    return dataclasses.replace(cfg.model, **fields)


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
        assert torch.equal(sign_index(seq[:, start:], 8192, seq[:, start - 1 : start], start), full[:, start:])


def test_model_with_sign_trick_decodes_like_its_forward_and_refuses_it_without_the_table():
    cfg = tiny(["model.bigram_rows=1000", "model.bigram_sign_rows=64"])
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    assert isinstance(model.bigram, SignedBigramEmbed) and "bigram.sign_table" in model.state_dict()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.05 if p.ndim > 1 else 0.3))
    idx = torch.randint(0, 119, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(idx)
        cache = KVCache()
        parts = [forward_cached(model, idx[:, :20], cache)]
        parts += [forward_cached(model, idx[:, t : t + 1], cache) for t in range(20, 30)]
        torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-4, atol=1e-4)
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
    torch.testing.assert_close(ours, record_88_build_prefix_table(enc._mergeable_ranks, 50304), rtol=0, atol=0)
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
    hidden = model.hidden(idx, model.layer_masks(idx)).detach().requires_grad_(True)
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
