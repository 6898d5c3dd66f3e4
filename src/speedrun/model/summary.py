"""A plain-text model summary for `--dry-run` and the run log."""

from __future__ import annotations

from typing import Any

from torch import nn

from speedrun.config.families import model_facts
from speedrun.model.flops import FORMULA
from speedrun.model.labels import labelled
from speedrun.model.vocab import embedding_rows, padded_vocab


def _attention_line(model: nn.Module) -> str | None:
    """One line on masking and windows, or None for plain causal attention."""
    cfg, f = model.cfg, model_facts(model.cfg)
    if not (f.document_mask or f.window > 0):
        return None
    parts = [
        f"attention: backend {cfg.attention}",
        "document mask" if f.document_mask else "no document mask",
    ]
    if f.window > 0:
        warmup = ""
        if f.window_warmup != "none":
            warmup = f", {f.window_warmup} warmup in steps of {f.window_unit}"
        parts.append(f"window {f.window} ({f.window_granularity}{warmup})")
    if f.window_pattern:
        parts.append(f"layer windows {f.window_pattern}")
    n_attn = sum(block.attn is not None for block in model.blocks)
    if n_attn < cfg.n_layer:
        parts.append(f"{n_attn} of {cfg.n_layer} layers with attention")
    return "  ".join(parts)


def model_summary(model: nn.Module, cfg: Any, flops: tuple[int, int]) -> str:
    """Total parameters (the `params:` line tools parse), counts per label, and `flops`: FLOPs per token at
    the first and the last step's windows of the run `cfg` describes (train/flops.first_and_last)."""
    by_label: dict[str, list[int]] = {}
    for _, p, lab in labelled(model):
        by_label.setdefault(lab.name if lab else "unlabelled", []).append(p.numel())
    total = sum(sum(sizes) for sizes in by_label.values())
    run_cfg, cfg = cfg, model.cfg
    head_dim, qk = cfg.n_embd // cfg.n_head, model_facts(cfg).qk_head_dim
    lines = [
        f"params: {total}",
        f"vocab: {cfg.vocab_size} (embedding rows {embedding_rows(cfg)}, head rows {padded_vocab(cfg)})",
        f"layers: {cfg.n_layer}  heads: {cfg.n_head}  width: {cfg.n_embd}  head_dim: {head_dim}"
        + (f" (Q/K {qk}, #344)" if qk != head_dim else ""),
    ]
    attention = _attention_line(model)
    if attention:
        lines.append(attention)
    for name, sizes in by_label.items():
        lines.append(f"  {name:<11} {sum(sizes):>13,d} params in {len(sizes)} tensors")
    lines.append(f"  {'total':<11} {total:>13,d} params")  # grouped; the `params:` line stays plain
    if "ngram" in by_label:  # #92's hashed table dwarfs the transformer: say what is left without it
        lines.append(f"  {'without the n-gram table':<11} {total - sum(by_label['ngram']):>13,d} params")
    first, last = flops
    lines.append(
        f"flops_per_token: {first} ({first:,d} at the first step's windows, {last:,d} at the last's; "
        f"training, seq_len {run_cfg.train.seq_len})"
    )
    lines.append(f"  counted as {FORMULA}")
    return "\n".join(lines)
