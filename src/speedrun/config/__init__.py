"""Typed run configuration: recipes are TOML data validated against these dataclasses; unknown keys and
wrong types are ConfigErrors. A field's type is its whole contract: a string choice is a `Literal`, a
number is finite and >= 0 unless `Annotated[..., Range(...)]` (or a config_types alias) says otherwise;
`check_fields` checks every field so; config.checks.validate adds the cross-field rules."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from speedrun.config.gpt2026 import Gpt2026Config
from speedrun.config.labels import TABLE_OPTIMIZERS, parse_rows  # noqa: F401  (TABLE_OPTIMIZERS: API)
from speedrun.config.ships import ShipsConfig
from speedrun.config.types import (  # noqa: F401  (canonical_key is part of this module's API)
    Beta,
    Fraction,
    PosFloat,
    PosInt,
    Range,
    Seed,
    SeqLen,
    canonical_key,
    coerce,
    dotted_fields,
    field_types,
    key_type,
)

NSCoefficient = Annotated[float, Range(-100, 100)]  # a Newton–Schulz polynomial coefficient


@dataclass
class ModelConfig:
    """Shape and architecture switches of the gpt2024 family's GPT (see model/gpt2024/model.py)."""

    # the model family (model/families.py): gpt2024 = this class; gpt2026 = config.gpt2026.Gpt2026Config
    family: Literal["gpt2024", "gpt2026"] = "gpt2024"
    vocab_size: PosInt = 50257
    pad_vocab_to: PosInt = 128  # round embedding/head rows up to a multiple of this (1 = no padding)
    n_layer: PosInt = 12
    n_head: PosInt = 12
    n_embd: PosInt = 768
    mlp_ratio: PosInt = 4
    max_seq_len: SeqLen = 1024  # learned positions / rotary table length
    positional: Literal["learned", "rotary"] = "learned"
    # "layernorm" (with gains and biases) | "rmsnorm" (parameter-free) | "rmsnorm-gain" (RMSNorm with
    # gains, also after the embedding: track 3)
    norm: Literal["layernorm", "rmsnorm", "rmsnorm-gain"] = "layernorm"
    activation: Literal["gelu", "relu2"] = "gelu"
    bias: bool = True  # biases in every Linear
    fused_qkv: bool = True  # one (3d, d) QKV matrix (GPT-2) instead of separate q, k, v
    qk_norm: bool = False  # RMSNorm on queries and keys (before rotary)
    embed_norm: bool = False  # RMSNorm right after the token embedding
    tie_embeddings: bool = True
    head_bias: bool = False  # the untied head has a bias (track 3), trained with the scalars
    zero_init_proj: bool = False  # zero-init attention and MLP output projections (and their biases)
    zero_init_head: bool = False  # zero-init the (untied) lm_head (and its bias)
    # track 3 #44–#46: layer l's MLP up-projection init × (1 − this·l/(L−1)) (0.3)
    mlp_fc_init_ramp: float = 0.0
    # track 3 #46's CGI: block l's gains 1 ∓ this·s_l (attention, MLP), s_l ±1 per channel
    # (model/gpt2024/cgi.py)
    cgi_gain_alpha: float = 0.0
    # gpt2: normal 0.02, residual projections scaled | torch: PyTorch default
    # | scaled-uniform: uniform, std 0.5/sqrt(fan_in) (Sub3Min) | fan-in-normal (track 3): every linear
    # weight normal with std sqrt(0.33/fan_in), biases 0, the untied embedding normal(0, 1)
    init: Literal["gpt2", "torch", "scaled-uniform", "fan-in-normal"] = "gpt2"
    attn_residual_scale: bool = False  # scale attention output by 1/sqrt(2*n_layer) (2024-10-10)
    logit_softcap: float = 0.0  # tanh softcap value; 0 disables
    # softcap applied to the head's output in its dtype (bf16), then cast to fp32 (11-06 … 12-08 records)
    softcap_in_bf16: bool = False
    document_mask: bool = False  # attention never crosses end-of-text boundaries
    eot_id: int = 50256  # token that starts every document (used by document_mask)
    # --- 2024-11 … 2025-01 records (model/attention.py, model/gpt2024/model.py); every default = off ---
    # auto (FlexAttention on CUDA when a doc mask/window is needed) | sdpa | flex (varlen: gpt2026)
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    window: int = 0  # sliding window in tokens (final value when warmed up); 0 = unlimited
    # token | block (Sub3Min: whole 128-token blocks enter/leave)
    window_granularity: Literal["token", "block"] = "token"
    # none | floor (2024-11-24) | ceil (Sub3Min); see schedule.window_tokens
    window_warmup: Literal["none", "floor", "ceil"] = "none"
    window_warmup_start: int = 64  # s0 of the warmup formulas
    window_unit: PosInt = 64  # the window grows in multiples of this many tokens
    window_pattern: str = ""  # per layer L (long) / S (short = half of long), e.g. LSSSLSSLSSSL; "" = all L
    # U-Net skips: encoder layer i's output is added (learned weight) to layer L-1-i's input
    unet: bool = False
    x0_shortcut: bool = False  # block input = λ0·x + λ1·x0, x0 = the (normed) embedding; λ init (1, 0)
    value_residual: bool = False  # mix every layer's v with the first layer's v (2024-11-06)
    # none | per-layer (12-04) | unet (12-08) | ends (Sub3Min: 0,1,2,…,0,1,2)
    value_embeds: Literal["none", "per-layer", "unet", "ends"] = "none"
    value_embed_tables: PosInt = 3  # number of tables for value_embeds = "ends"
    # lerp: v = (1-λ)v + λ·other, λ=0.5 | lambdas: v = λ0·v + λ1·other, (0.5, 0.5)
    value_mix: Literal["lerp", "lambdas"] = "lerp"
    pad_embeddings: bool = True  # pad token/value embedding rows like the head (Sub3Min: only the head)
    # tanh: c·tanh(z/c) | sigmoid: 2c·sigmoid(2z/c) (Sub3Min, = tanh form + c) | algebraic: c·z/√(z²+c²)
    # (track 3)
    softcap_form: Literal["tanh", "sigmoid", "algebraic"] = "tanh"
    attn_scale: float = 0.0  # attention logit scale; 0 = 1/sqrt(head_dim) (Sub3Min: 0.12)
    rope_half_truncated: bool = False  # Sub3Min RoPE: head_dim/4 frequencies 1…1/1024, the rest unrotated
    no_attention_layers: str = ""  # comma-separated layers that have only an MLP (Sub3Min: "7")
    # fp32 | bf16 (token/value embeddings stored in bf16, records from 11-08)
    embed_dtype: Literal["fp32", "bf16"] = "fp32"
    # --- numerics of individual records (docs/recipes.md); defaults = today's behaviour ---
    gelu: Literal["tanh", "erf"] = "tanh"  # erf: exact GELU (the 2024-10-04 seed and 10-10)
    norm_eps: float = 0.0  # RMSNorm epsilon; 0 = F.rms_norm's default (the dtype's machine epsilon)
    norm_fp32: bool = False  # RMSNorm computed in fp32 and cast back (2024-10-04 / 10-10, eps 1e-6)
    # auto (activation dtype; fp32 for half-truncated) | fp32 (10-10) | bf16 (cos/sin tables rounded to
    # bf16: 10-14 … 11-24) | bf16-angles (12-04/12-08: bf16 inverse frequencies and angles)
    rope_precision: Literal["auto", "fp32", "bf16", "bf16-angles"] = "auto"
    qk_norm_after_rotary: bool = False  # QK-norm applied after rotary (2024-10-14 only)
    bf16_model: bool = False  # every parameter but the Linear weights in bf16 (11-08 … 12-08)
    window_block_list: bool = False  # 12-08: kv blocks listed only while q_block − kv_block < ceil(w/128)
    # SDPA backend forced on CUDA (cudnn: 11-03 … 11-24)
    sdpa_kernel: Literal["auto", "cudnn", "flash", "efficient", "math"] = "auto"
    fp8_head: bool = False  # Sub3Min: lm_head matmul in FP8 (e4m3 forward, e5m2 gradients) when training
    # softmax, loss and returned logits over the real vocab only, padded head rows left out (llm.c)
    logits_vocab_only: bool = False


@dataclass
class DataConfig:
    """Where tokens come from; `speedrun prepare` builds the shards this points at."""

    source: str = "wiki-vital"  # wiki-vital | text:PATH | fineweb10B[:N]
    tokenizer: str = "gpt2"  # gpt2 | bpe:N
    dir: str = ""  # shard folder; empty = the default folder of source + tokenizer
    align_to_bos: bool = False  # start every micro-batch at a document start
    # the records' data order (docs/recipes.md, Data): 10-10 … 12-08 give each of their 8 ranks its own
    # cursor (0 = one cursor for the global batch); 12-08 and Sub3Min leave 1 token more at a shard's end;
    # 10-10 … 11-10 train steps 0 and 1 on the first batch
    rank_cursors: int = 0
    end_margin: int = 0
    repeat_first_batch: bool = False
    # --- issue 20: the document loader of the 2025-07 … records (data/bos_loader.py) ---
    # tokens (TokenLoader) | documents (every row starts at BOS, with cu_seqlens; #26 on): a step is
    # global / micro rows of micro_batch_tokens (= seq_len), the records' 8 ranks
    loader: Literal["tokens", "documents"] = "tokens"
    doc_rule: Literal["stream", "packed"] = "stream"  # stream: #26's chunks | packed: #29 on, docs cut
    max_doc_len: int = 0  # packed: documents cut to this many tokens (0 = no cut)
    max_docs: int = 0  # cu_seqlens length per training chunk (0 = the records' table; #29–#45: 256)


@dataclass
class OptimConfig:
    """Optimizer choice and hyperparameters. Learning rates are peak values before the schedule."""

    # "adamw" (one AdamW for everything) | "muon" (Muon matrices + Adam rest) | "normuon" (the
    # 2025–26 optimizer: one table-driven NorMuon + labelled Adam, sharded without DDP; optim/sharded.py)
    # | "anvil" (#92: the same table and sharding, ANVIL on the matrices; optim/anvil.py)
    name: Literal["adamw", "muon", "normuon", "anvil"] = "adamw"
    # AdamW baseline
    lr: float = 6e-4
    weight_decay: float = 0.1  # applied to >= 2-D parameters only
    betas: tuple[Beta, Beta] = (0.9, 0.95)
    eps: PosFloat = 1e-8
    grad_clip: float = 0.0  # max global grad norm; 0 disables
    # Muon for the transformer's 2-D matrices
    muon_lr: float = 0.02
    muon_momentum: Beta = 0.95  # < 1, as torch.optim.Muon demands
    muon_momentum_start: Beta = 0.95  # momentum warmup from this value ...
    muon_momentum_warmup_steps: int = 0  # ... to muon_momentum over this many steps
    muon_backend: Literal["newton_schulz", "polar_express", "svd"] = "newton_schulz"
    muon_ns_steps: PosInt = 5
    # Newton–Schulz (a, b, c) of X ← aX + (bA + cA²)X under optim.name = "muon" (track 3: (2, -1.5, 0.5))
    muon_ns_coefficients: tuple[NSCoefficient, NSCoefficient, NSCoefficient] = (3.4445, -4.7750, 2.0315)
    muon_shape_scale: Literal["ratio", "max_dim", "rms", "none"] = "ratio"
    muon_weight_decay: float = 0.0  # decoupled decay of the Muon matrices (cautious under name = "normuon")
    # Adam groups that go with Muon
    embed_lr: float = 0.3
    head_lr: float = 0.002
    scalar_lr: float = 0.02
    # Muon numerics of individual records (defaults = today's behaviour)
    # ema (lerp; 12-08 on) | sgd (buf = m·buf + g, update g + m·buf; to 12-04)
    muon_momentum_form: Literal["ema", "sgd"] = "ema"
    # the Newton–Schulz op order of each era (optim/orthogonalize.py); fused is ours
    muon_ns_form: Literal["fused", "2024-10-10", "2024-10-14", "2024-11-10", "2026-06"] = "fused"
    muon_split_qkv: bool = True  # orthogonalize a fused QKV as three matrices (false: the 2024-10-04 seed)
    # precision of the Newton–Schulz / Polar Express iterations: auto = bf16 (the records) where the device
    # runs bf16 fast, else fp32 (train/plan/precision.py)
    muon_ns_dtype: Literal["auto", "bf16", "fp32"] = "auto"
    muon_scale_in_bf16: bool = False  # multiply the bf16 update by its shape scale in bf16 (10-17 … 12-04)
    # momentum cools down from muon_momentum to muon_momentum_start over the last N steps (#39: 50)
    muon_momentum_cooldown_steps: int = 0
    # --- name = "normuon" only (docs/recipes.md, "The optimizer table"); muon_weight_decay is then
    # cautious with factor wd·lr·lr_eff, and Adam's decay cautious with factor lr²·wd·multiplier ---
    normuon_beta2: Fraction = 0.95  # EMA of the row/column mean squares (#41; HEAD 0.9); 0 = plain Muon
    adam_every: PosInt = 1  # Adam steps every N-th step, its gradients summed over the N (#39: 2)
    # normuon: cautious decoupled decay of embeddings and head (#50: 0.005); muon: plain decoupled decay
    # (AdamW's p ← p·(1 − lr·wd)) of every Adam group (track 3: 0.001)
    adam_weight_decay: float = 0.0
    embed_betas: tuple[Beta, Beta] = (0.5, 0.95)  # token embedding and head (#52/#56)
    value_embed_betas: tuple[Beta, Beta] = (0.75, 0.95)
    scalar_betas: tuple[Beta, Beta] = (0.9, 0.99)
    embed_wd_mul: float = 150.0  # multipliers of adam_weight_decay per label (HEAD's wd_mul)
    value_embed_wd_mul: float = 5.0
    value_embed_lr: float = 0.0  # 0 = embed_lr
    tie_until: int = 0  # token embedding and head tied by the optimizer for the first N steps (#51/#53)
    muon_qk_block_heads: int = 0  # Q and K orthogonalized per group of this many heads (#80: 2); 0 = whole
    mlp_proj_lr_mul: float = 1.0  # LR multiplier of the MLP output projections (HEAD: 2, see docs/recipes.md)
    # LR multiplier of the attention matrices (#48–#53: 2, their (3072, 768) qkvo's shape)
    attn_lr_mul: float = 1.0
    mlp_fc_lr_mul: float = 1.0  # LR multiplier of the MLP up-projections (#42: 2, stored (768, 3072))
    # NorMuon's statistics of a square matrix: one per row (#48 on) | one per column (#41–#47, whose
    # attention matrices are blocks of a wide (768, 3072) parameter)
    normuon_square_stats: Literal["rows", "cols"] = "rows"
    normuon_gate_row_stats: bool = False  # #48–#55: the attention gates (heads, 12): one statistic per head
    # #56: > 0 = Adam (label gate, replicated, decayed) trains the attention and value-embedding gates
    gate_lr: float = 0.0
    gate_betas: Literal["embed", "scalar"] = "embed"  # Adam-trained gates' betas: main | scalars' (#65)
    x0_betas: tuple[Beta, Beta] = (0.65, 0.95)  # the x0 lambdas' betas (#52: the main Adam's; #65 keeps them)
    x0_lr: float = 0.0  # the x0 lambdas' Adam LR (medium-2025-12: 0.004 x 5); 0 = scalar_lr (#52–#65)
    gate_lr_mul: PosFloat = 1.0  # NorMuon-trained attention/value-embedding gates' LR factor (medium: 0.1)
    skip_gate_lr: float = 0.0  # #55: the skip gate's Adam LR (0.008 x 0.05), main-Adam betas, no decay
    smear_gate_lr: float = 0.0  # #52: > 0 = Adam trains the smear gate at this LR (0.008 x 0.01), not NorMuon
    scalar_freeze_steps: int = 0  # scalars pause this many steps from each schedule transition on (#52: 40)
    # --- name = "anvil" only (#92, optim/anvil.py; docs/recipes.md, "ANVIL"); the normuon keys above apply
    # too: the momentum schedule is the Nesterov lookahead μ and the fast rail's beta before the engage
    # step, normuon_beta2 the lane equaliser's EMA (#92: 0.9), muon_weight_decay the decay the slow rail
    # gates (#92: 2.25); the cascade runs in muon_ns_dtype ---
    anvil_slow_beta: Beta = 0.98  # the slow rail's EMA of the gradient, from step 0
    anvil_fast_beta: Beta = 0.85  # the fast rail's beta from the engage step on
    anvil_fast_weight: Fraction = 0.4385  # the fast rail's share of the blend from the engage step on
    anvil_engage_step: int = 514  # before it the update reads the fast rail alone, on beta = momentum
    anvil_margin: Annotated[float, Range(1, 10)] = 1.05  # X / (margin·‖X‖_F + eps) before the six maps
    anvil_eps: PosFloat = 1e-6
    # from this step the value_embed group (bigram joins it) steps on steps ≡ 3 (mod 4) on the summed
    # gradients of the four, betas squared and decay doubled (#92: 336; a multiple of 4, with adam_every=2)
    value_embed_every4_from: int = 0
    # --- track 3, #46 (optim/pinned_muon.py, optim/tail_ema.py; optim.name = "muon", separate q/k/v) ---
    muon_soap: bool = False  # SOAP-Muon: momentum preconditioned in the eigenbases of EMA(GGᵀ), EMA(GᵀG)
    muon_soap_beta2: Fraction = 0.9  # the EMAs' and the rotated second moment's beta (#46: 0.9)
    muon_radius_pin: bool = False  # outward radial part of the update halved, ‖W‖ moved by it alone
    muon_uw_floor: float = 0.0  # update lifted to this share of the weight's norm (#46: 0.3825); 0 = off
    muon_row_floor: bool = False  # the floor per output row (RowFloor, #46)
    muon_post_pin_cwd: float = 0.0  # cautious decay after the pin, p·(1 − lr·cwd) where U·W > 0 (#46: 0.025)
    tail_ema_tau: float = 0.0  # Tail-EMA readout: ema += (w − ema)/tau over the tail (#46: 150); 0 = off
    tail_ema_start: int = 0  # ... from this many steps taken (#46: 2,400) ...
    tail_ema_end: int = 0  # ... until this many (#46: 2,900)
    tail_ema_lambda: Fraction = 0.6  # validation evaluates (1 − λ)·w + λ·ema
    # EMA-Nesterov (#46): before step s's forward, with start < s + 1 and s < end, W += step·r·B (r: the
    # first Adam group's LR over its peak), B an EMA (beta) of each step's displacement; 0 = off
    ema_nesterov_step: float = 0.0
    ema_nesterov_beta: Beta = 0.99  # < 1: a beta of 1 never moves the EMA (ema_nesterov.py asserts it)
    ema_nesterov_start: int = 0  # (#46: 300)
    ema_nesterov_end: int = 0  # (#46: its 2,900 steps − 950 = 1,950)
    # PowerCool (#46): each group's LR is min(its scheduled LR, c·max(0, end − s)^power), c per group in
    # the order embed, head, matrix, scalar (#46: 4.98e-5, 5.18e-7, 3.32e-6, 1.66e-6; end 2,900, power 1.2)
    power_cool_end: int = 0  # 0 = off
    power_cool_power: Annotated[float, Range(0, 10, lo_open=True)] = 1.0  # (end − s)^10 of 2^31 fits a float
    power_cool_c: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    # false: the scalar group (gains, biases, lambdas) in Adam without bias correction (#46's aux Adam,
    # optim/plain_adam.py), under optim.name = "muon"
    scalar_bias_correction: bool = True
    # MuonH (track 3 result #5): each Muon matrix steps lr·‖W‖ along U/‖U‖ and is put back on its sphere
    muon_hyperball: bool = False
    # issue 25: rows of the label table stated by the recipe, {label: {rule, lr, betas, ...}}
    # (config/labels.py); a label without one keeps the row derived from the fields above
    labels: Annotated[dict[str, dict[str, Any]], parse_rows] = field(default_factory=dict)
    # #92's terminal ships (config/ships.py, optim/ships.py): weights built from the last steps, shipped
    # after the last one on the clock; every window 0 = off
    ships: ShipsConfig = field(default_factory=ShipsConfig)


@dataclass
class TrainConfig:
    """Batch, schedule, evaluation and runtime settings."""

    steps: PosInt = 100
    global_batch_tokens: PosInt = 524288  # tokens per optimizer step, whatever the world size
    micro_batch_tokens: PosInt = 65536  # tokens per process per forward/backward
    # #26 on, the records back-propagate each of their N = 8 ranks' summed loss: gradients (tokens per
    # step)/N times the mean loss's, which Adam's eps and the orthogonalizers' norm epsilons see. N > 0
    # scales every gradient by that (per stage, whatever our process count); 0 = the mean loss's gradients
    summed_loss_ranks: int = 0
    # #65's grad_scale: a further constant factor on every gradient (2 / grad_accum_steps on its 8 ranks = 2)
    grad_scale_mul: float = 1.0
    seq_len: SeqLen = 1024
    warmup_steps: int = 0
    warmdown_steps: int = 0  # linear decay over the last N steps (schedule "trapezoid")
    warmdown_frac: Fraction = 0.0  # warmdown over this fraction of the steps instead (Sub3Min: 0.4)
    # "trapezoid" (warmup, constant, linear warmdown) | "cosine"
    schedule: Literal["trapezoid", "cosine"] = "trapezoid"
    final_lr_frac: Fraction = 0.0  # LR floor as a fraction of the peak
    val_every: int = 0  # 0 = only at the end
    val_tokens: PosInt = 10485760
    log_every: PosInt = 10  # log points: the only steps where the host waits for the device
    timing_warmup_steps: int = 10  # first steps (compile, allocator warm-up) not timed
    # auto: bf16 autocast where the device runs bf16 fast (GPUs; CPUs with AVX512-BF16/AMX/ARM BF16), else
    # fp32 | bf16: the records' bf16 autocast (fp32 on a CPU without fast bf16, logged) | fp32: no autocast
    dtype: Literal["auto", "bf16", "fp32"] = "auto"  # train/plan/precision.py
    compile: Literal["auto", "on", "off"] = "auto"  # auto (on for CUDA only) | on | off
    # the speed layer (speedrun/perf/): auto = its kernels where they run (CUDA with Triton), the plain ops
    # elsewhere | off = the plain ops everywhere (bit for bit the algorithm's own code)
    perf: Literal["auto", "off"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto | cpu | cuda
    # process-group timeout: a rank fails instead of hanging when a peer dies; long enough for rank 0
    # alone to write a full-size checkpoint (~3 GB) to a slow disk while the others wait
    dist_timeout_s: PosInt = 1800
    seed: Seed = 1337
    checkpoint_every: int = 0  # save a checkpoint every N steps (0 = never, except as below)
    checkpoint_at_end: bool = False  # save one after the last step
    checkpoint_keep: int = 2  # keep the newest K checkpoints (0 = keep all)
    sample_every: int = 0  # log a few fixed-prompt greedy samples every N steps (0 = never)
    wandb_project: str = ""  # also log to this Weights & Biases project (needs wandb; "" = off)
    # train about this many seconds (timed steps): the step count is planned from measured step times while
    # the LR is constant, then saved in config.json; train.steps is the most it may be (train/plan/budget.py)
    time_budget_s: float = 0.0
    # with a time budget on CPU, where fewer than this / 1.5 steps fit: halve the batch, then the width,
    # until this many fit (host_fit.py); keys the user gave are kept
    budget_min_steps: int = 0
    val_autocast: bool = True  # validate under the training autocast; false: fp32 (2024-10-04 / 10-10)
    # --- issue 20: validation rows of this many tokens, one per process per val step (#21 on: 4·64K)
    val_seq_len: int = 0  # 0 = train.seq_len
    # training stages (#46 on; config_stages.parse_stages): "tokens=N doc=N windows=S/L lr=F frac=F; ...;
    # tokens=N doc=N windows=S/L ext=N val=L" — per stage the tokens per step, longest document, short/long
    # windows in 128-token blocks, LR multiplier and fraction of the scheduled steps; the last stage runs
    # `ext` extension steps (inside train.steps) and `val` is the final validation's long window. "" = off
    stages: str = ""
    # where the stages' LR cool-down starts: int = int(N·(1 − warmdown_frac)), t = (s − start)/(N − start)
    # (HEAD) | exact = N·(1 − warmdown_frac), w = (1 − min(s/N, 0.9999))/warmdown_frac (#26–#45's
    # get_lr, N the scheduled steps; the extension at the floor + 0.0002·(1 − floor)) | fraction = #46–#53's
    # get_lr: x = s/N, w = (1 − x)/warmdown_frac once x >= 1 − warmdown_frac, the floor after N
    cooldown_start: Literal["int", "exact", "fraction"] = "int"
    # where a stage starts: round = round(N·cumulative frac) (HEAD) | fraction = the first step with
    # s/N >= it, and MTP weights linear in s/N (#46–#53's int(3·s/N))
    stage_bounds: Literal["round", "fraction"] = "round"

    @property
    def document_rows(self) -> int:
        """Rows of one step under data.loader=documents (global / micro, one BOS-aligned row each,
        whatever a stage's tokens): the one place this is computed."""
        return self.global_batch_tokens // self.micro_batch_tokens

    def warmdown_span(self, steps: int | None = None) -> float:
        """The LR warm-down of a `steps`-step run (default `self.steps`), in steps: `warmdown_frac` of it
        when set (Sub3Min: 0.4, fractional), else `warmdown_steps`. The one rule: the LR formula, the
        config's checks and the time budget's plans read it."""
        n = self.steps if steps is None else steps
        return self.warmdown_frac * n if self.warmdown_frac > 0 else float(self.warmdown_steps)


@dataclass
class Config:
    """A complete, resolved run configuration."""

    recipe: str = "custom"
    description: str = ""
    model: ModelConfig | Gpt2026Config = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    # the dotted keys the user fixed (command line, own recipe file): automatic choices (host fit, time
    # budget, precision, compile) leave them alone. Set where a config is loaded; config.json keeps it
    # beside the config (config_files.FIXED), not inside: it says who chose a value, not what it is
    fixed: frozenset[str] = field(default_factory=frozenset)

    def to_dict(self) -> dict[str, Any]:
        return {key: value for key, value in dataclasses.asdict(self).items() if key != "fixed"}


#: model config class per family: `model.family` picks one when a table or override sets it
MODEL_FAMILIES: dict[str, type] = {"gpt2024": ModelConfig, "gpt2026": Gpt2026Config}


def check_fields(cfg: Config) -> None:
    """Every field against its declared type, range and choices (defaults and direct edits included)."""
    for section in sections():
        _check_object(section, getattr(cfg, section))


def _check_object(prefix: str, obj: Any) -> None:
    for name, typ in field_types(type(obj)).items():
        if dataclasses.is_dataclass(typ):  # a part table
            _check_object(f"{prefix}.{name}", getattr(obj, name))
        else:
            coerce(f"{prefix}.{name}", getattr(obj, name), typ)


def all_keys() -> list[str]:
    """Every dotted key a recipe or override may set."""
    keys = ["recipe", "description"] + [k for s, cls in sections().items() for k in dotted_fields(cls, s)]
    return keys + [k for k in dotted_fields(Gpt2026Config, "model") if k not in keys]


def sections() -> dict[str, type]:
    return {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig, "train": TrainConfig}
