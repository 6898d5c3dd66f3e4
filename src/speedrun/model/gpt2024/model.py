"""The gpt2024 GPT: one small model whose record-history features (llm.c → 2025-01) are config switches.

The llm.c baseline (learned positions, LayerNorm, GELU, biases, fused QKV, tied embeddings); the
2024-11-03 block (rotary, RMSNorm, QK-norm, ReLU², zero-init projections, untied head, padded vocab,
softcap); then value residual and x0 (11-06), U-Net skips (11-10), document-masked sliding windows
(11-19/11-24), value embeddings (12-04, 12-08, Sub3Min), long/short windows, half-truncated RoPE,
MLP-only layers and the sigmoid softcap (Sub3Min). Records #26 on: model/gpt2026/."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from speedrun.config import ModelConfig
from speedrun.model.attention import (
    AttentionMask,
    MaskSpec,
    build_block_mask,
    choose_backend,
    document_ids,
    short_window,
)
from speedrun.model.contexts import CAUSAL, Context, Masked
from speedrun.model.fp8 import head_logits
from speedrun.model.gpt2024.attention import Attention, make_rotary
from speedrun.model.gpt2024.cgi import cgi_signs
from speedrun.model.gpt2024.layout import attention_layers, value_embed_layout
from speedrun.model.gpt2024.unet import initial_weights, skip_sources
from speedrun.model.labels import label, label_linear
from speedrun.model.layers import MLP, CastedLinear, Norm, Rotary, embedding, scaled_uniform_, softcap
from speedrun.model.vocab import embedding_rows, padded_vocab


def make_norm(cfg: ModelConfig, kind: str | None = None) -> Norm:
    """The recipe's norm (kind defaults to cfg.norm) with its RMSNorm epsilon and precision."""
    return Norm(cfg.n_embd, kind or cfg.norm, cfg.norm_eps, cfg.norm_fp32)


def layer_specs(cfg: ModelConfig, tokens: Tensor, window: Tensor | None) -> list[MaskSpec] | None:
    """Per layer, the MaskSpec of a (B, T) token sequence (None: all plain causal): the one place a recipe's
    masking switches become masks, for the forward and cached decoding. `window`: the model's 0-d tensor."""
    if not (cfg.document_mask or cfg.window > 0):
        return None
    block_window = cfg.window_granularity == "block"
    docs = document_ids(tokens, cfg.eot_id) if cfg.document_mask else None
    w = window if cfg.window > 0 else None
    long = MaskSpec(docs, w, block_window, cfg.window, cfg.window_block_list)
    pattern = cfg.window_pattern or "L" * cfg.n_layer
    short = dataclasses.replace(long, window=short_window(window, block_window)) if "S" in pattern else None
    return [long if kind == "L" else short for kind in pattern]


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, has_attention: bool = True, rotary: Rotary | None = None):
        super().__init__()
        self.norm1 = make_norm(cfg) if has_attention else None
        self.attn = Attention(cfg, rotary) if has_attention else None
        self.norm2 = make_norm(cfg)
        relu2, hidden = cfg.activation == "relu2", cfg.mlp_ratio * cfg.n_embd
        self.mlp = MLP(cfg.n_embd, hidden, cfg.bias, relu2, cfg.gelu)
        self.lambdas = label(nn.Parameter(torch.tensor([1.0, 0.0])), "scalar") if cfg.x0_shortcut else None

    def forward(
        self,
        x: torch.Tensor,
        ctx: Context | None = CAUSAL,
        x0: torch.Tensor | None = None,
        other_v: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns the new residual stream and the attention's unmixed v (None without attention);
        `ctx`: how the attention is called (model/contexts.py)."""
        if self.lambdas is not None:
            x = self.lambdas[0] * x + self.lambdas[1] * x0
        raw_v = None
        if self.attn is not None:
            y, raw_v = self.attn(self.norm1(x), ctx, other_v)
            x = x + y
        return x + self.mlp(self.norm2(x)), raw_v


class GPT(nn.Module):
    family = "gpt2024"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d, vocab, rows = cfg.n_embd, padded_vocab(cfg), embedding_rows(cfg)
        self.wte = embedding(rows, d, "embed")
        self.wpe = embedding(cfg.max_seq_len, d, "embed") if cfg.positional == "learned" else None
        embed_norm = "rmsnorm-gain" if cfg.norm == "rmsnorm-gain" else "rmsnorm"  # track 3: with gains
        self.embed_norm = make_norm(cfg, embed_norm) if cfg.embed_norm else None
        rotary = make_rotary(cfg)
        self.blocks = nn.ModuleList(Block(cfg, attn, rotary) for attn in attention_layers(cfg))
        self.ve_layout = value_embed_layout(cfg)
        self.norm_f = make_norm(cfg)
        self.lm_head = CastedLinear(d, vocab, bias=cfg.head_bias)
        label_linear(self.lm_head, "head")  # track 3's bias: a bias
        n_tables = len({j for j in self.ve_layout if j is not None})
        self.value_embeds = nn.ModuleList(embedding(rows, d, "value_embed") for _ in range(n_tables)) or None
        self.skip_weights = label(nn.Parameter(initial_weights(cfg)), "scalar") if cfg.unet else None
        self.skip_sources = skip_sources(cfg)
        # the layers whose outputs a later skip reads (built once, not per forward)
        self.kept_outputs = frozenset(i for i in self.skip_sources if i is not None)
        if cfg.window > 0:  # a tensor, so the window can change every step without recompiling
            self.register_buffer("attn_window", torch.tensor(cfg.window, dtype=torch.int32), persistent=False)
        self._init_weights()
        if cfg.tie_embeddings:  # one weight, trained as the embedding
            self.wte.weight = label(self.lm_head.weight, "embed")
        if cfg.embed_dtype == "bf16":  # lookups need no fp32 master copy (records from 2024-11-08 on)
            for emb in [self.wte, *(self.value_embeds or [])]:  # as .to() does, but fake tensors too
                emb.weight.data = emb.weight.data.to(torch.bfloat16)
        if cfg.bf16_model:  # 11-08 … 12-08: model.bfloat16(), then every CastedLinear back to fp32
            linear = {id(p) for m in self.modules() if isinstance(m, CastedLinear) for p in m.parameters()}
            for p in self.parameters():
                if id(p) not in linear:
                    p.data = p.data.to(torch.bfloat16)

    def _init_weights(self) -> None:
        cfg = self.cfg
        if cfg.init == "gpt2":  # GPT-2 / llm.c: normal(0, 0.02), residual projections / sqrt(2L)
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
                    nn.init.normal_(p, mean=0.0, std=std)
                elif name.endswith(".bias") and "ln" not in name:
                    nn.init.zeros_(p)
        elif not cfg.tie_embeddings:  # tied: torch's default Linear init for the shared matrix (2024-10)
            nn.init.normal_(self.wte.weight, mean=0.0, std=1.0)
        linears = [m for m in self.modules() if isinstance(m, CastedLinear)]
        for module in linears if cfg.init == "fan-in-normal" else ():  # track 3: std √0.33/√fan_in, biases 0
            nn.init.normal_(module.weight, mean=0.0, std=0.33**0.5 / module.in_features**0.5)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        for module in linears if cfg.init == "scaled-uniform" else ():  # Sub3Min: uniform, std 0.5/√fan_in
            scaled_uniform_(module.weight, module.in_features)
        if cfg.zero_init_proj:  # with their biases (track 3 #46 zeroes every *proj* parameter)
            for block in self.blocks:
                for proj in (m.c_proj for m in (block.attn, block.mlp) if m is not None):
                    for p in proj.parameters():
                        nn.init.zeros_(p)
        if cfg.mlp_fc_init_ramp:  # #44–#46: deeper up-projections start smaller
            with torch.no_grad():
                for i, block in enumerate(self.blocks):
                    ramp = i / (len(self.blocks) - 1) if len(self.blocks) > 1 else 0.0
                    if block.mlp is not None:
                        block.mlp.c_fc.weight.mul_(1.0 - cfg.mlp_fc_init_ramp * ramp)
        if cfg.zero_init_head:
            for p in self.lm_head.parameters():
                nn.init.zeros_(p)
        if cfg.cgi_gain_alpha:  # #46: the blocks' gains split per channel (seeded by the run's seed)
            signs = cgi_signs(cfg.n_layer, cfg.n_embd, cfg.n_embd // cfg.n_head, torch.initial_seed())
            with torch.no_grad():
                for block, s in zip(self.blocks, signs, strict=True):
                    assert block.norm1 is not None, "config checks: CGI needs attention in every block"
                    block.norm1.gains.copy_(1.0 - cfg.cgi_gain_alpha * s)
                    block.norm2.gains.copy_(1.0 + cfg.cgi_gain_alpha * s)

    def set_attention_window(self, tokens: int) -> None:
        """Set the sliding window (tokens) for the next forwards (the loop, every step): an in-place write
        to a tensor, no recompile; a no-op without a window."""
        if self.cfg.window > 0:
            assert 1 <= tokens <= self.cfg.window, f"attention window {tokens} is outside 1..model.window"
            self.attn_window.fill_(tokens)

    def layer_masks(self, idx: torch.Tensor) -> list[AttentionMask]:
        """Per layer: None (plain causal or no attention), a MaskSpec (dense SDPA) or a FlexAttention
        BlockMask, built once per forward and shared by the layers with the same (long or short) window."""
        specs = self.mask_specs(idx)
        if specs is None:
            return [None] * self.cfg.n_layer
        T = idx.size(1)
        if choose_backend(self.cfg.attention, idx.device, T, True, torch.is_grad_enabled()) == "flex":
            built = {id(s): build_block_mask(s, T, idx.device) for s in specs}
            specs = [built[id(s)] for s in specs]
        return [
            mask if block.attn is not None else None for mask, block in zip(specs, self.blocks, strict=True)
        ]

    def layer_contexts(self, idx: torch.Tensor) -> list[Context]:
        """Per layer, how its attention is called in the forward (model/contexts.py): under its mask."""
        return [Masked(m) for m in self.layer_masks(idx)]

    def mask_specs(self, tokens: torch.Tensor) -> list[MaskSpec] | None:
        """Per layer, the mask of a (B, T) token sequence (None: plain causal); see layer_specs."""
        return layer_specs(self.cfg, tokens, self.attn_window if self.cfg.window > 0 else None)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean"
    ) -> torch.Tensor:
        """Token ids (B, T) → loss (a scalar for 'mean'/'sum', (B, T) for 'none'), or fp32 logits."""
        B, T = idx.shape
        hidden = self.hidden(idx, self.layer_contexts(idx))
        if targets is None:
            return self.logits(hidden)
        logits = self.capped_logits(hidden).float()
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), reduction=reduction)
        return loss.view(B, T) if reduction == "none" else loss

    def hidden(
        self,
        idx: torch.Tensor,
        contexts: list[Context | None] | None = None,
        start: int = 0,
        prev: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Embeddings and blocks up to the final norm for tokens at positions start..; `contexts`: per layer,
        how its attention is called (None: plain causal); `prev`: the shared decode interface, unused here."""
        cfg = self.cfg
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(start, start + idx.size(1), device=idx.device))
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        x0 = x
        contexts = contexts or [CAUSAL] * cfg.n_layer
        tables = [emb(idx) for emb in self.value_embeds] if self.value_embeds is not None else None
        outputs: dict[int, torch.Tensor] = {}
        v_first = None
        for i, block in enumerate(self.blocks):
            if (src := self.skip_sources[i]) is not None:
                x = x + self.skip_weights[i - (cfg.n_layer - cfg.n_layer // 2)] * outputs[src]
            j = self.ve_layout[i]
            other_v = v_first if tables is None else (tables[j] if j is not None else None)
            x, raw_v = block(x, contexts[i], x0, other_v)
            if cfg.value_residual and v_first is None:
                v_first = raw_v
            if i in self.kept_outputs:
                outputs[i] = x
        return self.norm_f(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final hidden states → fp32 logits (padded vocab, or the real vocab with `logits_vocab_only`),
        softcapped as the recipe says."""
        return self.capped_logits(x).float()

    def capped_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The logits before the final fp32 cast: in the head's dtype where the softcap runs in it."""
        cfg = self.cfg
        logits = head_logits(self.lm_head, x, cfg.fp8_head)  # Sub3Min: FP8 in training only
        if cfg.logits_vocab_only:  # llm.c: the padded rows are in the matmul, not in the softmax
            logits = logits[..., : cfg.vocab_size]
        if cfg.logit_softcap > 0:
            # 11-06 … 12-08 cap the head's output in its own dtype (bf16) and cast after; others cast first
            if not cfg.softcap_in_bf16:
                logits = logits.float()
            logits = softcap(logits, cfg.logit_softcap, cfg.softcap_form)
        return logits
