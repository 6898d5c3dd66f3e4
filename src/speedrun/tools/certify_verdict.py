"""The verdict of `speedrun certify`, in the record rules' words, from the ledger's certify legs alone (so
a test, or a reviewer, recomputes every number from `ledger.jsonl`): rule 2 (mean val below the target,
one-sided p < alpha, every candidate leg counted), rule 4 (faster than the baseline on the same
hardware: the paired time ratio and its CI), the loss difference, the warm-up, sampled softmax, the
validation data, the timing convention, the compile cache, that every leg counts, the step-cut arm's
iso-loss line, and `verify`'s own rules on the candidate's runs. Printed, written to `verdict.json`, and
drafted as a record folder (README table, statistics, every leg's log)."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from speedrun.atomic import write_atomic
from speedrun.tools import compile_cache
from speedrun.tools.certify_stepcut import exchange_rate, iso_loss
from speedrun.tools.stats import below_target_test, mean_sd, paired_ratio, welch_test

MOST_UNTIMED = 40  # the record README: a warm-up of at most 40 untimed steps
DECIDES = ("rule 2", "rule 4", "warm-up", "sampled softmax", "validation data", "timing", "cache", "all legs")


@dataclass
class Line:
    rule: str
    status: str  # PASS | FAIL | YES | NO | UNKNOWN | INFO
    detail: str

    def text(self) -> str:
        return f"{self.rule + ':':<17} {self.status:<7} {self.detail}"

    @property
    def decides(self) -> bool:
        return self.rule in DECIDES or self.rule.startswith("verify ")

    @property
    def good(self) -> bool:
        return self.status in ("PASS", "YES", "INFO")


def _p(p: float | None) -> str:
    return "-" if p is None else f"{p:.3g}"


def numbers(legs: list[dict], target: float) -> dict:
    """Every statistic of the verdict from the certify legs' ledger lines (finished legs only)."""
    done = [e for e in legs if e["outcome"] == "finished" and e["final_val_loss"] is not None]
    arm = {a: [e for e in done if e["arm"] == a] for a in {e["arm"] for e in legs} | {"A", "B"}}
    vals = {a: [e["final_val_loss"] for e in es] for a, es in arm.items()}
    n = {"B": len(vals["B"]), "A": len(vals["A"])}
    out: dict = {"n": n, "mean_val": {a: mean_sd(v)[0] for a, v in vals.items()}}
    out["sd_val"] = {a: mean_sd(v)[1] for a, v in vals.items()}
    out["rule2"] = (
        dict(zip(("t", "p"), below_target_test(vals["B"], target), strict=True)) if n["B"] > 1 else None
    )
    welch = welch_test(vals["B"], vals["A"], "certify")
    out["welch"] = {"t": welch[0], "p": welch[1]} if welch else None
    times = {a: {e["pair"]: e["train_time_s"] for e in es if e["train_time_s"]} for a, es in arm.items()}
    pairs = sorted(set(times["A"]) & set(times["B"]))
    if pairs:
        r = paired_ratio([times["A"][p] for p in pairs], [times["B"][p] for p in pairs], "certify")
        out["ratio"] = asdict(r) | {"pairs": pairs}
    else:
        out["ratio"] = None
    cuts = {a: (mean_sd(list(times[a].values()))[0], out["mean_val"][a]) for a in arm if a.startswith("C")}
    out["step_cut"] = None
    base = (mean_sd(list(times["A"].values()))[0], out["mean_val"]["A"])
    if cuts and None not in base and all(None not in p for p in cuts.values()):
        ex = exchange_rate(base, cuts)
        cand = (mean_sd(list(times["B"].values()))[0], out["mean_val"]["B"])
        out["step_cut"] = {"points": {"A": base, **cuts}, "rate_ms_per_mnat": None}
        if ex is not None:
            out["step_cut"] |= {"rate_ms_per_mnat": ex.rate_ms_per_mnat, "per_cut": dict(ex.per_cut)}
            if None not in cand:
                at, margin, beats = iso_loss(ex, cand)
                out["step_cut"] |= {"iso_time_s": at, "margin_s": margin, "beats": beats, "candidate": cand}
    return out


def _rule_lines(num: dict, target: float, alpha: float) -> list[Line]:
    lines = []
    n, m = num["n"]["B"], num["mean_val"]["B"]
    if num["rule2"] is None:
        lines.append(Line("rule 2", "FAIL", f"the t-test needs >= 2 finished candidate legs, got {n}"))
    else:
        t, p = num["rule2"]["t"], num["rule2"]["p"]
        ok = p < alpha
        lines.append(
            Line(
                "rule 2",
                "PASS" if ok else "FAIL",
                (
                    f"mean val {m:.4f} over all {n} candidate legs (sd {num['sd_val']['B']:.4f}); "
                    f"one-sided t-test of mean < {target}: t={t:.3f}, p={_p(p)} "
                    f"{'<' if ok else 'not <'} {alpha}"
                ),
            )
        )
    r = num["ratio"]
    if r is None:
        lines.append(Line("rule 4", "NO", "no pair with both arms finished"))
    else:
        ci = (
            f"95% CI [{r['low']:.4f}, {r['high']:.4f}]"
            if r["low"] is not None
            else "95% CI - (too few pairs)"
        )
        yes = r["geomean"] < 1 and r["t_p"] is not None and r["t_p"] < alpha
        lines.append(
            Line(
                "rule 4",
                "YES" if yes else "NO",
                (
                    "faster than the baseline on the same hardware? train time candidate/baseline: "
                    f"paired ratio {r['geomean']:.4f}, {ci}, paired t p={_p(r['t_p'])} over {r['n']} "
                    f"pairs; candidate faster in {r['faster']}/{r['n']}"
                ),
            )
        )
    w, d = num["welch"], (m - num["mean_val"]["A"]) if None not in (m, num["mean_val"]["A"]) else None
    found = w is not None and w["p"] < alpha
    lines.append(
        Line(
            "val vs baseline",
            "INFO",
            (
                "-"
                if d is None
                else f"candidate - baseline {d:+.4f} (baseline {num['mean_val']['A']:.4f}, n="
                f"{num['n']['A']}); Welch p={_p(w and w['p'])}: "
                + ("a difference" if found else "no difference")
                + f" at p < {alpha}"
            ),
        )
    )
    return lines


def _step_cut_line(num: dict) -> list[Line]:
    s = num["step_cut"]
    if s is None:
        return []
    if s["rate_ms_per_mnat"] is None:
        return [Line("iso-loss", "INFO", "the step-cut arms' losses equal the baseline's: no exchange rate")]
    cuts = ", ".join(f"{a[1:]} steps {'-' if r is None else f'{r:.1f}'}" for a, r in s["per_cut"].items())
    text = f"exchange rate {s['rate_ms_per_mnat']:.1f} ms per millinat on this machine ({cuts})"
    if "beats" not in s:
        return [Line("iso-loss", "INFO", text)]
    return [
        Line(
            "iso-loss",
            "YES" if s["beats"] else "NO",
            (
                f"{text}; at the candidate's loss {s['candidate'][1]:.4f} the baseline line takes "
                f"{s['iso_time_s']:.3f} s, "
                f"the candidate {s['candidate'][0]:.3f} s: "
                + ("beats" if s["beats"] else "does not beat")
                + " training fewer steps"
            ),
        )
    ]


STATUS = {"ok": "PASS", "fails": "FAIL"}  # verify's words -> the verdict's


def _rulings_lines(every: list) -> list[Line]:
    """#92's warm-up budget and sampled-softmax rulings: their owner's (tools/rulings.py) where this
    install has it, else the same rules read here from what the runs record."""
    try:
        from speedrun.tools import rulings
    except ImportError:
        rulings = None
    if rulings is not None:
        warm, soft = rulings.rule_warmup_budget(every), rulings.rule_sampled_softmax(every)
        return [Line("warm-up", STATUS.get(warm[0], "UNKNOWN"), warm[1]),
                Line("sampled softmax", STATUS.get(soft[0], "UNKNOWN"), soft[1])]  # fmt: skip
    from speedrun.tools.verify import untimed_steps

    most = max((sum(b - a + 1 for a, b, _ in untimed_steps(f.starts or [], f.run.steps or 0)) for f in every),
               default=0)  # fmt: skip
    warm = Line("warm-up", "PASS" if most <= MOST_UNTIMED else "FAIL",
                f"at most {most} untimed step(s) in a leg (the rules allow {MOST_UNTIMED})")  # fmt: skip
    sampled = [f.name for f in every if any("sampled" in k and v for k, v in f.run.config.items())]
    if sampled:
        why = f"{', '.join(sampled)}: a sampled softmax, and no record of a full-softmax validation"
        return [warm, Line("sampled softmax", "UNKNOWN", why)]
    return [
        warm,
        Line(
            "sampled softmax",
            "PASS",
            "no leg trains with a sampled softmax: validation and training use the full softmax",
        ),
    ]


def _run_lines(out: Path, legs: list[dict], rule: dict, allow_mixed: bool) -> list[Line]:
    """The rules read from the certify legs' run folders (verify's readers and rules, reused)."""
    from speedrun.errors import ConfigError
    from speedrun.tools.alike import differences, setting
    from speedrun.tools.results import load_run
    from speedrun.tools.run_facts import read_facts
    from speedrun.tools.verify import evaluation, rule_timing, verify

    done = [e for e in legs if e["outcome"] == "finished"]
    runs = {e["leg"]: load_run(out / e["folder"]) for e in done}
    facts = {f.run.path: f for f in read_facts(list(runs.values()))}
    every = list(facts.values())
    lines = []
    lines += _rulings_lines(every)
    data = differences({str(f.run.path): setting(f.run.path) for f in every}, ("data content", "data"))
    wrote = evaluation(every)
    status, why = ("FAIL", data[0]) if data else ("FAIL", wrote[1]) if wrote else ("PASS", "")
    same = "one data folder content (meta.json fingerprint) in every leg, validation forward only"
    lines.append(Line("validation data", status, why or same))
    timing = rule_timing(every)
    conv = {f.run.config.get("train.timing_warmup_steps") for f in every}
    held = conv <= {rule["timing"]["timing_warmup_steps"]}
    lines.append(
        Line(
            "timing",
            "PASS" if timing[0] == "ok" and held else "FAIL",
            (
                f"{rule['timing']['convention']}; {timing[0]}: {timing[1]}"
                + (
                    ""
                    if held
                    else f"; train.timing_warmup_steps {sorted(conv)} where the pre-registration says "
                    f"{rule['timing']['timing_warmup_steps']}"
                )
            ),
        )
    )
    try:
        kind = compile_cache.refuse_mixed(
            {e["leg"]: e["cache"] for e in legs}, "the certify legs", allow_mixed
        )
        compiles = [e["cache"]["compile_s"] for e in done if e["cache"].get("compile_s")]
        took = f"; compile {min(compiles):.1f}-{max(compiles):.1f} s" if compiles else "; nothing compiled"
        ok = kind in (rule["cache"]["expected"], "uncompiled")  # uncompiled: no leg's time has a cache
        lines.append(
            Line(
                "cache",
                "PASS" if ok else "FAIL",
                (
                    f"every leg {kind} (pre-registered: {rule['cache']['mode']} caches, legs "
                    f"{rule['cache']['expected']}){took}"
                ),
            )
        )
    except ConfigError as e:
        lines.append(Line("cache", "FAIL", str(e)))
    n = rule["N"]
    want = {a: n for a in rule["arms"]}
    got = {a: sum(e["arm"] == a for e in done) for a in want}
    crashed = [f"{e['leg']} ({e['error']})" for e in legs if e["outcome"] == "crashed"]
    outliers = [e["leg"] for e in legs if e["outlier"]]
    short = [a for a in want if got[a] < want[a]]
    lines.append(
        Line(
            "all legs",
            "FAIL" if crashed or short else "PASS",
            (
                f"{n} legs per arm pre-registered; finished "
                + ", ".join(f"{a} {got[a]}" for a in want)
                + (
                    f"; crashed (counted, never dropped): {'; '.join(crashed)}"
                    if crashed
                    else "; none crashed"
                )
                + (f"; flagged outliers (kept): {', '.join(outliers)}" if outliers else "; no outlier")
            ),
        )
    )
    cand = [runs[e["leg"]] for e in done if e["arm"] == "B"]
    base = [runs[e["leg"]] for e in done if e["arm"] == "A"]
    if len(cand) >= 1:
        for v in verify(cand, 1, rule["target"], base or None):
            if v.rule not in ("target", "timing", "finished", "warm-up", "softmax"):  # said above
                lines.append(Line(f"verify {v.rule}", STATUS.get(v.status, "UNKNOWN"), v.detail))
    return lines


def judge(out: Path, legs: list[dict], rule: dict, allow_mixed: bool) -> tuple[list[Line], dict, bool]:
    """(the verdict's lines, its numbers, accepted) for the certify legs' ledger lines."""
    num = numbers(legs, rule["target"])
    lines = [*_rule_lines(num, rule["target"], rule["alpha"]), *_step_cut_line(num)]
    lines += _run_lines(out, legs, rule, allow_mixed)
    return lines, num, all(line.good for line in lines if line.decides)


def write_outputs(
    out: Path, lines: list[Line], num: dict, accepted: bool, entries: list[dict], digest: str
) -> None:
    """verdict.json and the record-folder draft `record/`: README (verdict, table, statistics), the
    pre-registration and ledger, and every leg's log."""
    verdict = {
        "accepted": accepted,
        "preregistration": digest,
        "lines": [asdict(x) for x in lines],
        "numbers": num,
    }
    write_atomic(out / "verdict.json", (json.dumps(verdict, indent=2) + "\n").encode())
    record = out / "record"
    (record / "logs").mkdir(parents=True, exist_ok=True)
    rows = [
        "| leg | arm | seed | outcome | train time (s) | final val | steps | cache | flags |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        if e["kind"] != "leg":
            continue
        flags = ", ".join(k for k in ("crash", "outlier", "recovered") if e.get(k)) or "-"
        time_s = "-" if e["train_time_s"] is None else f"{e['train_time_s']:.3f}"
        val = "-" if e["final_val_loss"] is None else f"{e['final_val_loss']:.4f}"
        rows.append(
            f"| {e['leg']}.{e['attempt']} | {e['arm']} | {e['seed']} | {e['outcome']} | {time_s} | "
            f"{val} | {e['steps']} | {compile_cache.label(e['cache'])} | {flags} |"
        )
        log = out / e["folder"] / "log.txt"
        if log.is_file():
            shutil.copyfile(log, record / "logs" / f"{e['leg']}.{e['attempt']}.txt")
    text = "\n".join(
        [
            "# certify: record draft",
            "",
            f"Verdict: **{'accepted' if accepted else 'not accepted'}** "
            f"(pre-registration sha256 `{digest}`).",
            "",
            "```",
            *(x.text() for x in lines),
            "```",
            "",
            "## Every leg (the ledger)",
            "",
            *rows,
            "",
            "## Statistics",
            "",
            "```json",
            json.dumps(num, indent=2),
            "```",
            "",
        ]
    )
    write_atomic(record / "README.md", text.encode())
    for name in ("PREREGISTRATION.json", "ledger.jsonl"):
        shutil.copyfile(out / name, record / name)
