"""The memory guard: a training step's peak memory per process, estimated from the config alone, and a
check before step 0 on CUDA that names the setting that fits when the recipe does not.

The peak is at the start of the backward: weights, gradients that outlive the step, optimizer state,
saved activations, and the logits with the loss's first gradients. Parameters come from the model built
on the meta device. Eager keeps every intermediate autograd needs (within 6 % of tests/fake_memory.py's
fake-tensor measurement for every bundled recipe it can run); compiled (inductor) recomputes pointwise
work, keeping per layer the norms' inputs, QKV, attention output and MLP pre-activation, and one
logit-sized gradient, plus what the family's record adds (`CompiledSaves`, read from inductor's
partition: tests/fake_compiled_memory.py): a model, not a measurement (`speedrun bench` prints it
beside the CUDA peak)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from speedrun.config import TABLE_OPTIMIZERS, Config
from speedrun.config.families import model_facts
from speedrun.config.gpt2026 import ngram
from speedrun.errors import SpeedrunError
from speedrun.model.families import family_of
from speedrun.model.labels import MATMULS, labelled
from speedrun.model.vocab import padded_vocab
from speedrun.optim.build import model_rules
from speedrun.optim.normuon import second_moment_shape
from speedrun.optim.ships import accumulator_bytes
from speedrun.optim.table import build_banks, build_rows
from speedrun.optim.table_rows import table_part
from speedrun.train.flops import config_model

GiB = 2**30


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per process at a step's peak, by part (`total`: the largest of the backward's start, the
    optimizer step and a validation forward)."""

    weights: int
    gradients: int  # alive at the backward's start (accumulation or DDP buckets), else 0
    optimizer: int  # state, plus Muon's all-gather buffers on several processes
    activations: int  # saved for backward by the layers (and eager's bf16 weight copies)
    logits: int  # the loss's saved tensors and first gradients
    optimizer_step: int  # weights + gradients + state + the step's temporaries
    validation: int  # a validation forward: weights, DDP's buckets, state, its logits

    @property
    def backward_start(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits

    @property
    def total(self) -> int:
        return max(self.backward_start, self.optimizer_step, self.validation)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _optimizer_bytes(cfg: Config, model: torch.nn.Module, world: int) -> tuple[int, int]:
    """(state bytes per process, the step's temporaries) of the run's optimizer."""
    table = table_part(model)  # #92's n-gram table is counted apart (`_table_bytes`)
    entries = [e for e in model_rules(model, cfg) if table is None or e.param is not table.table]
    matrices = [e.param for e in entries if e.rule.rule != "adam"]
    others = [e.param for e in entries if e.rule.rule == "adam"]
    if cfg.optim.name == "adamw":  # exp_avg, exp_avg_sq like each parameter
        return 2 * _nbytes(others + matrices), 0
    if cfg.optim.name == "muon":  # fp32 momentum per matrix, Adam's two moments for the rest
        momentum = sum(p.numel() * max(4, p.element_size()) for p in matrices)
        state = momentum + 2 * _nbytes(others)
        by_shape: dict[tuple[int, ...], int] = {}
        for p in matrices:
            by_shape[tuple(p.shape)] = by_shape.get(tuple(p.shape), 0) + p.numel()
        largest = max(by_shape.values(), default=0)
        if world > 1:  # per shape: this rank's blocks and the gathered blocks of all ranks, bf16
            state += sum(2 * math.ceil(n / world) * (world + 1) for n in by_shape.values())
        # Nesterov directions of every matrix (fp32), then per shape a stacked copy and the
        # Newton-Schulz iterates
        return state, momentum + 4 * largest + 3 * 2 * largest
    rows = build_rows(entries, world)  # normuon: state only for this rank's shard (optim/sharded.py)
    state, rails = 0, 2 if cfg.optim.name == "anvil" else 1  # ANVIL: a fast and a slow velocity
    if cfg.optim.ships.on():  # #92's terminal ships: fp32 accumulators of this rank's chunk of each bank
        state += accumulator_bytes(model, cfg.optim.ships, cfg.train.steps, world)
    for bank in build_banks(rows, world):
        per_rank = bank.per_rank * bank.shape[0] * bank.shape[1]
        state += per_rank * (4 * rails + (2 if bank.dtype == torch.bfloat16 else 0))  # momentum (+ mantissa)
        rule = bank.stats_rule(cfg.optim.normuon_square_stats)
        moments = second_moment_shape((bank.per_rank, *bank.shape), rule)
        state += 4 * math.prod(moments)  # the second moment's row or column means (along the longer side)
    for row in rows:
        if row.rule == "adam":
            state += 2 * 4 * row.param.numel() // (world if row.sharded and world > 1 else 1)
    return state, 2 * _nbytes(matrices)  # the stacked gradients and the gathered new weights


def _activation_bytes(cfg: Config, compiled: bool) -> tuple[int, int]:
    """(bytes saved for backward per token by the layers, bytes per logit at the backward's start)."""
    m, f, d = cfg.model, model_facts(cfg.model), cfg.model.n_embd
    bf16_stream = f.embed_dtype == "bf16" or f.bf16_model
    r = 2 if bf16_stream else 4  # the residual stream: the embedding's dtype
    a = 2 if bf16_stream or cfg.train.dtype == "bf16" else 4  # matmul outputs (CastedLinear, autocast)
    sub = getattr(m, "mlp", None)  # gpt2026's [model.mlp]: #92's hidden width and its parallel MLPs
    hidden = (sub.hidden or m.mlp_ratio * d) if sub is not None else m.mlp_ratio * d
    parallel = set(sub.parallel_layers) if sub is not None else set()
    attn, mlp, layout, skipped, mixes, x0 = family_of(m).layer_facts(m)
    saves, fp8_mlp = family_of(m).compiled_saves, f.fp8_mlp
    total = r * d * (1 + len({j for j in layout if j is not None}))  # token (and value) embeddings
    parts = zip(attn, mlp, strict=True)
    for i, (has_attention, has_mlp) in enumerate(parts):
        residuals = int(has_attention) + int(has_mlp)  # after the attention, after the MLP
        residuals += int(x0) + int(i in skipped)
        if compiled:  # the norms' inputs, the QKV, the attention's output, the MLP's pre-activation
            total += residuals * r * d
            copies = saves.matmul_input_copies and a < r  # the matmul dtype's copy of each input
            mlps = int(has_mlp) + int(i in parallel)  # #92's parallel MLP beside the layer's own
            if mlps and fp8_mlp:  # its input and ReLU²'s output in the stream's dtype (fp8_mlp.py)
                total += mlps * r * (d + hidden)
            elif mlps:
                total += mlps * (a * hidden * (1 + int(saves.mlp_post)) + a * d * int(copies))
            if has_attention:
                total += a * (3 * d + d + 2 * d) + 4 * m.n_head  # q, k, v, output, rotated q, k, lse
                total += 2 * a * d * int(copies)  # the QKV's and the output projection's inputs
            continue
        norms = int(has_attention) + int(has_mlp)
        mlps = int(has_mlp) + int(i in parallel)
        total += (residuals + norms) * r * d + 2 * a * hidden * mlps  # + MLP pre- and post-activation
        if has_attention:
            v_mixed = mixes[i]
            rotated = f.positional == "rotary" or f.qk_norm
            # QKV; mixed v; rotated (or normed) q, k; attention output and its (B, T, C) copy; lse
            total += a * d * (3 + int(v_mixed) + 2 * int(rotated) + 2) + 4 * m.n_head
    total += r * d if not f.fp8_head else d  # the head's input (FP8: its e4m3 copy)
    head = 2 if (a == 2 or f.fp8_head) else 4
    if compiled:  # the head's output saved, its gradients, and the FP8 backward's e5m2 copy
        return total, head * (1 + saves.logit_gradients) + (1 if f.fp8_head else 0)
    capped = (head if f.softcap_in_bf16 else 4) if f.logit_softcap > 0 else 0
    return total, capped + 4 + 4 + 4  # softcap output, log-softmax, and two gradients of the loss


def _validation_bytes(cfg: Config, compiled: bool) -> int:
    """Bytes of one validation forward beyond weights and state: eager, the fp32 logits' softcap
    intermediates or logits and log-softmax; compiled, the head's output; plus a layer's activations."""
    m, f, t = cfg.model, model_facts(cfg.model), cfg.train
    tokens = t.val_seq_len or t.micro_batch_tokens
    bf16_stream = f.embed_dtype == "bf16" or f.bf16_model
    a = 2 if bf16_stream or (t.dtype == "bf16" and t.val_autocast) else 4
    per_logit = a if compiled else (12 if f.logit_softcap > 0 and not f.softcap_in_bf16 else 8)
    layer = a * m.mlp_ratio * m.n_embd * (1 if compiled else 2) + 4 * 3 * m.n_embd
    return tokens * (padded_vocab(m) * per_logit + layer)


def estimate_memory(cfg: Config, world_size: int, compiled: bool) -> MemoryEstimate:
    """The peak of one training step of `cfg` (its effective config: `train.dtype` resolved) on each
    of `world_size` processes, compiled or eager, on CUDA (FlexAttention, fused RMSNorm)."""
    assert cfg.train.dtype != "auto", "resolve train.dtype first (precision.effective_config)"
    t, f = cfg.train, model_facts(cfg.model)
    model = config_model(cfg)
    table = table_part(model)  # #92's n-gram table: this process's rows and their state, `_table_bytes`
    unique = {id(p): p for p in model.parameters()}.values()
    params = [p for p in unique if table is None or p is not table.table]
    shard, pulled = _table_parts(cfg, world_size)
    weights = _nbytes(params) + _nbytes(model.buffers()) + shard
    grads = _nbytes(params)
    accumulation = max(1, t.global_batch_tokens // (world_size * t.micro_batch_tokens))
    ddp = world_size > 1 and cfg.optim.name not in TABLE_OPTIMIZERS  # DDP's buckets hold the gradients always
    state, step_temporaries = _optimizer_bytes(cfg, model, world_size)
    per_token, per_logit = _activation_bytes(cfg, compiled)
    activations = per_token * t.micro_batch_tokens + pulled
    a_bf16 = f.embed_dtype == "bf16" or f.bf16_model or t.dtype == "bf16"
    if not compiled and a_bf16:  # eager saves the bf16 copy of every fp32 block weight it multiplied
        matrices = [p for _, p, lab in labelled(model) if lab.name in MATMULS and p.dtype == torch.float32]
        activations += sum(p.numel() * 2 for p in matrices)
    vocab = cfg.model.vocab_size if f.logits_vocab_only else padded_vocab(cfg.model)
    logits = per_logit * t.micro_batch_tokens * vocab
    return MemoryEstimate(
        weights=weights,
        gradients=grads if accumulation > 1 or ddp else 0,
        optimizer=state,
        activations=activations,
        logits=logits,
        optimizer_step=weights + grads + state + step_temporaries,
        validation=weights + (grads if ddp else 0) + state + _validation_bytes(cfg, compiled),
    )


def _table_parts(cfg: Config, world: int) -> tuple[int, int]:
    """#92's n-gram table per process as the loop trains it (optim/table_rows.py): (its rows/world rows with
    their RowAdam state, config/gpt2026/ngram.py `row_bytes`; the pulled rows: one forward's compact leaf
    and its gradient, at most two distinct rows per token of a micro-batch, and the pushed gradients kept
    until the table's update: every micro-batch of a cycle of up to 4 steps)."""
    p = getattr(cfg.model, "ngram", None)
    if p is None or not p.rows:
        return 0, 0
    o, t = cfg.optim, cfg.train
    shard = p.rows // world * ngram.row_bytes(p, cfg.model.n_embd)
    width = (p.dim or cfg.model.n_embd) * (2 if p.dtype == "bf16" else 4)
    one_forward = min(2 * t.micro_batch_tokens, p.rows) * width
    accumulation = max(1, t.global_batch_tokens // (world * t.micro_batch_tokens))
    cycle = o.adam_every if o.name in TABLE_OPTIMIZERS else 1
    cycle = 4 if o.name == "anvil" and o.value_embed_every4_from else cycle
    return shard, one_forward * (2 + cycle * accumulation)


def _table_bytes(cfg: Config, world: int) -> int:
    """#92's n-gram table's share of the estimate per process (`_table_parts`)."""
    return sum(_table_parts(cfg, world))


def estimate_peak_bytes(cfg: Config, world_size: int, compiled: bool) -> int:
    """Estimated peak bytes per process of a training step (see `estimate_memory`)."""
    return estimate_memory(cfg, world_size, compiled).total


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device: the one place the guard reads the device."""
    return torch.cuda.mem_get_info(device)


def cuda_margin(cfg: Config, compiled: bool) -> float:
    """The factor over the estimate the guard asks for: the family's compiled margin (gpt2024: its H100
    peaks were 1.09-1.16x the model, so 1.2; gpt2026: the model is read from the compiled partition and
    sits above it), 1.0 eager (within 6 % of fake-tensor measurements)."""
    return family_of(cfg.model).compiled_saves.cuda_margin if compiled else 1.0


def guarded_bytes(cfg: Config, world: int, compiled: bool) -> int:
    """The bytes the guard requires free: the estimate with the measured margin of its kind."""
    return int(estimate_peak_bytes(cfg, world, compiled) * cuda_margin(cfg, compiled))


def _smaller_batches(cfg: Config, world: int):
    """(overrides, config) with smaller forwards, largest first: fewer rows of `seq_len` that still
    divide the batch of a process, then shorter validation rows, then (one row) shorter rows."""
    t = cfg.train
    per_process = t.global_batch_tokens // world
    for rows in range(t.micro_batch_tokens // t.seq_len - 1, 0, -1):
        micro = rows * t.seq_len
        if per_process % micro == 0:
            yield f"train.micro_batch_tokens={micro}", _with(cfg, micro_batch_tokens=micro)
    val = t.val_seq_len // 2
    while val >= t.seq_len and t.val_tokens % (world * val) == 0:
        yield f"train.val_seq_len={val}", _with(cfg, val_seq_len=val)
        val //= 2
    seq = t.seq_len // 2
    while seq >= 128 and per_process % seq == 0:
        overrides = f"train.seq_len={seq} train.micro_batch_tokens={seq}"
        yield overrides, _with(cfg, seq_len=seq, micro_batch_tokens=seq)
        seq //= 2


def _with(cfg: Config, **train) -> Config:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))


def check_fits(cfg: Config, world_size: int, compiled: bool, device: torch.device) -> int:
    """Before step 0 on CUDA: refuse, in one line naming the setting that fits, a step whose estimated
    peak exceeds the device's free memory. Returns the estimate (for the log)."""
    free, total = device_memory(device)
    estimate = estimate_peak_bytes(cfg, world_size, compiled)
    need = guarded_bytes(cfg, world_size, compiled)
    if need <= free:
        return estimate
    where = f"{estimate / GiB:,.1f} GiB per process"
    if need != estimate:
        where += f" (x{cuda_margin(cfg, compiled)} measured margin: {need / GiB:,.1f} GiB)"
    where += f"; {device} has {free / GiB:,.1f} of {total / GiB:,.1f} GiB free"
    table = _table_bytes(cfg, world_size)
    if table and need - table * cuda_margin(cfg, compiled) <= free:  # the table is what does not fit
        raise _refusal(_table_refusal(cfg, world_size, free, need, table, cuda_margin(cfg, compiled)))
    if not compiled and guarded_bytes(cfg, world_size, True) <= free:
        raise _refusal(f"estimated peak memory {where}: run with train.compile=on (eager saves more)")
    for setting, smaller in _smaller_batches(cfg, world_size):
        if guarded_bytes(smaller, world_size, compiled) <= free:
            raise _refusal(f"estimated peak memory {where}: run with {setting}")
    raise _refusal(f"estimated peak memory {where}, and no smaller micro-batch fits")


def _table_refusal(cfg: Config, world: int, free: int, need: int, table: int, margin: float) -> str:
    """One line: the n-gram table per process, and the rows that fit beside the rest (the pulled rows do not
    grow with the table; its rows split over the processes)."""
    p = cfg.model.ngram
    shard, _ = _table_parts(cfg, world)
    per_row = ngram.row_bytes(p, cfg.model.n_embd) * margin / world
    fit = max(0, int((free - (need - shard * margin)) // per_row) // (2 * world) * (2 * world))
    on = f"{world} process" + ("es" if world > 1 else "")
    return (
        f"model.ngram.rows={p.rows:,}: the n-gram table needs {shard * margin / GiB:,.2f} GiB on each of "
        f"{on} (its {p.rows // world:,} rows there with their Adam state), the step {need / GiB:,.1f} GiB "
        f"in all; {free / GiB:,.1f} GiB free: model.ngram.rows={fit:,} fits"
    )


def _refusal(message: str) -> SpeedrunError:
    error = SpeedrunError(message)
    error.rank_specific = True  # each rank reads its own GPU: the one that is full must say so
    return error
