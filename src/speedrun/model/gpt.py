"""The GPT: one small model whose record-history features are config switches.

Two ends of the range it covers:
- the llm.c GPT-2 baseline: learned positions, LayerNorm, GELU, biases, fused QKV, tied embeddings;
- the 2024-11-03 block: rotary, parameter-free RMSNorm, QK-norm, ReLU², zero-init output projections,
  untied zero-init head, RMSNorm after the embedding, vocab padded to a multiple of 128, fp32 logits
  with an optional tanh softcap.
The model knows nothing about distribution or optimizers (see train/).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from speedrun.config import ModelConfig
from speedrun.model.attention import attend, dense_mask, document_ids


def padded_vocab(cfg: ModelConfig) -> int:
    """Embedding/head rows: vocab rounded up to `pad_vocab_to` (a multiple of 128 makes matmuls faster)."""
    m = max(1, cfg.pad_vocab_to)
    return (cfg.vocab_size + m - 1) // m * m


class Norm(nn.Module):
    """LayerNorm with gains and biases (GPT-2) or parameter-free RMSNorm (modern records)."""

    def __init__(self, dim: int, kind: str):
        super().__init__()
        self.kind = kind
        self.ln = nn.LayerNorm(dim) if kind == "layernorm" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ln is not None:
            return self.ln(x)
        return F.rms_norm(x, (x.size(-1),))


class Rotary(nn.Module):
    """Rotary position embedding over the full head dimension, tables precomputed once."""

    def __init__(self, head_dim: int, max_seq_len: int, base: float):
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, H, T, D)
        T = x.size(-2)
        if T > self.cos.size(0):
            raise ValueError(f"sequence length {T} exceeds the rotary table ({self.cos.size(0)})")
        cos, sin = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, self.n_head = cfg.n_embd, cfg.n_head
        self.head_dim = d // cfg.n_head
        if cfg.fused_qkv:
            self.c_attn = nn.Linear(d, 3 * d, bias=cfg.bias)
        else:
            self.c_q = nn.Linear(d, d, bias=cfg.bias)
            self.c_k = nn.Linear(d, d, bias=cfg.bias)
            self.c_v = nn.Linear(d, d, bias=cfg.bias)
        self.c_proj = nn.Linear(d, d, bias=cfg.bias)
        self.qk_norm = cfg.qk_norm
        self.rotary = Rotary(self.head_dim, cfg.max_seq_len, cfg.rope_base) if cfg.positional == "rotary" else None
        self.out_scale = 1 / math.sqrt(2 * cfg.n_layer) if cfg.attn_residual_scale else 1.0

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        B, T, C = x.shape
        if hasattr(self, "c_attn"):
            q, k, v = self.c_attn(x).split(C, dim=-1)
        else:
            q, k, v = self.c_q(x), self.c_k(x), self.c_v(x)
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if self.qk_norm:
            q, k = F.rms_norm(q, (self.head_dim,)), F.rms_norm(k, (self.head_dim,))
        if self.rotary is not None:
            q, k = self.rotary(q), self.rotary(k)
        y = attend(q, k, v, mask).transpose(1, 2).reshape(B, T, C)
        y = self.c_proj(y)
        return y * self.out_scale if self.out_scale != 1.0 else y


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hidden = cfg.mlp_ratio * cfg.n_embd
        self.c_fc = nn.Linear(cfg.n_embd, hidden, bias=cfg.bias)
        self.c_proj = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)
        self.relu2 = cfg.activation == "relu2"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        h = F.relu(h).square() if self.relu2 else F.gelu(h, approximate="tanh")
        return self.c_proj(h)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm1 = Norm(cfg.n_embd, cfg.norm)
        self.attn = Attention(cfg)
        self.norm2 = Norm(cfg.n_embd, cfg.norm)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), mask)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        vocab = padded_vocab(cfg)
        self.wte = nn.Embedding(vocab, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.n_embd) if cfg.positional == "learned" else None
        self.embed_norm = Norm(cfg.n_embd, "rmsnorm") if cfg.embed_norm else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm_f = Norm(cfg.n_embd, cfg.norm)
        self.lm_head = nn.Linear(cfg.n_embd, vocab, bias=False)
        self._init_weights()
        if cfg.tie_embeddings:
            self.wte.weight = self.lm_head.weight

    def _init_weights(self) -> None:
        cfg = self.cfg
        if cfg.init == "gpt2":  # GPT-2 / llm.c: normal(0, 0.02), residual projections / sqrt(2L)
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
                    nn.init.normal_(p, mean=0.0, std=std)
                elif name.endswith(".bias") and "ln" not in name:
                    nn.init.zeros_(p)
        elif cfg.tie_embeddings:  # torch default Linear init for the shared matrix (2024-10 records)
            pass
        else:
            nn.init.normal_(self.wte.weight, mean=0.0, std=1.0)
        if cfg.zero_init_proj:
            for block in self.blocks:
                nn.init.zeros_(block.attn.c_proj.weight)
                nn.init.zeros_(block.mlp.c_proj.weight)
        if cfg.zero_init_head:
            nn.init.zeros_(self.lm_head.weight)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean"
    ) -> torch.Tensor:
        """Token ids (B, T) → loss (scalar for 'mean'/'sum', (B, T) for 'none') or fp32 logits without targets."""
        B, T = idx.shape
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=idx.device))
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        mask = dense_mask(document_ids(idx, self.cfg.eot_id), T) if self.cfg.document_mask else None
        for block in self.blocks:
            x = block(x, mask)
        x = self.norm_f(x)
        logits = self.lm_head(x).float()
        if self.cfg.logit_softcap > 0:
            cap = self.cfg.logit_softcap
            logits = cap * torch.tanh(logits / cap)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), reduction=reduction)
        return loss.view(B, T) if reduction == "none" else loss

    def param_roles(self) -> dict[str, list[tuple[str, nn.Parameter]]]:
        """Parameters by role: the optimizers treat each role differently (Muon takes 'matrix').

        embed: token/position embeddings (lookups, not matmuls); head: the untied output matrix;
        matrix: 2-D weights inside the blocks; scalar: everything else (biases, norm gains).
        A tied embedding appears once, as 'embed'.
        """
        roles: dict[str, list[tuple[str, nn.Parameter]]] = {"embed": [], "head": [], "matrix": [], "scalar": []}
        seen: set[int] = set()
        for name, p in self.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if name.startswith(("wte.", "wpe.")) or (name.startswith("lm_head.") and self.cfg.tie_embeddings):
                roles["embed"].append((name, p))
            elif name.startswith("lm_head."):
                roles["head"].append((name, p))
            elif p.dim() >= 2 and name.startswith("blocks."):
                roles["matrix"].append((name, p))
            else:
                roles["scalar"].append((name, p))
        return roles

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 x matmul parameters (incl. the head) + attention (PaLM, 12*L*d*T)."""
        matmul = sum(p.numel() for _, p in self.param_roles()["matrix"]) + self.lm_head.weight.numel()
        return 6 * matmul + 12 * self.cfg.n_layer * self.cfg.n_embd * seq_len
