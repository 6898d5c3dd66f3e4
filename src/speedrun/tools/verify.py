"""`speedrun verify`: would these runs be accepted as a record? One line per rule, and why not.

Everything is read from the run folders, so copied runs verify; a fact a folder does not record says
`unknown`, never a pass. The rules (modded-nanogpt README, docs/roadmap.md): the track's target test,
one config and code version, validation on the first 10,485,760 FineWeb val tokens, every step timed
(only a restoring warm-up untimed), the default inductor config, one hardware, a baseline re-run on it.
The 2026 rulings: eval-side masking allowed (#350), a backward pass at evaluation refused (#205), steps
added beyond the schedule timed (#344); #92's (tools/rulings.py): at most 40 untimed warm-up steps, a sampled
softmax in training only, one validation at the end enough."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

from speedrun.config.files import flatten
from speedrun.errors import ConfigError
from speedrun.tools.alike import verify_alike
from speedrun.tools.compare import Group, group_key
from speedrun.tools.flops import cost, cost_line
from speedrun.tools.results import Run, check_report, identity, load_runs
from speedrun.tools.rulings import rule_final_validation, rule_sampled_softmax, rule_warmup_budget
from speedrun.tools.run_facts import Facts, Start, read_facts
from speedrun.tools.stats import below_target_test, mean_sd, welch_test
from speedrun.train.run.environment import INDUCTOR_ENV_PREFIX

ALPHA = 0.01  # track 1: the one-sided t-test's p must be below this
TRACK3_MARGIN = 0.004  # track 3: (target - mean) * sqrt(n) must reach this
RECORD_VAL_TOKENS = 10_485_760  # the first 10,485,760 tokens of FineWeb's val split
RECORD_SOURCE, RECORD_TOKENIZER = "fineweb10B", "gpt2"
VALIDATION = f"the first {RECORD_VAL_TOKENS:,} {RECORD_TOKENIZER} tokens of the {RECORD_SOURCE} val split"
# inductor variables that only say where compiled code is cached, not what is compiled
CACHE_ONLY_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE")
RESTORED = "state restored"  # what the loop's warm-up line says (train/loop.py, train/warmup.py)


@dataclass
class Verdict:
    rule: str
    status: str  # "ok" | "fails" | "unknown"
    detail: str

    def line(self) -> str:
        return f"{self.rule:<10} {self.status}: {self.detail}"


# ---- the rules: each returns (status, why) for the runs' facts; `verify` names them ----
Outcome = tuple[str, str]  # ("ok" | "fails" | "unknown", the reason)


def rule_finished(facts: list[Facts]) -> Outcome:
    why = {"stopped": "stopped", "unfinished": "no summary.json: killed or still running"}
    bad = [f"{f.name} ({why.get(f.run.status, f.run.status)})" for f in facts if not f.run.finished]
    return ("fails", "not finished: " + ", ".join(bad)) if bad else ("ok", f"all {len(facts)} runs finished")


def rule_target(facts: list[Facts], track: int, target: float) -> Outcome:
    """Track 1: compare's one-sided t-test that the mean final val loss is below the target, p < 0.01.
    Track 3: (target - mean)·√n >= 0.004. Only finished runs count (compare's Group.losses)."""
    losses = Group("", [f.run for f in facts]).losses
    (mean, sd), n = mean_sd(losses), len(losses)
    if track == 3:
        if not n:
            return "fails", "no finished run with a final val loss"
        score = (target - mean) * math.sqrt(n)
        text = f"({target} - mean {mean:.4f})·√{n} = {score:.4f}"
        return (
            ("ok", f"{text} >= {TRACK3_MARGIN}")
            if score >= TRACK3_MARGIN
            else ("fails", f"{text} < {TRACK3_MARGIN}")
        )
    if n < 2:
        return "fails", f"the t-test needs >= 2 finished runs with a final val loss, got {n}"
    t, p = below_target_test(losses, target)
    text = f"mean {mean:.4f} (n={n}, sd {sd:.4f}); one-sided t-test of mean < {target}: t={t:.3f}, p={p:.3g}"
    return ("ok", f"{text} < {ALPHA}") if p < ALPHA else ("fails", f"{text}, not < {ALPHA}")


#: Track 3 rule 1 fixes data, batch and architecture; init, attention backend and norm precision are free.
TRACK3_BASELINE = "track3-baseline"
TRACK3_FREE = (
    "init zero_init_proj zero_init_head head_init_std mlp_fc_init_ramp cgi_gain_alpha attention sdpa_kernel "
    "norm_fp32"
)
TRACK3_FIXED = "train.global_batch_tokens train.seq_len data.tokenizer data.align_to_bos data.loader".split()


def rule_fixed(facts: list[Facts]) -> Outcome:
    """Track 3, rule 1: every run's model (its init apart), batch and data are `track3-baseline`'s."""
    from speedrun.recipes import load_recipe

    base = flatten(json.loads(json.dumps(load_recipe(TRACK3_BASELINE).to_dict())))
    keys = [k for k in base if k.startswith("model.") and k.split(".", 1)[1] not in TRACK3_FREE.split()]
    for f in facts:
        c = f.run.config
        diff = [k for k in (*keys, *TRACK3_FIXED) if c.get(k) != base[k]]
        if diff:
            shown = ", ".join(
                f"{k}={json.dumps(c.get(k, '-'))} (baseline {json.dumps(base[k])})" for k in diff[:3]
            )
            more = f" and {len(diff) - 3} more" if len(diff) > 3 else ""
            return (
                "fails",
                f"{f.name}: {shown}{more}; track 3 fixes the model, data and batch of the baseline",
            )
    return "ok", f"the model, data and batch of {TRACK3_BASELINE} (its init and optimizer free)"


def rule_config(facts: list[Facts]) -> Outcome:
    """One config apart from the seed and the observing settings (compare's grouping rule), and no
    seed twice (a repeated seed is not an independent run)."""
    first = dict(group_key(facts[0].run))
    for f in facts[1:]:
        key = dict(group_key(f.run))
        if key != first:
            diff = sorted(k for k in first.keys() | key.keys() if first.get(k) != key.get(k))
            shown = ", ".join(
                f"{k}={key.get(k, '-')} where {facts[0].name} has {first.get(k, '-')}" for k in diff[:3]
            )
            more = f" and {len(diff) - 3} more" if len(diff) > 3 else ""
            return "fails", f"{f.name} differs from {facts[0].name}: {shown}{more}"
    seen: dict[object, str] = {}
    for f in facts:
        if f.run.seed in seen:
            return (
                "fails",
                f"{seen[f.run.seed]} and {f.name} both ran train.seed={f.run.seed}: not independent (a "
                "repeat shows only the machine's nondeterminism); give each run its own seed, and measure "
                "repeats of one seed with `speedrun noise`",
            )
        seen[f.run.seed] = f.name
    return "ok", f"equal apart from the seed and observing settings (seeds {', '.join(map(str, seen))})"


def _code(code: tuple[str, str | None]) -> str:
    return code[0] if code[1] is None else f"{code[0]}, diff sha256 {code[1][:12]}"


def rule_code(facts: list[Facts]) -> Outcome:
    """The same code in every run and every start of a run: the log's `code:` line (commit and clean or
    dirty, or the installed version) and, when dirty, the diff text."""
    missing = [
        f"{f.name}: {'no log.txt' if f.codes is None else 'no code: line in log.txt'}"
        for f in facts
        if not f.codes
    ]
    if missing:
        return "unknown", "; ".join(missing)
    for f in facts:
        if len(set(f.codes)) > 1:
            return "fails", f"{f.name} was resumed with other code: " + " / ".join(
                map(_code, dict.fromkeys(f.codes))
            )
    first = facts[0].codes[0]
    for f in facts[1:]:
        if f.codes[0] != first:
            return "fails", f"{facts[0].name}: {_code(first)}; {f.name}: {_code(f.codes[0])}"
    installed = (
        " (the version is all an installed package records)" if "installed package" in first[0] else ""
    )
    return "ok", f"{_code(first)} in all runs{installed}"


def rule_validation(facts: list[Facts]) -> Outcome:
    """The first 10,485,760 GPT-2 tokens of FineWeb's val split: the loader has one val order, so what can
    differ is the token count, the tokenizer and the source (meta.json's, from summary.json's data_source:
    beside `data.dir`, `data.source` is only a label)."""
    unknown = None
    for f in facts:
        c = f.run.config
        missing = [k for k in ("train.val_tokens", "data.source", "data.tokenizer") if k not in c]
        if missing:
            return "unknown", f"{f.name}: config.json lacks {', '.join(missing)}"
        source = f.data_source or (None if c.get("data.dir") else str(c["data.source"]))
        wrong = (
            [f"train.val_tokens={c['train.val_tokens']}"]
            if c["train.val_tokens"] != RECORD_VAL_TOKENS
            else []
        )
        wrong += [f"data source {source}"] if source and not source.startswith(RECORD_SOURCE) else []
        wrong += [f"data.tokenizer={c['data.tokenizer']}"] if c["data.tokenizer"] != RECORD_TOKENIZER else []
        if wrong:
            return "fails", f"{f.name}: {', '.join(wrong)}; the rules validate on {VALIDATION}"
        if source is None:
            unknown = unknown or (
                f"{f.name}: summary.json does not record the data's source, and beside data.dir="
                f"{c['data.dir']} data.source is only a label"
            )
    if unknown:
        return "unknown", unknown
    return evaluation(facts) or ("ok", f"{VALIDATION}, unaligned{masked(facts)}")


def evaluation(facts: list[Facts]) -> Outcome | None:
    """What a validation may compute (the 2026 rulings): the model's forward only. A validation that
    wrote a weight or a gradient (summary.json's eval_writes, counted by the loop) trained outside the
    clock: test-time training, refused (#205). None when every run's validations were forward only."""
    for f in facts:
        if f.eval_writes is None:
            return "unknown", f"{f.name}: summary.json does not record whether validation wrote weights"
        if f.eval_writes:
            return "fails", (
                f"{f.name}: {f.eval_writes} validation(s) wrote weights or gradients: a backward pass at "
                "evaluation is untimed training on the val tokens (refused, #205)"
            )
    return None


def masked(facts: list[Facts]) -> str:
    """The report's note on #350's canonical-token mask: allowed (eval-side masking only changes which
    tokens the model may predict at validation, from the tokenizer alone)."""
    keys = ("model.head.canonical_val_mask", "model.canonical_val_mask")  # a config read raw keeps flat keys
    on = [f.name for f in facts if any(f.run.config.get(k) for k in keys)]
    if not on:
        return ""
    who = "every run" if len(on) == len(facts) else ", ".join(on)
    return f"; {who} masked non-canonical token pairs at validation (eval-side masking: allowed, #350)"


def untimed_steps(starts: list[Start], steps: int) -> list[tuple[int, int, Start]]:
    """(first, last, start) of the steps each start trained outside the clock: a start at step s with
    timing warm-up w leaves steps s+1 .. s+w untimed, up to where the next start (or the run) ends."""
    ends = [s.step for s in starts[1:]] + [steps]
    spans = [(s.step + 1, min(s.step + (s.untimed or 0), e), s) for s, e in zip(starts, ends, strict=True)]
    return [span for span in spans if span[0] <= span[1]]


def rule_timing(facts: list[Facts]) -> Outcome:
    """Every training step timed (record 21 on): no step trains outside the clock except a warm-up that
    puts model, optimizer and loader back, extension steps included (#344: the clock must run to the
    last step, summary.json's timed_through). Validation is never timed (train/loop.py). Judged over
    every start of a run: a run resumed with another timing warm-up is timed as each start was."""
    for f in facts:
        if f.starts is None:
            return "unknown", f"{f.name}: resumed, and summary.json does not record each start (an older run)"
        if any(s.untimed is None for s in f.starts):
            return "unknown", f"{f.name}: the timing warm-up of a start is not recorded"
        steps = f.run.steps or 0
        spans = untimed_steps(f.starts, steps)
        if spans:
            shown = ", ".join(f"steps {a}-{b}" if a < b else f"step {a}" for a, b, _ in spans)
            first = spans[0][2]
            where = "its start" if first.step == 0 else f"its resume at step {first.step}"
            return "fails", (
                f"{f.name} trained {shown} untimed (train.timing_warmup_steps={first.untimed} at {where}); "
                "the rules time every step: set it to 0 (the compiled warm-up restores what it trains)"
            )
        if f.timed_through is not None and f.timed_through < steps and f.run.finished:
            ext = f.extension_steps
            what = f"; the last {ext} are its extension" if ext else ""
            return "fails", (
                f"{f.name}: steps {f.timed_through + 1}-{steps} ran after the clock stopped{what} "
                "(steps beyond the schedule count in the time, #344)"
            )
        if f.timed_steps is not None and f.timed_steps < steps and f.run.finished:
            return "fails", f"{f.name}: only {f.timed_steps} of its {steps} steps were timed"
        kept = [w for w in f.warmups if RESTORED not in w]
        if kept:
            return "fails", f"{f.name}: a warm-up that kept its training: {kept[0]!r}"
    warm = sum(bool(f.warmups) for f in facts)
    return "ok", "every step timed, validation untimed; " + (
        f"{warm} run(s) warmed up untimed, state restored" if warm else "no untimed warm-up"
    )


def rule_inductor(facts: list[Facts]) -> Outcome:
    """Rule 3: the default inductor config. The code never changes it; TORCHINDUCTOR_* variables can,
    and every start of a run records them in log.txt."""
    for f in facts:
        if not f.inductor or None in f.inductor:
            return "unknown", f"{f.name}: log.txt does not record the inductor environment (an older run)"
        for env in f.inductor:
            changed = [v for v in env.split() if v != "none" and v.split("=")[0] not in CACHE_ONLY_ENV]
            if changed:
                return (
                    "fails",
                    f"{f.name} ran with {' '.join(changed)}; the rules allow the default config only",
                )
    return "ok", f"default config in all runs (no {INDUCTOR_ENV_PREFIX}* setting)"


def one_hardware(facts: list[Facts], who: str) -> tuple[str | None, Outcome | None]:
    """(the hardware every start of `facts` ran on, None), or (None, why there is not one)."""
    missing = [f.name for f in facts if f.starts is None or any(s.hardware is None for s in f.starts)]
    if missing:
        return None, ("unknown", f"{who} {', '.join(missing)}: summary.json lacks the hardware of each start")
    for f in facts:
        kinds = list(dict.fromkeys(s.hardware for s in f.starts))
        if len(kinds) > 1:
            at = {s.hardware: s.step for s in reversed(f.starts)}  # each kind with the first step on it
            return None, (
                "fails",
                f"{f.name} was resumed on other hardware: "
                + "; ".join(f"{k} from step {at[k]}" for k in kinds),
            )
    kinds = {f.starts[0].hardware: f.name for f in reversed(facts)}  # each kind with the first run on it
    if len(kinds) > 1:
        return None, (
            "fails",
            f"{who} ran on different hardware: " + "; ".join(f"{n} on {k}" for k, n in kinds.items()),
        )
    return facts[0].starts[0].hardware, None


def rule_hardware(facts: list[Facts]) -> Outcome:
    kind, problem = one_hardware(facts, "runs")
    return problem or ("ok", f"{kind} in all runs")


def rule_baseline(facts: list[Facts], baseline: list[Facts], track: int) -> Outcome:
    """Rule 4: a record is compared with a baseline re-run on the same hardware, never with one timed
    elsewhere. Track 1 compares the mean training time, track 3 the mean step count."""
    (mine, problem), (theirs, problem_b) = one_hardware(facts, "runs"), one_hardware(baseline, "baseline")
    if problem or problem_b:
        return problem or problem_b
    if mine != theirs:
        return (
            "fails",
            f"refused: the baseline ran on {theirs}, these runs on {mine}; re-baseline here (rule 4)",
        )
    attr, what = ("train_time_s", "train time (s)") if track == 1 else ("steps", "steps")
    ours, base = ([getattr(f.run, attr) for f in side if f.run.finished] for side in (facts, baseline))
    ours, base = [x for x in ours if x is not None], [x for x in base if x is not None]
    if not ours or not base:
        return "fails", f"a side without a finished run with its {what}"
    (a, _), (b, _), test = mean_sd(ours), mean_sd(base), welch_test(ours, base, "verify")
    text = f"mean {what} {a:.4g} vs baseline {b:.4g} ({a - b:+.4g}; n={len(ours)} vs {len(base)}" + (
        f", Welch p={test[1]:.3g})" if test else ")"
    )
    return ("ok", text) if a < b else ("fails", f"not below the baseline: {text}")


def verify(runs: list[Run], track: int, target: float, baseline: list[Run] | None = None) -> list[Verdict]:
    """The verdict of every rule of `track` on `runs` (and on `baseline`, when given)."""
    facts = read_facts(runs)
    verdicts = [
        Verdict("finished", *rule_finished(facts)),
        Verdict("target", *rule_target(facts, track, target)),
        Verdict("config", *rule_config(facts)),
        Verdict("code", *rule_code(facts)),
        Verdict("validation", *rule_validation(facts)),
    ]
    verdicts.append(Verdict("final-val", *rule_final_validation(facts)))  # #92: once at the end suffices
    verdicts.append(Verdict("softmax", *rule_sampled_softmax(facts)))  # #92: sampled in training only
    if track == 1:  # track 3 scores steps, not time
        verdicts += [Verdict("timing", *rule_timing(facts)), Verdict("inductor", *rule_inductor(facts))]
        verdicts.append(Verdict("warm-up", *rule_warmup_budget(facts)))  # #92: at most 40 untimed steps
    else:
        verdicts.append(Verdict("fixed", *rule_fixed(facts)))
    verdicts.append(Verdict("hardware", *rule_hardware(facts)))
    verdicts.append(Verdict("alike", *verify_alike([f.run.path for f in facts], baseline or [])))
    if baseline:
        verdicts.append(Verdict("baseline", *rule_baseline(facts, read_facts(baseline), track)))
    return verdicts


def cmd_verify(args: argparse.Namespace) -> int:
    from speedrun.atomic import write_atomic

    if not math.isfinite(args.target):
        raise ConfigError(f"--target must be a finite val loss, got {args.target}")
    if args.json is not None:
        check_report(args.json, "--json")
    runs = load_runs(args.runs)
    baseline = load_runs(args.baseline) if args.baseline else None
    mine = {identity(r): r for r in runs}  # a copy of a run is that run (load_runs)
    shared = [(r, mine[k]) for r in baseline or [] if (k := identity(r)) in mine]
    if shared:
        (base, run), copy = shared[0], shared[0][0].path.resolve() != shared[0][1].path.resolve()
        also = f" (a copy of {run.path}: the same run {'id' if run.run_id else 'marks'})" if copy else ""
        raise ConfigError(f"--baseline {base.path} is also one of the runs to verify{also}")
    verdicts = verify(runs, args.track, args.target, baseline)
    print(f"verify {len(runs)} run(s), track {args.track}, target {args.target}:")
    for v in verdicts:
        print(v.line())
    spent = cost(runs, args.target)  # not a rule: what the runs cost, comparable across hardware
    print(cost_line(spent, args.target))
    bad = [v for v in verdicts if v.status != "ok"]
    failed, unknown = sum(v.status == "fails" for v in bad), sum(v.status == "unknown" for v in bad)
    print(
        "accepted: every rule passes"
        if not bad
        else f"not accepted: {failed} rule(s) fail, {unknown} unknown"
    )
    if args.json is not None:
        report = {
            "track": args.track,
            "target": args.target,
            "runs": [str(r.path) for r in runs],
            "baseline": [str(r.path) for r in baseline or []],
            "rules": [{"rule": v.rule, "status": v.status, "detail": v.detail} for v in verdicts],
            "accepted": not bad,
            "cost": spent,
        }
        write_atomic(args.json, (json.dumps(report, indent=2) + "\n").encode())
    return 0 if not bad else 1
