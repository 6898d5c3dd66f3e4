"""Model behaviour against independent references: init loss, masks vs per-document attention."""

import math

import pytest
import torch
import torch.nn.functional as F

from speedrun.config import ModelConfig
from speedrun.model.attention import MaskSpec, attend, document_ids, spec_dense_mask
from speedrun.model.families import build_model
from speedrun.optim.build import model_rules
from speedrun.recipes import load_recipe

TINY = dict(n_layer=2, n_head=2, n_embd=64, max_seq_len=64)
SHRINK = [f"model.{k}={v}" for k, v in TINY.items()] + ["train.seq_len=32", "train.micro_batch_tokens=64"]


@pytest.mark.parametrize("recipe", ["gpt2-baseline", "muon-2024-10", "untied-2024-11", "demo"])
def test_loss_at_init_is_near_log_vocab(recipe):
    cfg = load_recipe(recipe, SHRINK + ["model.vocab_size=512"]).model
    torch.manual_seed(0)
    model = build_model(cfg)
    x = torch.randint(0, 512, (4, 32))
    loss = model(x, torch.roll(x, -1, dims=1)).item()
    rows = model.lm_head.weight.size(0)  # padded rows take a share of the probability at init
    assert abs(loss - math.log(rows)) < 0.25, (loss, math.log(rows))


def test_zero_init_head_gives_exactly_uniform_logits():
    cfg = load_recipe("untied-2024-11", SHRINK + ["model.vocab_size=300"]).model
    model = build_model(cfg)
    x = torch.randint(0, 300, (2, 16))
    assert model(x, x).item() == pytest.approx(math.log(model.lm_head.weight.size(0)), abs=1e-5)


def test_document_ids_start_at_each_eot():
    tokens = torch.tensor([[5, 0, 7, 8, 0, 9], [0, 1, 2, 3, 4, 0]])
    assert document_ids(tokens, eot_id=0).tolist() == [[0, 1, 1, 1, 2, 2], [1, 1, 1, 1, 1, 2]]


def test_document_masked_attention_equals_attention_per_document():
    torch.manual_seed(0)
    T, H, D = 24, 2, 8
    tokens = torch.randint(1, 9, (1, T))
    tokens[0, [0, 5, 6, 17]] = 0  # documents of length 5, 1, 11, 7
    q, k, v = (torch.randn(1, H, T, D) for _ in range(3))
    out = attend(q, k, v, spec_dense_mask(MaskSpec(document_ids(tokens, 0)), 0, T, 0, T, None))
    starts = [0, 5, 6, 17, T]
    for a, b in zip(starts, starts[1:], strict=False):
        ref = F.scaled_dot_product_attention(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :], is_causal=True)
        torch.testing.assert_close(out[..., a:b, :], ref)


def test_document_mask_changes_the_model_only_across_documents():
    cfg = ModelConfig(
        **TINY, vocab_size=64, positional="rotary", norm="rmsnorm", document_mask=True, eot_id=0
    )
    torch.manual_seed(0)
    model = build_model(cfg)
    doc_a = torch.randint(1, 64, (1, 10))
    doc_b = torch.cat([torch.zeros(1, 1, dtype=torch.long), torch.randint(1, 64, (1, 9))], dim=1)
    joined = model(torch.cat([doc_a, doc_b], dim=1))
    alone = model(torch.cat([torch.randint(1, 64, (1, 10)), doc_b], dim=1))
    # rotary makes attention depend only on relative positions, so doc_b's logits ignore what precedes it
    torch.testing.assert_close(joined[:, 10:], alone[:, 10:], atol=1e-4, rtol=1e-4)


def test_labels_cover_every_parameter_once():
    for recipe in ["gpt2-baseline", "untied-2024-11"]:
        full = load_recipe(recipe, SHRINK)
        cfg = full.model
        model = build_model(cfg)
        roles = {}
        for e in model_rules(model, full):
            roles.setdefault(e.rule.group, []).append((e.name, e.param))
        ids = [id(p) for group in roles.values() for _, p in group]
        assert len(ids) == len(set(ids)) == len(list(model.parameters()))
        assert all(p.dim() == 2 for _, p in roles["matrix"])
        assert bool(roles.get("head")) == (not cfg.tie_embeddings)
