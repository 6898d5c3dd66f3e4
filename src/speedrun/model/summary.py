"""A plain-text model summary for `--dry-run` and the run log."""

from __future__ import annotations

from speedrun.model.gpt import GPT, padded_vocab


def model_summary(model: GPT, seq_len: int) -> str:
    """Total parameters (the `params:` line tools parse), counts per optimizer role, FLOPs per token."""
    roles = model.param_roles()
    total = sum(p.numel() for group in roles.values() for _, p in group)
    cfg = model.cfg
    lines = [
        f"params: {total}",
        f"vocab: {cfg.vocab_size} (embedding rows {padded_vocab(cfg)})",
        f"layers: {cfg.n_layer}  heads: {cfg.n_head}  width: {cfg.n_embd}  head_dim: {cfg.n_embd // cfg.n_head}",
    ]
    for role, group in roles.items():
        lines.append(f"  {role:<7} {sum(p.numel() for _, p in group):>13,d} params in {len(group)} tensors")
    lines.append(f"flops_per_token: {model.flops_per_token(seq_len)} (training, seq_len {seq_len})")
    return "\n".join(lines)
