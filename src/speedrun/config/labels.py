"""The optimizer's label table (issue 25; modded-nanogpt's ``param_table``): which rule trains each
parameter label, with which hyperparameters. Torch-free: the config layer parses, checks and prints
it; ``optim/rules.py`` joins it with the labels the model's parts declare (``model/labels.py``).

Every label has a row. A recipe may state rows in ``[optim.labels]``::

    [optim.labels]
    embed = { rule = "adam", lr = 0.3, betas = [0.8, 0.95], eps = 1e-10 }
    mlp_out = { lr_mul = 2.0 }

A label without a row there keeps the row ``derived_rows`` makes from the flat ``[optim]`` fields, so a
recipe without the table trains as it always did. The keys a stated row leaves out come from the
label's derived row (from the defaults when it changes the rule). The keys per rule are ``RULE_KEYS``:
``adam`` rows carry ``lr``, ``betas``, ``wd`` (the decay itself, multiplier included) and ``eps``;
``normuon`` rows (under ``optim.name = "normuon"``) an LR multiplier on top of ``muon_lr`` and the
bank's shape multiplier, and how the matrix is cut (``split``, ``qk_rows``, ``gate_rows``); ``muon``
rows (under ``optim.name = "muon"``) ``split``.

Adam groups: the labels of one group share its hyperparameters and its LR schedule entry, and a group
is named after the label that owns it (the group names are those of saved optimizer states). A derived
row may join another label's group (the bigram table trains with the value embeddings, #65; under Muon
the value embeddings with the token embedding): it then follows that label's row, stated or derived. A
stated row that sets a hyperparameter gets a group of its own unless it names one with ``group``, whose
hyperparameters it must then repeat or leave out.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, Literal

from speedrun.config.gpt2026 import mudd, ngram
from speedrun.config.types import Beta, PosFloat, coerce, did_you_mean, field_types, from_json
from speedrun.errors import ConfigError

#: The vocabulary: what a model part may declare (model/labels.py); each has a derived row here.
LABELS = (
    "qkv",  # attention Q/K/V weights
    "attn_out",  # the attention's output projection
    "mlp_in",  # the MLP's up-projection
    "mlp_out",  # the MLP's down-projection
    "matrix",  # any other hidden matrix
    "embed",  # token and position embeddings; a tied embedding/head weight
    "value_embed",  # value embeddings (2024-12)
    "head",  # an untied output head
    "scalar",  # norm gains, LayerNorm biases, lambdas, skip weights
    "bias",  # a linear layer's bias (GPT-2, track 3)
    "attn_out_bias",  # the attention output projection's bias (track 3 #46: its own beta2)
    "x0",  # #52: the x0 shortcut's lambdas, apart from the other scalars
    "gate",  # #28's attention gate, #55's value-embedding gate
    "smear_gate",  # #34's smear gate
    "skip_gate",  # #55's skip gate
    "bigram",  # #62's bigram hash embedding
    "resid_lambda",  # #77's per-sublayer residual weights
    "lambda",  # #77's post weights and x0/bigram shares, #82's XSA α (in #77's residual form)
    "mudd",  # #81's MUDD coefficient MLPs
    "mudd_bias",  # their output biases (no weight decay)
    "mudd_gate",  # #85's gate MLPs
    "mudd_gate_bias",  # their output biases and scale (no weight decay)
    "embed2",  # the medium record's second token embedding (2025-12-31)
    "ngram",  # #92's hashed n-gram table
)
#: Labels of the matrices Muon and NorMuon orthogonalize (the gates only without their own Adam LR).
MATRIX_LABELS = ("qkv", "attn_out", "mlp_in", "mlp_out", "matrix", "gate", "smear_gate")
#: Labels Muon and AdamW train with the scalars (the NorMuon table gives them rows of their own).
SCALAR_LIKE = (
    "scalar",
    "bias",
    "attn_out_bias",
    "x0",
    "skip_gate",
    "resid_lambda",
    "lambda",
    "mudd",
    "mudd_bias",
    "mudd_gate",
    "mudd_gate_bias",
)
HYPER = ("lr", "betas", "wd", "eps")  # an Adam group's hyperparameters
#: The optimizers that train from the table (optim/sharded.py: NorMuon; optim/anvil.py: #92's ANVIL). Their
#: matrix rows have rule normuon: the table's orthogonalized rule, whose update the optimizer chooses
TABLE_OPTIMIZERS = ("normuon", "anvil")
RULE_KEYS = {
    "adam": ("rule", "group", *HYPER),
    "muon": ("rule", "split"),
    "normuon": ("rule", "split", "lr_mul", "gate_rows", "qk_rows"),
}


@dataclass(frozen=True)
class LabelRow:
    """How every parameter with one label is trained (one row of the table)."""

    # "muon" | "normuon" (orthogonalized) | "adam"; under optim.name=adamw only the group counts
    rule: Literal["adam", "muon", "normuon"]
    group: str  # "matrix", or the Adam group (named after the label that owns it) whose schedule it shares
    lr: float = 0.0  # adam: the group's peak LR
    betas: tuple[Beta, Beta] = (0.0, 0.0)  # adam
    wd: float = 0.0  # adam: decoupled (muon) or cautious (normuon) weight decay, multiplier included
    eps: PosFloat = 0.0  # adam (a stated eps must be > 0)
    lr_mul: float = 1.0  # normuon: LR multiplier on top of muon_lr and the bank's shape multiplier
    split: bool = True  # orthogonalize the label's declared blocks apart (false: the 2024-10-04 seed)
    gate_rows: bool = False  # normuon: one second-moment statistic per row (#48's attention gates)
    qk_rows: int = 0  # normuon: a qkv's Q and K cut into blocks of this many rows (#80: a head pair)


#: A stated row's keys and their types (those of the row's fields)
KEY_TYPES: dict[str, Any] = field_types(LabelRow)


def parse_rows(key: str, value: Any) -> dict[str, dict[str, Any]]:
    """``[optim.labels]`` (a TOML table, or JSON text from the command line) as {label: {key: value}},
    every label, key and value checked; the rows stay as stated (``label_table`` resolves them)."""
    value = from_json(key, value, "a table (write it as JSON)")
    if not isinstance(value, dict):
        raise ConfigError(
            f'{key}: expected a table of label rows, e.g. embed = {{ rule = "adam" }}, got {value!r}'
        )
    out: dict[str, dict[str, Any]] = {}
    for label, row in value.items():
        row = from_json(f"{key}.{label}", row, "a table (write it as JSON)")
        if label not in LABELS:
            raise ConfigError(
                f"{key}: unknown label {label!r}{did_you_mean(label, LABELS)} (labels: {', '.join(LABELS)})"
            )
        if not isinstance(row, dict):
            raise ConfigError(
                f'{key}.{label}: expected a table like {{ rule = "adam", lr = 0.3 }}, got {row!r}'
            )
        out[label] = {}
        for k, v in row.items():
            if k not in KEY_TYPES:
                hint = did_you_mean(k, KEY_TYPES)
                raise ConfigError(f"{key}.{label}: unknown key {k!r}{hint} (keys: {', '.join(KEY_TYPES)})")
            out[label][k] = coerce(f"{key}.{label}.{k}", v, KEY_TYPES[k])
        group = out[label].get("group")
        if group is not None and group not in LABELS:
            raise ConfigError(
                f"{key}.{label}.group: {group!r} is not a label (an Adam group is named after its owner)"
            )
    return out


def derived_rows(o: Any, head_dim: int) -> dict[str, LabelRow]:
    """Each label's row from the flat fields of ``o`` (an OptimConfig); ``head_dim`` sizes #80's
    per-head-pair Q/K blocks.

    Muon (and AdamW, where only the groups count): the matrices in Muon; embeddings, value embeddings
    and the bigram table in the embedding's group, x0 lambdas and skip gate with the scalars, the head
    alone; one Adam's betas, eps and decay. NorMuon (the 2025–26 table): the MLP and attention matrices
    with their LR multipliers; the gates in Adam at their own LR where the recipe gives one (#52 smear
    gate, #56 attention/value-embedding gates), else in NorMuon (#48: one statistic per head); x0 (#52),
    the skip gate (#55) and each embedding in Adam groups of their own, the bigram table (#62) with the
    value embeddings, the sublayer lambdas and XSA gates (#74–#82) at the scalars' settings in groups of
    their own; the smear and skip gates without decay, the attention gates with it."""

    def adam(group: str, lr: float, betas: Any = o.betas, wd: float = o.adam_weight_decay) -> LabelRow:
        return LabelRow("adam", group, lr, tuple(betas), wd, o.eps)

    if o.name not in TABLE_OPTIMIZERS:  # (Muon's one Adam: optim.betas and adam_weight_decay)
        rows = dict.fromkeys(MATRIX_LABELS, LabelRow("muon", "matrix", split=o.muon_split_qkv))
        rows |= dict.fromkeys(("embed", "value_embed", "bigram", "embed2"), adam("embed", o.embed_lr))
        rows |= dict.fromkeys(SCALAR_LIKE, adam("scalar", o.scalar_lr))
        rows |= ngram.label_rows(adam, o.embed_lr, o.adam_weight_decay)
        return {label: (rows | {"head": adam("head", o.head_lr)})[label] for label in LABELS}

    def normuon(lr_mul: float = 1.0, **cut: Any) -> LabelRow:  # cut: gate_rows, qk_rows
        return LabelRow("normuon", "matrix", lr_mul=lr_mul, split=o.muon_split_qkv, **cut)

    wd, gate_betas = o.adam_weight_decay, o.scalar_betas if o.gate_betas == "scalar" else o.embed_betas
    value_embed = adam(
        "value_embed", o.value_embed_lr or o.embed_lr, o.value_embed_betas, wd * o.value_embed_wd_mul
    )
    rows = {
        "qkv": normuon(o.attn_lr_mul, qk_rows=o.muon_qk_block_heads * head_dim),
        "attn_out": normuon(o.attn_lr_mul),
        "mlp_in": normuon(o.mlp_fc_lr_mul),
        "mlp_out": normuon(o.mlp_proj_lr_mul),
        "matrix": normuon(),
        "embed": adam("embed", o.embed_lr, o.embed_betas, wd * o.embed_wd_mul),
        "value_embed": value_embed,
        "head": adam("head", o.head_lr, o.embed_betas, wd * o.embed_wd_mul),
        "scalar": adam("scalar", o.scalar_lr, o.scalar_betas, 0.0),
        # a linear's bias (gpt2024 models under NorMuon): the scalars' settings in groups of their own
        "bias": adam("bias", o.scalar_lr, o.scalar_betas, 0.0),
        "attn_out_bias": adam("attn_out_bias", o.scalar_lr, o.scalar_betas, 0.0),
        "x0": adam("x0", o.x0_lr or o.scalar_lr, o.x0_betas, 0.0),
        "gate": adam("gate", o.gate_lr, gate_betas, wd)
        if o.gate_lr > 0
        else normuon(o.gate_lr_mul, gate_rows=o.normuon_gate_row_stats),
        "smear_gate": adam("smear_gate", o.smear_gate_lr, gate_betas, 0.0)
        if o.smear_gate_lr > 0
        else normuon(),
        "skip_gate": adam("skip_gate", o.skip_gate_lr, gate_betas, 0.0),
        "bigram": value_embed,
        "embed2": value_embed,  # the medium record: lr x75, wd x5, as the value embeddings
        # #77's rows (resid_lambdas: the scalars' LR; post, x0, bigram lambdas, #82's xsa_alphas: embed_lr)
        "resid_lambda": adam("resid_lambda", o.scalar_lr, (0.9, 0.95), 0.0),
        "lambda": adam("lambda", o.embed_lr, (0.9, 0.95), 0.0),
    }
    rows |= mudd.label_rows(adam, o.embed_lr, wd) | ngram.label_rows(adam, o.embed_lr, wd)  # parts' rows
    return {label: rows[label] for label in LABELS}


def label_table(o: Any, head_dim: int) -> dict[str, LabelRow]:
    """Every label's row: the stated rows of ``o.labels`` over the derived ones. Raises ConfigError
    (one line naming the label and key) for a row the optimizer cannot train."""
    derived = derived_rows(o, head_dim)
    if o.labels and o.name == "adamw":
        raise ConfigError(
            "optim.labels: optim.name = adamw trains every parameter alike (use muon or normuon)"
        )
    rows = {
        lab: _stated_row(lab, o.labels[lab], derived[lab], o) if lab in o.labels else derived[lab]
        for lab in LABELS
    }
    table = {lab: row for lab, row in rows.items() if row.rule != "adam" or row.group == lab}
    for label, row in rows.items():  # Adam rows in a group another label owns follow its row
        if label in table:
            continue
        group, owner = row.group, table.get(row.group)
        if owner is None or owner.rule != "adam":
            how = f"trains by {owner.rule}" if owner else f"is in group {rows[group].group}"
            raise ConfigError(
                f"optim.labels.{label}: its Adam group {group} is no group ({group} {how}); "
                f"give {label} a row with its own lr and betas"
            )
        for k in HYPER:
            stated = o.labels.get(label, {}).get(k)
            if stated is not None and stated != getattr(owner, k):
                raise ConfigError(
                    f"optim.labels.{label}.{k}: {stated} differs from its Adam group {group}'s "
                    f"{getattr(owner, k)} (a group's labels share its hyperparameters; leave out group "
                    f"to give {label} its own)"
                )
        table[label] = owner
    return {label: table[label] for label in LABELS}


def check_shadowed(o: Any, head_dim: int, fixed: frozenset[str]) -> None:
    """Refuse a flat ``[optim]`` field the user set (``fixed``) that a stated row shadows: it feeds a
    label's derived row but not that label's row in the table. Any one shadowed label refuses it, whether
    or not the model has that label's parameters (the field would act on some parameters and not on
    others the user meant). Each field is changed once and both tables compared, so derived_rows stays
    the one owner of which field feeds which row."""
    if not o.labels:
        return
    derived, table = derived_rows(o, head_dim), label_table(o, head_dim)
    for key in sorted(fixed):
        section, _, name = key.partition(".")
        if section != "optim" or name.split(".")[0] == "labels" or "." in name:  # a part table feeds no row
            continue
        other = dataclasses.replace(o, **{name: _another(o, name)})
        fed = [lab for lab, row in derived_rows(other, head_dim).items() if row != derived[lab]]
        try:
            moved = label_table(other, head_dim)
        except ConfigError:
            continue  # it makes a stated row invalid: it does something
        shadowed = [lab for lab in fed if moved[lab] == table[lab]]
        if shadowed:
            raise ConfigError(
                f"{key} does not reach the rows optim.labels states ({', '.join(shadowed)}); set the key "
                f"there, or take a row back with optim.labels.{shadowed[0]}={{}}"
            )


def _another(o: Any, name: str) -> Any:
    """A value of field ``name`` of ``o`` other than its own (every derived row reading it changes)."""
    value = getattr(o, name)
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, tuple):
        return tuple(v + 1 for v in value)
    choices = typing.get_args(typing.get_type_hints(type(o))[name])
    return next((c for c in choices if c != value), value)


def _stated_row(label: str, keys: dict[str, Any], base: LabelRow, o: Any) -> LabelRow:
    """A stated row over its derived row ``base``; a rule change starts from that rule's defaults."""
    rule = keys.get("rule", base.rule)
    matrix_rule = "normuon" if o.name in TABLE_OPTIMIZERS else "muon"
    if rule not in ("adam", matrix_rule):
        needs = "normuon or anvil" if rule == "normuon" else rule
        raise ConfigError(
            f"optim.labels.{label}.rule: {rule} needs optim.name = {needs} "
            f"(this optimizer runs {matrix_rule})"
        )
    for k in keys:
        if k not in RULE_KEYS[rule]:
            raise ConfigError(
                f"optim.labels.{label}.{k}: a row of rule {rule} takes only {', '.join(RULE_KEYS[rule])}"
            )
    if rule != base.rule and rule == "adam":
        missing = [k for k in ("lr", "betas") if k not in keys]
        if missing:
            raise ConfigError(
                f"optim.labels.{label}: moving it from {base.rule} to adam needs {' and '.join(missing)}"
            )
        base = LabelRow("adam", label, eps=o.eps)
    elif rule != base.rule:
        base = LabelRow(rule, "matrix", split=o.muon_split_qkv)
    if rule == "adam" and "group" not in keys and any(k in keys for k in HYPER):
        keys = {**keys, "group": label}  # its own hyperparameters: a group of its own
    if keys.get("qk_rows") and label != "qkv":
        raise ConfigError(f"optim.labels.{label}.qk_rows: only a qkv has Q and K rows to cut")
    return dataclasses.replace(base, **{k: v for k, v in keys.items() if k != "rule"})


def format_table(o: Any, table: dict[str, LabelRow], params: dict[str, tuple[int, int]] | None = None) -> str:
    """The table as text, one line per label, ``*`` marking a stated row (``params``: label -> (tensors,
    numbers) of the labels the model carries; without it every label). A matrix row's lr is muon_lr
    times its lr_mul (before the bank's shape multiplier), its wd muon_weight_decay."""
    if o.name == "adamw":
        return "optimizer labels: none (optim.name = adamw trains every parameter alike)"
    stated = f" ({len(o.labels)} stated in optim.labels: *)" if o.labels else ""
    count = f"{'params':>13} {'tensors':>7}  " if params is not None else ""
    lines = [
        f"optimizer labels{stated}:",
        f"{'label':<16}{'rule':<9}{'group':<16}{'lr':>8} {'wd':>6}  {'betas':<10}{'eps':>6}  {count}other",
    ]
    for lab in (lab for lab in LABELS if params is None or lab in params):
        r = table[lab]
        if r.rule == "adam":
            lr, wd, betas, eps, other = r.lr, r.wd, f"{r.betas[0]:g}/{r.betas[1]:g}", f"{r.eps:.0e}", ""
        else:
            lr, wd, betas, eps = o.muon_lr * r.lr_mul, o.muon_weight_decay, "", ""
            flags = [f"lr_mul={r.lr_mul:g}"] * (r.lr_mul != 1) + ["split=false"] * (not r.split)
            other = " ".join(flags + ["gate_rows"] * r.gate_rows + [f"qk_rows={r.qk_rows}"] * (r.qk_rows > 0))
        count = f"{params[lab][1]:>13,d} {params[lab][0]:>7d}  " if params is not None else ""
        name = lab + "*" * (lab in o.labels)
        line = f"{name:<16}{r.rule:<9}{r.group:<16}{lr:>8.4g} {wd:>6.4g}  {betas:<10}{eps:>6}  {count}{other}"
        lines.append(line.rstrip())
    return "\n".join(lines)
