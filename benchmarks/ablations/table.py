"""The Track 1 table of docs/ablations.md from `speedrun ablate` output folders.

Each folder holds one ablate call's runs (`<arm>-seed<S>-<hash>`); every arm is compared with the
baseline of its own folder, seed by seed. Δ is (technique off) − (technique on) in final val bpb:
positive means switching the technique off hurts (the technique helps at this size).

Equal steps: the runs as trained. Equal time: a first-order estimate, Δ_time = Δ_steps − s·ln(r), where
s = d bpb / d ln(steps) is measured by the arm `train.steps=N` (the baseline trained longer) and r is the
arm's step time over the baseline's from a `speedrun race` folder given here whose B arm switches the same
first key (the geometric mean of its paired step-time ratios after warm-up). Without a race, the column
"runs' step time" shows the ablate runs' own ratio (each run's fastest log interval, seed by seed): those
runs were made one after another on a shared machine, so it measures the load as much as the switch, and
no equal-time value is derived from it.

Usage: python benchmarks/ablations/table.py runs/abl-single runs/abl-multi runs/race-mtp
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

from scipy import stats

RUN = re.compile(r"^(?P<arm>.*)-seed(?P<seed>\d+)-[0-9a-f]{10}$")
#: the technique an arm switches off, by the first key of its switch
NAMES = {
    "model.backout_layer": "backout (#40)",
    "model.mimetic_vo_beta": "mimetic V/O init (#64)",
    "model.xsa_layers": "gated XSA (#82)",
    "model.paired_layers": "paired-head attention (#58)",
    "model.bigram_rows": "bigram hash embedding and its sign rows (#62, #83)",
    "model.value_embeds": "value embeddings, their gates and init (#63, #55, #70)",
    "model.smear": "smear gate (#34)",
    "model.mtp": "multi-token prediction (#53)",
}
#: the same switches by their part keys (config.gpt2026: `model.attn.xsa_layers`, ...)
NAMES |= {
    "model.stream.backout_layer": NAMES["model.backout_layer"],
    "model.init.mimetic_vo_beta": NAMES["model.mimetic_vo_beta"],
    "model.attn.xsa_layers": NAMES["model.xsa_layers"],
    "model.attn.paired_layers": NAMES["model.paired_layers"],
    "model.embed.bigram_rows": NAMES["model.bigram_rows"],
    "model.embed.smear": NAMES["model.smear"],
    "model.head.mtp": NAMES["model.mtp"],
}


def read(folder: Path) -> dict[str, dict[int, dict]]:
    """arm → seed → summary.json of each finished run in one ablate folder."""
    arms: dict[str, dict[int, dict]] = {}
    for run in sorted(folder.iterdir()):
        m, summary = RUN.match(run.name), run / "summary.json"
        if m and summary.is_file():
            s = json.loads(summary.read_text())
            if s.get("status") == "finished":
                s["fastest_step_s"] = fastest_step_s(run)
                arms.setdefault(m["arm"], {})[int(m["seed"])] = s
    return arms


def fastest_step_s(run: Path) -> float:
    """The fastest log interval's mean step time after the timing warm-up: on a shared host the load
    only ever slows a step down, so the fastest interval is the least disturbed estimate of a step."""
    warmup = json.loads((run / "config.json").read_text())["train"]["timing_warmup_steps"]
    lines = (run / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if "step_ms" in r and r["step"] > warmup]
    return min(r["step_ms"] for r in rows) / 1000


def step_s(s: dict) -> float:
    return s["fastest_step_s"]


def compare(base: dict[int, dict], arm: dict[int, dict]) -> dict:
    """Δ bpb (mean of the arm's runs minus the baseline's), Welch's and the paired (by seed) t-test p,
    and the geometric mean of the per-seed step-time ratios."""
    seeds = sorted(set(base) & set(arm))
    a = [arm[k]["final_val_bpb"] for k in seeds]
    b = [base[k]["final_val_bpb"] for k in seeds]
    diffs = [x - y for x, y in zip(a, b, strict=True)]
    ratios = [step_s(arm[k]) / step_s(base[k]) for k in seeds]
    return {
        "n": len(seeds),
        "delta": sum(diffs) / len(diffs),
        "sd": stats.tstd(diffs) if len(diffs) > 1 else float("nan"),
        "welch_p": stats.ttest_ind(a, b, equal_var=False).pvalue if len(seeds) > 1 else float("nan"),
        "paired_p": stats.ttest_rel(a, b).pvalue if len(seeds) > 1 else float("nan"),
        "ratio": math.exp(sum(map(math.log, ratios)) / len(ratios)),
        "bpb": sum(a) / len(a),
    }


def race_ratio(folder: Path) -> tuple[str, float, int]:
    """(first key of B's switches, geometric mean of B/A steady step time over the pairs, pairs)."""
    from speedrun.tools.race import steady_step_s

    plan = json.loads((folder / "race.json").read_text())
    logs = []
    for pair in range(1, plan["pairs"] + 1):
        a, b = (folder / f"{arm}-pair{pair}" for arm in "AB")
        warmup = json.loads((a / "config.json").read_text())["train"]["timing_warmup_steps"]
        logs.append(math.log(steady_step_s(b, warmup) / steady_step_s(a, warmup)))
    return plan["switches"][0].partition("=")[0], math.exp(sum(logs) / len(logs)), len(logs)


def main(paths: list[Path]) -> None:
    races = {}
    for path in [p for p in paths if (p / "race.json").is_file()]:
        key, ratio, pairs = race_ratio(path)
        races[key] = ratio
        print(f"race {path.name}: {key}... off/on step time {ratio:.4f} (geometric mean of {pairs} pairs)")
    data = {f: read(f) for f in paths if not (f / "race.json").is_file()}
    slope = None
    for arms in data.values():
        for label, runs in arms.items():
            if (m := re.fullmatch(r"train\.steps=(\d+)", label)) and "baseline" in arms:
                c = compare(arms["baseline"], runs)
                base_steps = next(iter(arms["baseline"].values()))["steps"]
                slope = c["delta"] / math.log(int(m[1]) / base_steps)
                print(
                    f"slope: {label} vs baseline ({base_steps} steps): Δ {c['delta']:+.4f} bpb, "
                    f"s = {slope:+.4f} bpb per ln(steps) (n={c['n']}, paired p={c['paired_p']:.3g})"
                )
    print(
        "| switched off | n | val bpb | Δ bpb, equal steps (sd) | p Welch | p paired | runs' step time "
        "off/on | raced step time off/on | Δ bpb, equal time (est.) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for folder, arms in data.items():
        base = arms.get("baseline", {})
        bpb = [s["final_val_bpb"] for s in base.values()]
        print(f"| baseline ({folder.name}) | {len(bpb)} | {sum(bpb) / len(bpb):.4f} | | | | | | |")
        for label, runs in arms.items():
            if label == "baseline":
                continue
            c = compare(base, runs)
            key = label.partition("=")[0]
            raced = races.get(key)
            est = "-" if slope is None or raced is None else f"{c['delta'] - slope * math.log(raced):+.4f}"
            name = NAMES.get(key, f"`{label[:60]}`")
            print(
                f"| {name} | {c['n']} | {c['bpb']:.4f} | {c['delta']:+.4f} ({c['sd']:.4f}) "
                f"| {c['welch_p']:.3g} | {c['paired_p']:.3g} | {c['ratio']:.2f} "
                f"| {'-' if raced is None else f'{raced:.3f}'} | {est} |"
            )
    if len(data) > 1:  # the same baseline seeds trained in two folders: run-to-run nondeterminism
        (fa, a), (fb, b) = list(data.items())[:2]
        seeds = sorted(set(a.get("baseline", {})) & set(b.get("baseline", {})))
        diffs = [a["baseline"][k]["final_val_bpb"] - b["baseline"][k]["final_val_bpb"] for k in seeds]
        print(
            f"baseline repeats ({fa.name} − {fb.name}, seeds {seeds}): "
            + ", ".join(f"{d:+.2e}" for d in diffs)
        )


if __name__ == "__main__":
    main([Path(p) for p in sys.argv[1:]])
