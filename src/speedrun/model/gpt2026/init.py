"""The gpt2026 init, in the records' order (the RNG draws and so every seed's model depend on it), and the
storage dtypes it leaves the embeddings and block matrices in."""

from __future__ import annotations

import torch
from torch import nn

from speedrun.config.gpt2026 import Gpt2026Config
from speedrun.model.gpt2026.embeddings import BigramEmbed, Smear
from speedrun.model.gpt2026.gates import ContextGate
from speedrun.model.gpt2026.mimetic import mimetic_vo_init_
from speedrun.model.gpt2026.ngram import NgramEmbed
from speedrun.model.labels import labelled
from speedrun.model.layers import CastedLinear, scaled_uniform_

#: the block matrices #57 stores in bf16 (model.block_dtype)
BLOCK_MATRICES = frozenset(("qkv", "attn_out", "mlp_in", "mlp_out"))


def init_weights(model: nn.Module, cfg: Gpt2026Config) -> None:
    """The records' init: token embedding N(0, 1), every linear uniform with std 0.5/√fan_in (Q/K/V:
    qkv_init_gain/√fan_in, #53), output projections and gates zero, value embeddings zero from #49,
    the head zero or N(0, head_init_std) (#51/#53)."""
    nn.init.normal_(model.wte.weight, mean=0.0, std=1.0)
    if model.embed2 is not None:  # nn.Embedding's default, as the medium record leaves it
        nn.init.normal_(model.embed2.weight, mean=0.0, std=1.0)
    qkv = {id(b.attn.c_attn) for b in model.blocks if b.attn is not None}
    for module in model.modules():
        if isinstance(module, CastedLinear):
            gain = cfg.init.qkv_gain if id(module) in qkv else 0.5
            scaled_uniform_(module.weight, module.in_features, gain)
    if cfg.init.value_embed_zero:
        for emb in model.value_embeds or []:
            nn.init.zeros_(emb.weight)
    if cfg.init.value_embed_std:  # #70: N(0, 0.01²)
        for emb in model.value_embeds or []:
            nn.init.normal_(emb.weight, mean=0.0, std=cfg.init.value_embed_std)
    for block in model.blocks:
        for part in (block.attn, block.mlp):
            if part is not None:
                nn.init.zeros_(part.c_proj.weight)
        if block.attn is not None and cfg.init.attn_out_gain:  # #82: vo_bank uniform, O as V
            w = block.attn.c_proj.weight
            scaled_uniform_(w, w.size(1), cfg.init.attn_out_gain)
    if cfg.init.mimetic_vo_beta:  # #64
        d = cfg.n_embd
        for attn in (b.attn for b in model.blocks if b.attn is not None):
            mimetic_vo_init_(attn.c_attn.weight[-d:], attn.c_proj.weight, cfg.init.mimetic_vo_beta)
    for part in model.modules():
        if isinstance(part, ContextGate | Smear | BigramEmbed | NgramEmbed):
            part.reset_parameters()  # zero
    if cfg.head.zero_init:
        nn.init.zeros_(model.lm_head.weight)
    elif cfg.head.init_std > 0:
        nn.init.normal_(model.lm_head.weight, mean=0.0, std=cfg.head.init_std)


def cast_storage(model: nn.Module, cfg: Gpt2026Config) -> None:
    """bf16 embeddings (lookups need no fp32 master copy) and #57's bf16 block matrices (the optimizer
    keeps their low mantissa bits, optim/normuon.py), where the config asks."""
    if cfg.embed.dtype == "bf16":
        for emb in (e for e in [model.wte, model.embed2, *(model.value_embeds or [])] if e is not None):
            emb.weight.data = emb.weight.data.to(torch.bfloat16)
    if cfg.block_dtype == "bf16":
        for _, p, lab in labelled(model):
            if lab is not None and lab.name in BLOCK_MATRICES:
                p.data = p.data.to(torch.bfloat16)
