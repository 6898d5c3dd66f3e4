"""Sub-keys: settings that are read only while a switch is on (`optim.tail_ema_start` while
`optim.tail_ema_tau` is 0 is read by nothing). `NEEDS` says, per config section, which field needs which
switches; `config.checks.check_subkeys` is the one check that walks it. Each row was found by reading the
code that reads the key: a key read only under a condition is a sub-key of that condition.

A switch is "KEY" (on when nonzero, true or not blank), "KEY=A|B" (on at one of those values), "!KEY" (on
while KEY is off) or alternatives "S1 or S2" (on when one is); a field with several switches needs all.
The gpt2026 model's rows name a part's field as `part.field` (`attn.window_unit`); the rules between a part's
fields that say more than "off" stay in the part's own check (config/gpt2026/). Not here: keys whose condition
an older rule owns with more in it (model.cgi_gain_alpha and rope_half_truncated in config/families.py;
optim.scalar_bias_correction, the pinned switches, ema_nesterov_step, power_cool_end and the adamw rule in
config/checks.py)."""

from __future__ import annotations

from speedrun.config import DataConfig, ModelConfig, OptimConfig, TrainConfig
from speedrun.config.gpt2026 import Gpt2026Config

RMSNORM = "model.norm=rmsnorm|rmsnorm-gain or model.qk_norm or model.embed_norm"  # make_norm's RMSNorms
TOKENS = "data.loader=tokens"  # the token loader's data order (data/loader.py)
NORMUON = "optim.name=normuon|anvil"  # the table optimizers' rows (config/labels.py derived_rows)
ANVIL = "optim.name=anvil"  # optim/anvil.py
# Muon (optim/muon.py) itself: not NorMuon, not #46's PinnedMuon (optim/build.py pinned)
PLAIN_MUON = ("optim.name=muon", "!optim.muon_soap", "!optim.muon_radius_pin", "!optim.muon_uw_floor")
PLAIN_MUON += ("!optim.muon_post_pin_cwd", "!optim.muon_hyperball")
NEWTON_SCHULZ = "optim.muon_backend=newton_schulz"  # optim/orthogonalize.orthogonalize

NEEDS: dict[type, dict[str, tuple[str, ...]]] = {
    ModelConfig: {  # model/gpt2024/ (its layer_specs, make_norm, make_rotary), train/schedule.py
        "window_granularity": ("model.window",),
        "window_block_list": ("model.window",),
        "window_pattern": ("model.window",),
        "window_warmup": ("model.window",),
        "window_warmup_start": ("model.window_warmup=floor|ceil",),
        "window_unit": ("model.window_warmup=floor|ceil",),
        "value_embed_tables": ("model.value_embeds=ends",),
        "value_mix": ("model.value_residual or model.value_embeds=per-layer|unet|ends",),
        "softcap_form": ("model.logit_softcap",),
        "softcap_in_bf16": ("model.logit_softcap",),
        "qk_norm_after_rotary": ("model.qk_norm",),
        "rope_precision": ("model.positional=rotary",),
        "gelu": ("model.activation=gelu",),
        "norm_eps": (RMSNORM,),
        "norm_fp32": (RMSNORM,),
    },
    Gpt2026Config: {  # train/schedule.py, model/gpt2026/ (head, sampled, model, ngram)
        "attn.window_warmup_start": ("model.attn.window_warmup=floor|ceil",),
        "attn.window_unit": ("model.attn.window_warmup=floor|ceil",),
        "head.softcap_divisor": ("model.head.softcap",),
        "head.softcap_in_bf16": ("model.head.softcap",),
        "stream.skip_gate_form": ("model.skips",),  # model/gpt2026/model.py: the skips' weights
        "ngram.sign_rows": ("model.ngram.rows",),  # model/gpt2026/ngram.py: the table's build
        "ngram.dim": ("model.ngram.rows",),
        "ngram.dtype": ("model.ngram.rows",),
    },
    DataConfig: {  # train/plan/run_data.open_loader
        "align_to_bos": (TOKENS,),
        "rank_cursors": (TOKENS,),
        "end_margin": (TOKENS,),
        "repeat_first_batch": (TOKENS,),
        "doc_rule": ("data.loader=documents",),
        "max_docs": ("data.loader=documents",),
        "max_doc_len": ("data.loader=documents", "data.doc_rule=packed"),
    },
    OptimConfig: {  # optim/build.py, config/labels.py, train/schedule.py, config/stages.py
        "muon_momentum_start": ("optim.muon_momentum_warmup_steps or optim.muon_momentum_cooldown_steps",),
        "muon_ns_steps": ("optim.muon_backend=newton_schulz|polar_express",),
        "muon_ns_form": (NEWTON_SCHULZ,),
        "muon_ns_coefficients": ("optim.name=muon", NEWTON_SCHULZ),  # NorMuon keeps the records' own
        "muon_shape_scale": PLAIN_MUON,
        "muon_momentum_form": PLAIN_MUON,
        "muon_scale_in_bf16": PLAIN_MUON,
        "muon_soap_beta2": ("optim.muon_soap",),
        "muon_row_floor": ("optim.muon_uw_floor",),
        "muon_post_pin_cwd": ("optim.muon_radius_pin",),
        "tail_ema_start": ("optim.tail_ema_tau",),
        "tail_ema_end": ("optim.tail_ema_tau",),
        "tail_ema_lambda": ("optim.tail_ema_tau",),
        "ema_nesterov_beta": ("optim.ema_nesterov_step",),
        "ema_nesterov_start": ("optim.ema_nesterov_step",),
        "ema_nesterov_end": ("optim.ema_nesterov_step",),
        "power_cool_power": ("optim.power_cool_end",),
        "power_cool_c": ("optim.power_cool_end",),
        **dict.fromkeys(
            ("anvil_slow_beta", "anvil_fast_beta", "anvil_fast_weight", "anvil_engage_step", "anvil_margin"),
            (ANVIL,),
        ),
        "anvil_eps": (ANVIL,),
        "value_embed_every4_from": (ANVIL,),
        **dict.fromkeys(
            (
                "normuon_beta2",
                "normuon_square_stats",
                "normuon_gate_row_stats",
                "adam_every",
                "embed_betas",
                "value_embed_betas",
                "scalar_betas",
                "x0_betas",
                "gate_betas",
                "embed_wd_mul",
                "value_embed_wd_mul",
                "value_embed_lr",
                "tie_until",
                "muon_qk_block_heads",
                "mlp_proj_lr_mul",
                "attn_lr_mul",
                "mlp_fc_lr_mul",
                "gate_lr",
                "x0_lr",
                "gate_lr_mul",
                "skip_gate_lr",
                "smear_gate_lr",
                "scalar_freeze_steps",
            ),
            (NORMUON,),
        ),  # fmt: skip
    },
    TrainConfig: {  # train/schedule.lr_multiplier, config/stages.stage_plan, train/plan/host_fit.py
        "budget_min_steps": ("train.time_budget_s",),
        "cooldown_start": ("train.stages",),
        "stage_bounds": ("train.stages",),
        "final_lr_frac": ("train.warmdown_steps or train.warmdown_frac or train.schedule=cosine",),
    },
}
