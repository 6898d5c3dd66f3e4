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

from speedrun.config_model import Gpt2026Config, qk_width
from speedrun.data.tokenizers import gpt2_tokenizer
from speedrun.model.attention import AttentionMask, build_block_mask, choose_backend
from speedrun.model.contexts import Masked
from speedrun.model.gpt2026 import canonical, connections, embeddings, gates, head, prefix, windows
from speedrun.model.gpt2026.bigram_sign import SignedBigramEmbed
from speedrun.model.gpt2026.block import Layer, block_for
from speedrun.model.gpt2026.embeddings import BigramEmbed, Smear, bigram_share
from speedrun.model.gpt2026.gates import AttentionGate, ContextGate, skip_gate_of
from speedrun.model.gpt2026.mimetic import mimetic_vo_init_
from speedrun.model.gpt2026.mudd import Mudd, MuddGate, gate_layouts
from speedrun.model.gpt2026.specs import build_specs
from speedrun.model.labels import label, labelled
from speedrun.model.layers import CastedLinear, Norm, Rotary, scaled_uniform_

#: the block matrices #57 stores in bf16 (model.block_dtype)
BLOCK_MATRICES = frozenset(("qkv", "attn_out", "mlp_in", "mlp_out"))


class GPT2026(nn.Module):
    family = "gpt2026"

    def __init__(self, cfg: Gpt2026Config):
        super().__init__()
        self.cfg = cfg
        self.specs = build_specs(cfg)
        self.walk = [s for s in self.specs if s.present]
        d, m = cfg.n_embd, max(1, cfg.pad_vocab_to)
        vocab = (cfg.vocab_size + m - 1) // m * m
        rows = vocab if cfg.pad_embeddings else cfg.vocab_size
        self.wte = embeddings.token_embedding(rows, d)
        self.embed2 = embeddings.token_embedding(rows, d, "embed2") if cfg.embed2 else None  # medium
        self.smear = Smear(cfg.smear) if cfg.smear else None  # #34
        bigram_dim = cfg.bigram_dim or d  # #89's script: 192
        share = bigram_share(cfg.residual_form, cfg.mudd_gate_layer > 0)
        self.bigram = None
        if cfg.bigram_rows:  # #83's sign rows drawn after the table, as the record's __init__
            signs = (cfg.bigram_sign_rows,) if cfg.bigram_sign_rows else ()
            kind = SignedBigramEmbed if signs else BigramEmbed
            if signs:  # the unsigned table main built first and dropped: a seed keeps its model
                nn.init.normal_(torch.empty(cfg.bigram_rows, bigram_dim))
            self.bigram = kind(cfg.bigram_rows, bigram_dim, cfg.n_layer, *signs, width=d, share=share)
        self.embed_norm = Norm(d, "rmsnorm")
        rows_rotary = cfg.max_seq_len * (2 if cfg.paired_layers else 1)  # #58: positions 2t, 2t + 1
        rotary = Rotary(qk_width(cfg), rows_rotary, 10000.0, True, cfg.rope_precision)  # #344: on Q/K's dims
        self.blocks = nn.ModuleList(block_for(s, cfg, rotary) for s in self.specs)
        self.norm_f = Norm(d, "rmsnorm")
        self.lm_head = CastedLinear(d, vocab, bias=False)
        label(self.lm_head.weight, "head")
        tables = len({s.value_embed for s in self.specs if s.value_embed is not None})
        self.value_embeds = embeddings.value_embeddings(tables, rows, d)
        self.skip_weights = (
            connections.skip_weights(len(cfg.skips), cfg.skip_gate_form) if cfg.skips else None
        )
        self.skip_gate = gates.skip_gates(cfg.skip_gate, len(cfg.skips)) if cfg.skip_gate else None  # #55
        self.backout = connections.Backout(cfg.backout_layer) if cfg.backout_layer else None  # #40
        self.mudd = Mudd(d, cfg.n_head, cfg.resid_lambda_init) if cfg.mudd_sources else None  # #81
        self.mudd_gate = MuddGate(d, gate_layouts(cfg)) if cfg.mudd_gate_layer else None  # #85
        self.head_spec = head.HeadSpec(
            cfg.logit_softcap, cfg.softcap_divisor, cfg.softcap_offset, cfg.softcap_in_bf16, cfg.ce_bf16,
            cfg.fp8_head,
        )  # fmt: skip
        if cfg.mtp > 1:  # #53: the training loss weighs the next cfg.mtp tokens
            self.register_buffer("mtp_weights", torch.eye(cfg.mtp)[0], persistent=False)
        else:
            self.mtp_weights = None
        if cfg.prefix_loss_weight > 0:  # #88: the table is the GPT-2 vocabulary's, ids past the vocab dropped
            table = prefix.gpt2_prefix_table(vocab)
            self.register_buffer(
                "prefix_table", table.masked_fill(table >= cfg.vocab_size, -1), persistent=False
            )
            self.register_buffer("prefix_weight", torch.tensor(cfg.prefix_loss_weight), persistent=False)
        else:
            self.prefix_weight = None
        if cfg.canonical_val_mask:  # #350: built once here, before the clock; not saved
            ranks = {
                b: r for b, r in gpt2_tokenizer().encoding._mergeable_ranks.items() if r < cfg.vocab_size
            }
            self.register_buffer("canonical_mask", canonical.canonical_mask(ranks, vocab), persistent=False)
        else:
            self.canonical_mask = None
        self.varlen_windows = windows.initial_windows(cfg.window)
        if cfg.window > 0:  # #26's growing window: a tensor, so it changes without recompiling
            self.register_buffer("attn_window", torch.tensor(cfg.window, dtype=torch.int32), persistent=False)
        self._init_weights()
        if cfg.embed_dtype == "bf16":  # lookups need no fp32 master copy
            for emb in [
                self.wte,
                *([self.embed2] if self.embed2 is not None else []),
                *(self.value_embeds or []),
            ]:
                emb.weight.data = emb.weight.data.to(torch.bfloat16)
        if cfg.block_dtype == "bf16":  # #57: the optimizer keeps their low mantissa bits (optim/normuon.py)
            for _, p, lab in labelled(self):
                if lab is not None and lab.name in BLOCK_MATRICES:
                    p.data = p.data.to(torch.bfloat16)

    def _init_weights(self) -> None:
        """The records' init: token embedding N(0, 1), every linear uniform with std 0.5/√fan_in (Q/K/V:
        qkv_init_gain/√fan_in, #53), output projections and gates zero, value embeddings zero from #49,
        the head zero or N(0, head_init_std) (#51/#53)."""
        nn.init.normal_(self.wte.weight, mean=0.0, std=1.0)
        if self.embed2 is not None:  # nn.Embedding's default, as the medium record leaves it
            nn.init.normal_(self.embed2.weight, mean=0.0, std=1.0)
        qkv = {id(b.attn.c_attn) for b in self.blocks if b.attn is not None}
        for module in self.modules():
            if isinstance(module, CastedLinear):
                gain = self.cfg.qkv_init_gain if id(module) in qkv else 0.5
                scaled_uniform_(module.weight, module.in_features, gain)
        if self.cfg.value_embed_zero_init:
            for emb in self.value_embeds or []:
                nn.init.zeros_(emb.weight)
        if self.cfg.value_embed_init_std:  # #70: N(0, 0.01²)
            for emb in self.value_embeds or []:
                nn.init.normal_(emb.weight, mean=0.0, std=self.cfg.value_embed_init_std)
        for block in self.blocks:
            for part in (block.attn, block.mlp):
                if part is not None:
                    nn.init.zeros_(part.c_proj.weight)
            if block.attn is not None and self.cfg.attn_out_init_gain:  # #82: vo_bank uniform, O as V
                w = block.attn.c_proj.weight
                scaled_uniform_(w, w.size(1), self.cfg.attn_out_init_gain)
        if self.cfg.mimetic_vo_beta:  # #64
            d = self.cfg.n_embd
            for block in self.blocks:
                if block.attn is not None:
                    attn = block.attn
                    mimetic_vo_init_(attn.c_attn.weight[-d:], attn.c_proj.weight, self.cfg.mimetic_vo_beta)
        for part in self.modules():
            if isinstance(part, AttentionGate | ContextGate | Smear | BigramEmbed):
                part.reset_parameters()  # zero
        if self.cfg.zero_init_head:
            nn.init.zeros_(self.lm_head.weight)
        elif self.cfg.head_init_std > 0:
            nn.init.normal_(self.lm_head.weight, mean=0.0, std=self.cfg.head_init_std)

    def set_attention_window(self, tokens: int) -> None:
        """#26's window (tokens) for the next forwards: an in-place write, no recompile."""
        if self.cfg.window > 0:
            assert 1 <= tokens <= self.cfg.window, f"attention window {tokens} is outside 1..model.window"
            self.attn_window.fill_(tokens)

    @property
    def fp8_mlps(self) -> list[nn.Module]:
        """#84/#89: the MLPs that train from FP8 weight copies (none unless model.mlp_fp8)."""
        return [b.mlp for b in self.blocks if hasattr(b.mlp, "refresh_fp8")]

    def refresh_fp8(self, step: int) -> None:
        """#84/#89: every FP8 MLP's weight copies after optimizer step `step` (−1 before the first)."""
        for part in self.fp8_mlps:
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
        return [Masked(m, idx, self.cfg.eot_id) for m in self.layer_masks(idx)]

    def forward(self, idx, targets=None, cu_seqlens=None, reduction: str = "mean") -> torch.Tensor:
        """Token ids (B, T) → loss (mean/sum scalar, or (B, T) with 'none'), or fp32 logits."""
        hidden = self.hidden(idx, self.layer_contexts(idx, cu_seqlens))
        if targets is None:
            return self.logits(hidden)
        logits = head.capped_logits(self.lm_head, hidden, self.head_spec, self.training)
        if self.canonical_mask is not None and not self.training:  # #350
            logits = canonical.mask_logits(logits, idx, self.canonical_mask)
        out = head.loss(logits, targets, self.head_spec, self.training, reduction, self.mtp_weights)
        if self.prefix_weight is not None and self.training and reduction == "mean":  # #88
            z = logits if self.head_spec.ce_bf16 else logits.float()
            out = out + prefix.prefix_loss(z, targets, self.prefix_table, self.prefix_weight)
        return out

    def hidden(self, idx, contexts=None, start: int = 0, prev=None) -> torch.Tensor:
        """Embeddings and the present layers up to the final norm, for tokens at positions start.. ;
        `contexts`: per layer, how its attention is called (model/contexts.py); cached decoding passes
        start and the token before idx (`prev`, for smear/bigram)."""
        x = self.wte(idx)
        if self.smear is not None:
            x = self.smear(x, self.wte(prev) if prev is not None else None)
        x = x0 = self.embed_norm(x)
        x02 = self.embed_norm(self.embed2(idx)) if self.embed2 is not None else None
        contexts = contexts or [Masked(None, idx, self.cfg.eot_id)] * self.cfg.n_layer
        tables = [emb(idx) for emb in self.value_embeds] if self.value_embeds is not None else None
        bigram = self.bigram(idx, prev, start) if self.bigram is not None else None
        first = self.walk[0].index
        gates = self.mudd_gate(x0, 0) if self.mudd_gate is not None else {}  # #85: the pre gate
        if self.cfg.residual_form == "sublayer" and bigram is not None:  # #77: the first share goes in now
            share = gates[("bigram", first)] if gates else self.bigram.lambdas[first]
            x = x + bigram * share
            x0 = x if self.cfg.bigram_in_x0 else x0  # #89's script: x0 carries layer 0's share too
        c0 = x  # the stream entering the first layer (#81's source c0)
        outputs: dict[int, torch.Tensor] = {}
        for s in self.walk:
            if self.mudd_gate is not None and s.index == self.cfg.mudd_gate_layer:  # #85: the post gate
                gates = gates | self.mudd_gate(x, 1)
            if s.skip_from is not None:
                scale = connections.skip_scale(self.skip_weights[s.skip_weight], self.cfg.skip_gate_form)
                if self.skip_gate is not None:  # #55 (the medium record: one gate per skip)
                    scale = scale * skip_gate_of(self.skip_gate, s.skip_weight)(x0)
                scale = scale * gates[("skip", -1)] if gates else scale
                x = x + scale * outputs[s.skip_from]
            other_v = tables[s.value_embed] if s.value_embed is not None else None
            dyn = None
            if gates:  # #85: this layer's gates, the bigram rows unscaled
                kinds = ("x0", "bigram", "xsa", "attn", "dc1", "dc2")
                dyn = {k: gates[(k, s.index)] for k in kinds if (k, s.index) in gates}
                b = bigram if s.index != first else None
            else:
                b = self.bigram.lambdas[s.index] * bigram if bigram is not None else None
                b = None if self.cfg.residual_form == "sublayer" and s.index == first else b
            attn_in = outputs[s.attn_input] if s.attn_input is not None else None  # #77
            block = self.blocks[s.index]
            if s.mudd:  # #81: the last layer, from MUDD's coefficients of its input
                x_in, attn_in = x, attn_in if attn_in is not None else x
                x, other_v, mu = self.mudd.enter_last(x, c0, outputs[self.cfg.mudd_sources[0]], other_v)
                x = block(Layer(x, c0, contexts[s.index], other_v, bigram, attn_in, dyn, mu))
            else:
                x = block(Layer(x, x0, contexts[s.index], other_v, b, attn_in, dyn, None, x02))
            if s.keep_output:
                outputs[s.index] = x
        if self.mudd is not None:  # #81: before the final norm, with the backout in its bias
            h, skip = (outputs[j] for j in self.cfg.mudd_sources)
            x = self.mudd.final(x, [c0, h, x_in, tables[0], skip])
        return self.norm_f(self.backout(x, outputs) if self.backout is not None else x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final hidden states → fp32 logits over the padded vocab, softcapped."""
        return self.capped_logits(x).float()

    def capped_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The logits before the final fp32 cast (in the head's dtype where the cap runs in it)."""
        return head.capped_logits(self.lm_head, x, self.head_spec, self.training)
