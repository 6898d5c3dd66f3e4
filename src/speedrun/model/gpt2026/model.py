"""GPT2026: the model of records #26 on, built from per-layer specs (specs.py); `hidden` walks them.

Each part comes from its own module (embeddings, attention, gates, connections, mlp, head, windows) and
exists only where a spec asks for it: no switch is read in the forward. Parameter names are those of the
gpt2024 GPT's 2025 recipes, so their checkpoints load unchanged. The decode interface (kv_cache.py) is
the same as the gpt2024 GPT's: `mask_specs`, `hidden(idx, contexts, start, prev)`, `logits`, and per
block `attn.paired`.
"""

from __future__ import annotations

import torch
from torch import nn

from speedrun.config.gpt2026 import Gpt2026Config, qk_width
from speedrun.config.gpt2026.mudd import final_names
from speedrun.model.attention import AttentionMask, build_block_mask, choose_backend
from speedrun.model.contexts import Masked
from speedrun.model.gpt2026 import (
    canonical,
    connections,
    gates,
    head,
    prefix,
    sampled,
    stream,
    stream_parts,
    windows,
)
from speedrun.model.gpt2026.attention_tiers import load_fa3
from speedrun.model.gpt2026.bigram_sign import SignedBigramEmbed
from speedrun.model.gpt2026.block import block_for
from speedrun.model.gpt2026.embeddings import BigramEmbed, Smear, bigram_share
from speedrun.model.gpt2026.init import cast_storage, init_weights
from speedrun.model.gpt2026.mudd import Mudd, MuddGate, gate_layouts
from speedrun.model.gpt2026.ngram import ngram_part
from speedrun.model.gpt2026.specs import build_specs
from speedrun.model.labels import label
from speedrun.model.layers import CastedLinear, Norm, Rotary, embedding
from speedrun.model.vocab import embedding_rows, padded_vocab


class GPT2026(nn.Module):
    family = "gpt2026"

    def __init__(self, cfg: Gpt2026Config):
        super().__init__()
        self.cfg = cfg
        self.specs = build_specs(cfg)
        self.walk = [s for s in self.specs if s.present]
        self.eot_id = cfg.eot_id
        # #77: layer 0's bigram share enters before it
        self.bigram_first = cfg.stream.residual_form == "sublayer"
        self.bigram_in_x0 = cfg.embed.bigram_in_x0  # #89's script: x0 carries layer 0's share too
        d, vocab, rows = cfg.n_embd, padded_vocab(cfg), embedding_rows(cfg)
        self.wte = embedding(rows, d, "embed")
        self.embed2 = embedding(rows, d, "embed2") if cfg.stream.embed2 else None  # medium
        self.smear = Smear(cfg.embed.smear) if cfg.embed.smear else None  # #34
        bigram_dim = cfg.embed.bigram_dim or d  # #89's script: 192
        share = bigram_share(cfg.stream.residual_form, cfg.mudd.gate_layer > 0)
        self.bigram, self.lookback = None, 2 if cfg.ngram.rows else 1  # decoding's look-back (kv_cache.py)
        if cfg.ngram.rows:  # #92: the n-gram table feeds the bigram input
            self.bigram = ngram_part(cfg, share)
        elif cfg.embed.bigram_rows:  # #83's sign rows drawn after the table, as the record's __init__
            signs = (cfg.embed.bigram_sign_rows,) if cfg.embed.bigram_sign_rows else ()
            kind = SignedBigramEmbed if signs else BigramEmbed
            if signs:  # the unsigned table main built first and dropped: a seed keeps its model
                nn.init.normal_(torch.empty(cfg.embed.bigram_rows, bigram_dim))
            self.bigram = kind(cfg.embed.bigram_rows, bigram_dim, cfg.n_layer, *signs, width=d, share=share)
        self.embed_norm = Norm(d, "rmsnorm")
        rows_rotary = cfg.max_seq_len * (2 if cfg.attn.paired_layers else 1)  # #58: positions 2t, 2t + 1
        rotary = Rotary(qk_width(cfg), rows_rotary, 10000.0, True, cfg.attn.rope_precision)  # #344: Q/K dims
        narrow = (  # #92: the narrow layers' own table, the turning half of the frequencies
            Rotary(qk_width(cfg), rows_rotary, 10000.0, True, cfg.attn.rope_precision, turning_half=True)
            if cfg.attn.narrow_layers
            else None
        )
        self.blocks = nn.ModuleList(block_for(s, cfg, narrow if s.narrow_qk else rotary) for s in self.specs)
        if torch.cuda.is_available():  # the FA3 kernel lookup, an import dynamo cannot trace: before compile
            load_fa3()
        self.norm_f = Norm(d, "rmsnorm")
        self.lm_head = CastedLinear(d, vocab, bias=False)
        label(self.lm_head.weight, "head")
        tables = len({s.value_embed for s in self.specs if s.value_embed is not None})
        self.value_embeds = nn.ModuleList(embedding(rows, d, "value_embed") for _ in range(tables)) or None
        st, n_skips = cfg.stream, len(cfg.skips)
        self.skip_weights = connections.skip_weights(n_skips, st.skip_gate_form) if n_skips else None
        self.skip_gate = gates.skip_gates(st.skip_gate, n_skips) if st.skip_gate else None  # #55
        self.backout = connections.Backout(st.backout_layer) if st.backout_layer else None  # #40
        mudd = cfg.mudd
        self.mudd = (
            Mudd(d, cfg.n_head, st.resid_lambda_init, mudd.sources, tuple(final_names(mudd)), mudd.mix_groups)
            if mudd.sources
            else None
        )  # #81; #92's named sources and channel groups
        self.mudd_gate = MuddGate(d, gate_layouts(cfg)) if mudd.gate_layer else None  # #85
        self.head_spec = cfg.head  # the head's numerics, its own frozen table: the forward reads no more
        self.masked_spec = canonical.masked_head(cfg.head) if cfg.head.canonical_val_mask else None  # #350
        head.register_buffers(self, cfg, vocab)
        self.varlen_windows = windows.initial_windows(cfg.attn.window)
        if cfg.attn.window > 0:  # #26's growing window: a tensor, so it changes without recompiling
            window = torch.tensor(cfg.attn.window, dtype=torch.int32)
            self.register_buffer("attn_window", window, persistent=False)
        self.connections = stream_parts.connections_of(self)  # what the layers read besides the stream
        init_weights(self, cfg)
        cast_storage(self, cfg)

    def set_attention_window(self, tokens: int) -> None:
        """#26's window (tokens) for the next forwards: an in-place write, no recompile."""
        if self.cfg.attn.window > 0:
            assert 1 <= tokens <= self.cfg.attn.window, f"window {tokens} is outside 1..model.attn.window"
            self.attn_window.fill_(tokens)

    def refresh_fp8(self, step: int) -> None:
        """Every FP8 part's weight copies after optimizer step `step` (−1 before the first). The parts that
        train from FP8 copies (#84/#89's MLPs, #344's QKV) are the modules of the blocks with a `refresh_fp8`,
        so a new FP8 part needs no entry here or in the family's after-step hook."""
        for part in self.blocks.modules():
            if hasattr(part, "refresh_fp8"):
                part.refresh_fp8(step)

    def mask_specs(self, tokens: torch.Tensor):
        return windows.mask_specs(self, tokens)

    def layer_masks(self, idx: torch.Tensor) -> list[AttentionMask]:
        """Per layer, its MaskSpec (dense SDPA) or FlexAttention BlockMask (None without attention)."""
        specs = self.mask_specs(idx)
        T = idx.size(1)
        if choose_backend(self.cfg.attention, idx.device, T, True, torch.is_grad_enabled()) == "flex":
            built = {
                id(m): build_block_mask(m, T * (1 + s.paired), idx.device)
                for m, s in zip(specs, self.specs, strict=True)
            }
            specs = [built[id(m)] for m in specs]
        return [m if s.attention else None for m, s in zip(specs, self.specs, strict=True)]

    def layer_contexts(self, idx: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> list:
        """Per layer, how its attention is called in the forward (model/contexts.py): packed documents
        (varlen kernels) where `cu_seqlens` bounds them, else its mask."""
        if cu_seqlens is not None:
            return windows.contexts(self, idx, cu_seqlens)
        return [Masked(m, idx, self.eot_id) for m in self.layer_masks(idx)]

    def forward(self, idx, targets=None, cu_seqlens=None, reduction: str = "mean") -> torch.Tensor:
        """Token ids (B, T) → loss (mean/sum scalar, or (B, T) with 'none'), or fp32 logits."""
        hidden = self.hidden(idx, self.layer_contexts(idx, cu_seqlens))
        if targets is None:
            return self.logits(hidden)
        if self.sampled_candidates and self.training and reduction == "mean":  # #92: training only
            return sampled.loss(self, hidden, targets, self.head_spec, self.sampled_candidates)
        fused = self.training and reduction == "mean"
        if fused and self.head_spec.softcap > 0:  # the softcapped training loss: one op, from raw logits
            table = self.prefix_table if self.prefix_weight is not None else None  # #88
            spec, mtp = self.head_spec, self.mtp_weights
            return head.training_loss(self.lm_head, hidden, targets, spec, mtp, table, self.prefix_weight)
        masked = self.canonical_mask is not None and not self.training  # #350: validation
        logits = head.capped_logits(self.lm_head, hidden, self.masked_spec if masked else self.head_spec)
        if masked:
            logits = canonical.mask_logits(logits, idx, self.canonical_mask)
        out = head.loss(logits, targets, self.head_spec, self.training, reduction, self.mtp_weights)
        if self.prefix_weight is not None and self.training and reduction == "mean":  # #88
            z = logits if self.head_spec.ce_bf16 else logits.float()
            out = out + prefix.prefix_loss(z, targets, self.prefix_table, self.prefix_weight)
        return out

    def hidden(self, idx, contexts=None, start: int = 0, prev=None) -> torch.Tensor:
        """Embeddings and the present layers up to the final norm, for tokens at positions start.. ;
        `contexts`: per layer, how its attention is called (model/contexts.py; the forward's: plain
        causal); cached decoding passes start and the token before idx (`prev`, for smear/bigram)."""
        contexts = contexts or [Masked(None, idx, self.eot_id)] * len(self.blocks)
        x, st = stream.enter(self, idx, contexts, start, prev)
        for s in self.walk:
            x = self.blocks[s.index](stream.layer_input(self, s, st, x))
            if s.keep_output:
                st.outputs[s.index] = x
        return self.norm_f(stream.leave(self, st, x))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final hidden states → fp32 logits over the padded vocab, softcapped."""
        return self.capped_logits(x).float()

    def capped_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The logits before the final fp32 cast (in the head's dtype where the cap runs in it)."""
        return head.capped_logits(self.lm_head, x, self.head_spec)
