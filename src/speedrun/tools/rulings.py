"""#92's rulings as `speedrun verify` rules (record #92 "ANVIL2", 2026-08-30, PR #360; its README's
Disclosures): at most 40 untimed warm-up steps (the record ran 37 under an assert capping them at 40); a
sampled softmax in the training loss only, validation on the full softmax; validation once, at the end,
is enough (the record's `val_loss_every=0`: validation is untimed either way). Each reads what a run
folder records: the log's warm-up line (train/loop.py), summary.json's `sampled_candidates` and
`val_classes` (train/progress.py), metrics.jsonl's validation records."""

from __future__ import annotations

import re
from types import SimpleNamespace

from speedrun.errors import DataError
from speedrun.model.vocab import padded_vocab
from speedrun.tools.results import _records, read_json
from speedrun.tools.run_facts import Facts
from speedrun.train.run.rundir import SUMMARY_FILE

WARMUP_BUDGET = 40  # #92: "A budget assert caps the total at 40"
WARMUP_LINE = re.compile(r"^warm-up: (\d+) training step")  # train/loop.py's line

Outcome = tuple[str, str]


def rule_warmup_budget(facts: list[Facts]) -> Outcome:
    """Every start's untimed warm-up ran at most 40 training steps (#92)."""
    most = 0
    for f in facts:
        for line in f.warmups:
            found = WARMUP_LINE.match(line)
            if found is None:
                return "unknown", f"{f.name}: a warm-up line without its step count: {line!r}"
            steps = int(found.group(1))
            if steps > WARMUP_BUDGET:
                return "fails", (
                    f"{f.name}: an untimed warm-up of {steps} training steps; the rulings allow at most "
                    f"{WARMUP_BUDGET} (#92)"
                )
            most = max(most, steps)
    return "ok", f"at most {most} untimed warm-up step(s) a start (#92 allows {WARMUP_BUDGET})"


def _summary(f: Facts) -> dict:
    path = f.run.path / SUMMARY_FILE
    return read_json(path) if path.is_file() else {}


def rule_sampled_softmax(facts: list[Facts]) -> Outcome:
    """A sampled softmax only in training, validated on the full softmax (#92): summary.json's candidate
    counts and the classes validation ran over, which must be all the head's rows."""
    sampled = []
    for f in facts:
        s = _summary(f)
        counts, classes = s.get("sampled_candidates"), s.get("val_classes")
        if counts is not None and not (
            isinstance(counts, list) and all(isinstance(p, int) and p > 0 for p in counts)
        ):
            raise DataError(
                f"{f.run.path / SUMMARY_FILE}: sampled_candidates must be a list of counts (edited?)"
            )
        stride = f.run.config.get("model.head.sampled_stride") or 0
        if counts is None and stride:
            return "unknown", f"{f.name}: summary.json does not record its sampled softmax's candidate counts"
        if not counts:
            continue
        vocab, pad = f.run.config.get("model.vocab_size"), f.run.config.get("model.pad_vocab_to")
        if not isinstance(classes, int) or not isinstance(vocab, int) or not isinstance(pad, int):
            return "unknown", f"{f.name}: sampled in training; no record of what validation ran over"
        rows = padded_vocab(SimpleNamespace(vocab_size=vocab, pad_vocab_to=pad))
        if classes < rows:
            return "fails", (
                f"{f.name}: trained on a sampled softmax (P = {', '.join(map(str, counts))}) and validated "
                f"over {classes} of the head's {rows} classes; validation must be the full softmax (#92)"
            )
        sampled.append(f"{f.name} (P = {', '.join(f'{p:,}' for p in counts)})")
    if not sampled:
        return "ok", "the full softmax in training and validation"
    who = "every run" if len(sampled) == len(facts) else ", ".join(sampled)
    return "ok", f"{who} trained on a sampled softmax, validated on the full softmax (#92: allowed)"


def rule_final_validation(facts: list[Facts]) -> Outcome:
    """Every finished run validated at its last step; once, at the end, is enough (#92's cadence)."""
    once = []
    for f in facts:
        if not f.run.finished:
            continue
        steps = _val_steps(f)
        if not steps or steps[-1] != f.run.steps:
            last = f"its last at step {steps[-1]}" if steps else "none"
            return "fails", (
                f"{f.name}: no validation at its last step {f.run.steps} ({last}); the final val loss is "
                "the one scored"
            )
        if len(steps) == 1:
            once.append(f.name)
    if not once:
        return "ok", "every run validated at its last step"
    who = "every run" if len(once) == len(facts) else ", ".join(once)
    return "ok", f"{who} validated once, at the end (#92: allowed; validation is untimed)"


def _val_steps(f: Facts) -> list[int]:
    """The steps of metrics.jsonl's validation records, in order (compare's reader)."""
    records = _records(f.run.path / "metrics.jsonl")
    return [r["step"] for r in records if r.get("val_loss") is not None and isinstance(r.get("step"), int)]
