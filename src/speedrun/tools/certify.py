"""`speedrun certify --recipe R --baseline B [SWITCH=VALUE ...]`: a record attempt from one command,
pre-registered, resumable, judged by the record rules.

Phases: preflight (`speedrun doctor`'s checks where that module exists, else the host's torch, threads
and inductor settings); smoke (one short leg of each arm, the rules checked on its run folders; a crash
ends the certify); pilot (k legs of each arm estimate the loss noise and the time ratio, and from them the
legs rule 2 and rule 4 need at p < alpha with 80% power); certify (N pairs in race's ABBA blocks, with
the step-cut arms beside them; every leg counts, a crashed one is recorded, never dropped). Before the
first certify leg the rule is pre-registered (certify_ledger.py); the verdict is certify_verdict.py's.
`--resume DIR` continues where a kill left off, under the same plan, code and cache handling."""

from __future__ import annotations

import argparse
import functools
import importlib
import math
import os
import shutil
from pathlib import Path

from speedrun.errors import ConfigError, SpeedrunError
from speedrun.tools import compile_cache
from speedrun.tools.certify_ledger import (
    PREREG_FILE,
    Ledger,
    check_plan,
    code_hash,
    now,
    register,
    registered_rule,
    sha256_bytes,
)
from speedrun.tools.certify_phases import PILOT_SEED, SMOKE_SEED, Leg, Runner, arm_label, schedule

DEFAULTS = {"target": 3.28, "alpha": 0.01, "pilot": 2, "max_legs": 20, "cache": "cold", "order_seed": 0}
POWER = 0.8
say = functools.partial(print, flush=True)  # a reader of a piped stdout sees each leg as it starts


def plan_of(args: argparse.Namespace) -> dict:
    """The plan the arguments give (None where an argument was not given: a --resume keeps the saved)."""
    unseeded = True if args.unseeded else None
    plan = {
        "recipe": args.recipe,
        "baseline": args.baseline,
        "switches": args.switches or None,
        "set": args.set or None,
        "cache": args.cache,
        "seeded": None if unseeded is None else False,
        "smoke_steps": args.smoke_steps,
        "pilot": args.pilot,
        "legs": args.legs,
        "max_legs": args.max_legs,
        "alpha": args.alpha,
        "target": args.target,
        "step_cut": parse_cuts(args.step_cut),
        "order_seed": args.order_seed,
        "allow_mixed_cache": True if args.allow_mixed_cache else None,
        "code": code_hash(),
    }
    for key in ("recipe", "baseline"):
        if plan[key] and plan[key].endswith(".toml"):
            plan[key] = str(Path(plan[key]).resolve())
    if args.resume is None:
        if not args.recipe or not args.baseline:
            raise ConfigError("certify needs --recipe R and --baseline B (or --resume DIR)")
        if args.pilot is not None and args.pilot < 2 and args.legs is None:
            raise ConfigError(
                f"--pilot {args.pilot} cannot estimate the noise (it needs 2 legs per arm): give --legs N"
            )
        filled = {"switches": [], "set": [], "seeded": True, "step_cut": [], "allow_mixed_cache": False}
        plan = {k: (v if v is not None else filled.get(k, DEFAULTS.get(k))) for k, v in plan.items()}
    for key, least in (("alpha", 0), ("target", None)):
        v = plan[key]
        if v is not None and (not math.isfinite(v) or (least is not None and not 0 < v < 0.5)):
            raise ConfigError(f"--{key} must be a finite number{' in (0, 0.5)' if least is not None else ''}")
    return plan


def parse_cuts(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        cuts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--step-cut {text!r}: expected step counts such as 12,24") from None
    if not cuts or any(c < 1 for c in cuts) or len(set(cuts)) < len(cuts):
        raise ConfigError(f"--step-cut {text!r}: expected distinct positive step counts such as 12,24")
    return cuts


def arms_of(plan: dict) -> tuple[dict, dict]:
    """({arm: (recipe, its train words)}, {arm: its resolved Config}), every config checked now."""
    from speedrun.recipes import load_recipe

    for item in [*plan["set"], *plan["switches"]]:
        if item.partition("=")[0].strip() == "train.seed":
            raise ConfigError(
                f"certify sets {item.partition('=')[0].strip()} of each leg itself; drop {item}"
            )
    arms = {
        "A": (plan["baseline"], list(plan["set"])),
        "B": (plan["recipe"], [*plan["set"], *plan["switches"]]),
    }
    configs = {arm: load_recipe(recipe, words) for arm, (recipe, words) in arms.items()}
    steps = configs["A"].train.steps
    for c in plan["step_cut"]:
        if c >= steps:
            raise ConfigError(f"--step-cut {c}: the baseline trains only {steps} steps")
        arms[f"C{c}"] = (plan["baseline"], [*plan["set"], f"train.steps={steps - c}"])
        configs[f"C{c}"] = load_recipe(*arms[f"C{c}"])
    for arm, cfg in configs.items():
        if cfg.train.time_budget_s > 0 or cfg.train.budget_min_steps > 0:
            raise ConfigError(
                f"certify times a fixed number of steps, but the {arm_label(arm)} has a time budget: add "
                "--set train.time_budget_s=0 --set train.budget_min_steps=0"
            )
    if plan["smoke_steps"] is None:
        plan["smoke_steps"] = max(1, steps // 4)
    for arm in "AB":
        load_recipe(arms[arm][0], [*arms[arm][1], f"train.steps={plan['smoke_steps']}"])
    return arms, configs


def preflight(out: Path, skip: bool) -> None:
    """The doctor's checks (another module, optional), else this host's torch, threads and inductor
    settings; written to preflight.txt; a failed check ends the certify unless --skip-preflight."""
    try:
        doctor = importlib.import_module("speedrun.tools.doctor")
    except ImportError:
        doctor = None
    if doctor is not None and hasattr(doctor, "run_checks") and hasattr(doctor, "Environment"):
        checks = doctor.run_checks(doctor.Environment())
        lines = [c.line() for c in checks]
        failed = [f"{c.name}: {c.detail}" for c in checks if c.status == "fail"]
    else:
        import torch

        from speedrun.tools.alike import this_host
        from speedrun.tools.verify import CACHE_ONLY_ENV

        env = [
            f"{k}={v}"
            for k, v in os.environ.items()
            if k.startswith("TORCHINDUCTOR_") and k not in CACHE_ONLY_ENV
        ]
        free = shutil.disk_usage(out).free
        lines = [
            f"ok   torch {torch.__version__}, cuda {torch.version.cuda or 'none'}",
            f"ok   threads {this_host()['threads']}",
            f"{'fail' if env else 'ok  '} inductor: {' '.join(env) or 'default config'}",
            f"{'warn' if free < 10**10 else 'ok  '} disk: {free / 1e9:.1f} GB free at {out}",
        ]
        failed = [f"inductor: {' '.join(env)} (the rules allow the default config)"] if env else []
    (out / "preflight.txt").write_text("\n".join(lines) + "\n")
    print("preflight: " + ("; ".join(failed) if failed else f"{len(lines)} checks, none failed"), flush=True)
    if failed and not skip:
        raise SpeedrunError(f"preflight failed: {failed[0]}; fix it, or pass --skip-preflight")


def smoke_rules(out: Path, entries: list[dict]) -> None:
    """The record rules on each smoke leg's folder, one line each; a crashed smoke leg ends the certify."""
    from speedrun.tools.results import load_run
    from speedrun.tools.verify import verify

    for e in (e for e in entries if e["outcome"] != "interrupted"):  # an interrupted attempt ran again
        if e["outcome"] == "crashed":
            raise SpeedrunError(
                f"smoke leg {e['leg']} crashed ({e['error']}); fix it and certify again in a new --out"
            )
        verdicts = verify([load_run(out / e["folder"])], 1, math.inf)
        bad = [f"{v.rule} {v.status}" for v in verdicts if v.status != "ok" and v.rule not in ("target",)]
        print(
            f"smoke {e['leg']}: val {e['final_val_loss']:.4f} in {e['train_time_s']:.2f} s; rules: "
            + (", ".join(bad) if bad else "all ok"),
            flush=True,
        )


def pilot_legs_needed(plan: dict, entries: list[dict]) -> dict:
    """The pilot's estimates and the legs each rule needs (one-sided t-tests, 80% power, at alpha)."""
    from speedrun.tools.stats import legs_needed, mean_sd

    done = [e for e in entries if e["outcome"] == "finished"]
    vals = [e["final_val_loss"] for e in done if e["arm"] == "B"]
    times = {a: {e["pair"]: e["train_time_s"] for e in done if e["arm"] == a} for a in "AB"}
    logs = [math.log(times["B"][p] / times["A"][p]) for p in sorted(set(times["A"]) & set(times["B"]))]
    (mv, sv), (ml, sl) = mean_sd(vals), mean_sd(logs)
    est = {
        "candidate_val_mean": mv,
        "candidate_val_sd": sv,
        "log_time_ratio_mean": ml,
        "log_time_ratio_sd": sl,
    }
    n2 = legs_needed(plan["target"] - mv, sv, plan["alpha"], POWER) if sv is not None else None
    n4 = legs_needed(-ml, sl, plan["alpha"], POWER) if sl is not None else None
    if plan["legs"]:
        chosen, why = plan["legs"], "--legs"
    elif n2 is None or n4 is None:
        chosen, why = plan["max_legs"], "--max-legs (the pilot shows no effect a test could find)"
    else:
        chosen, why = min(plan["max_legs"], max(n2, n4)), "the pilot's estimate"
    return est | {"legs_rule2": n2, "legs_rule4": n4, "N": chosen, "N_from": why}


def needs(n: int | None) -> str:
    return f"{n} legs" if n is not None else "cannot tell (no effect in its direction, or too few legs)"


def decision_rule(plan: dict, n: int) -> str:
    return (
        f"accepted when, over all {n} certify legs of each arm (none dropped; a crash fails): rule 2, the "
        f"one-sided one-sample t-test of the candidate's mean final val loss < {plan['target']} has p < "
        f"{plan['alpha']}; rule 4, the paired ratio of training time candidate/baseline has geometric mean "
        f"< 1 with paired t-test p < {plan['alpha']}; and the warm-up, sampled-softmax, validation-data, "
        "timing, cache and verify rules pass"
    )


def preregister(out: Path, plan: dict, configs: dict, ledger: Ledger, pilot: dict) -> tuple[dict, str]:
    from speedrun.tools.ablate import config_hash
    from speedrun.tools.race import block_orders

    n = pilot["N"]
    expected = compile_cache.COLD
    if plan["cache"] == compile_cache.WARM:
        expected = compile_cache.measure(out / "cache" / "shared").state
    content = {
        "what": "speedrun certify pre-registration, written before the first certify leg; a change to it "
        "afterwards is refused",
        "written": now(),
        "candidate": {
            "recipe": plan["recipe"],
            "switches": plan["switches"],
            "config_sha": config_hash(configs["B"]),
        },
        "baseline": {"recipe": plan["baseline"], "config_sha": config_hash(configs["A"])},
        "step_cut": {f"C{c}": config_hash(configs[f"C{c}"]) for c in plan["step_cut"]},
        "set": plan["set"],
        "code": plan["code"],
        "arms": list(configs),
        "N": n,
        "alpha": plan["alpha"],
        "target": plan["target"],
        "decision_rule": decision_rule(plan, n),
        "seeds": "train.seed = the pair's number 1..N, the same for every arm of a pair"
        if plan["seeded"]
        else "unseeded: every leg draws its own seed, recorded in the ledger",
        "order": {"blocks": block_orders(n, plan["order_seed"]), "seed": plan["order_seed"]},
        "timing": {
            "convention": "training time is summary.json's train_time_s (every step timed, validation "
            "untimed); wall time beside it",
            "timing_warmup_steps": configs["A"].train.timing_warmup_steps,
        },
        "cache": {"mode": plan["cache"], "expected": expected},
        "pilot": pilot,
        "ledger_before": sha256_bytes(ledger.path.read_bytes()) if ledger.path.is_file() else None,
    }
    return content, register(out, ledger, content)


def cmd_certify(args: argparse.Namespace) -> int:
    from speedrun.tools.alike import DataHold, allowed_by, refuse_unlike
    from speedrun.tools.alike import this_host as this_setting
    from speedrun.tools.certify_verdict import judge, write_outputs
    from speedrun.tools.race import this_host

    if args.resume is not None and args.out is not None:
        raise ConfigError("give --out DIR for a new certify or --resume DIR to continue one, not both")
    check_counts(args)
    given = plan_of(args)
    out = args.resume or args.out or Path("runs") / f"certify-{Path(given['recipe']).stem}"
    if args.resume is None:
        arms_of(given)  # every config checked (and the smoke steps chosen) before anything is written
    plan = check_plan(out, given, args.resume is not None)
    arms, configs = arms_of(plan)
    ledger = Ledger(out)
    rule = registered_rule(out, ledger)  # an edited pre-registration is refused before any leg runs
    preflight(out, args.skip_preflight)
    runner = Runner(out, plan, arms, ledger)
    runner.hashes["plan"] = sha256_bytes((out / "certify.json").read_bytes())
    allowed = allowed_by({s.partition("=")[0].strip() for s in plan["switches"]})
    hold = DataHold()

    def check(leg: Leg, cache: dict) -> None:  # before each leg: alike the phase's legs, one cache state
        entries = [e for e in ledger.legs(leg.phase) if e["outcome"] != "interrupted"]
        here = this_setting() | {"hardware": this_host(configs[leg.arm])} | hold.check(configs[leg.arm])
        refuse_unlike([out / e["folder"] for e in entries], f"the certify's {leg.phase} legs", here, allowed)
        if leg.phase != "smoke":
            states = {e["leg"]: e["cache"] for e in entries} | {f"{leg.name} (about to start)": cache}
            compile_cache.refuse_mixed(states, f"the {leg.phase} phase", plan["allow_mixed_cache"])

    runner.check = check
    try:
        print(
            f"certify {plan['recipe']} (+ {' '.join(plan['switches']) or 'nothing'}) against "
            f"{plan['baseline']} in {out}",
            flush=True,
        )
        smoke = [Leg("smoke", a, 1, SMOKE_SEED + 1 if plan["seeded"] else None) for a in "AB"]
        runner.play(smoke, say)
        smoke_rules(out, ledger.legs("smoke"))
        pilot = schedule("pilot", plan["pilot"], ["A", "B"], plan["order_seed"], plan["seeded"], PILOT_SEED)
        runner.play(pilot, say)
        if rule is None:
            estimate = pilot_legs_needed(plan, ledger.legs("pilot"))
            rule = preregister(out, plan, configs, ledger, estimate)
            print(
                f"pre-registered {PREREG_FILE} (sha256 {rule[1][:12]}): N={rule[0]['N']} legs per arm "
                f"(pilot: rule 2 needs {needs(estimate['legs_rule2'])}, rule 4 "
                f"{needs(estimate['legs_rule4'])}; "
                f"N from {estimate['N_from']})",
                flush=True,
            )
        content, digest = rule
        runner.hashes["preregistration"] = digest
        legs = schedule("certify", content["N"], content["arms"], plan["order_seed"], plan["seeded"], 0)
        runner.play(legs, say)
    finally:
        hold.close()
    registered_rule(out, ledger)  # still the file registered
    entries = [e for e in ledger.legs("certify") if e["outcome"] != "interrupted"]
    lines, num, accepted = judge(out, entries, content, plan["allow_mixed_cache"])
    write_outputs(out, lines, num, accepted, ledger.lines(), digest)
    print(
        f"verdict ({content['N']} legs per arm, alpha {content['alpha']}, target {content['target']}; "
        f"pre-registration sha256 {digest[:12]}):"
    )
    for line in lines:
        print(line.text())
    bad = [x.rule for x in lines if x.decides and not x.good]
    print("accepted: every pre-registered rule passes" if accepted else f"not accepted: {', '.join(bad)}")
    print(f"written: {out / 'verdict.json'}, record draft {out / 'record'}, ledger {out / 'ledger.jsonl'}")
    return 0 if accepted else 1


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("certify", help="a record attempt: smoke, pilot, pre-registered ABBA legs, a verdict")
    p.add_argument("--recipe", default=None, help="the candidate: bundled recipe name or .toml file")
    p.add_argument("--baseline", default=None, help="the record to beat, re-run here: recipe name or .toml")
    p.add_argument("--out", type=Path, default=None, help="a new folder (default runs/certify-<recipe>)")
    p.add_argument("--resume", type=Path, default=None, metavar="DIR", help="continue the certify in DIR")
    p.add_argument(
        "--set", action="append", default=[], metavar="key=value", help="an override for every arm"
    )
    p.add_argument("--target", type=float, default=None, help="rule 2's val loss target (default 3.28)")
    p.add_argument("--alpha", type=float, default=None, help="the tests' level (default 0.01)")
    p.add_argument("--pilot", type=int, default=None, help="pilot legs per arm (default 2; 0: none)")
    p.add_argument("--legs", type=int, default=None, help="certify legs per arm (default: from the pilot)")
    p.add_argument("--max-legs", type=int, default=None, help="the most legs the pilot may ask (default 20)")
    p.add_argument("--smoke-steps", type=int, default=None, help="steps of a smoke leg (default steps/4)")
    p.add_argument(
        "--step-cut", default=None, metavar="N,M", help="control arms: the baseline with N fewer steps"
    )
    p.add_argument(
        "--cache",
        choices=("cold", "warm"),
        default=None,
        help="a fresh compile cache per leg (cold, default) or one shared by all legs (warm)",
    )
    p.add_argument("--unseeded", action="store_true", help="every leg draws its own seed (recorded)")
    p.add_argument(
        "--order-seed", type=int, default=None, help="seed of the ABBA/BAAB block order (default 0)"
    )
    p.add_argument(
        "--allow-mixed-cache", action="store_true", help="compare cold- and warm-cache legs anyway"
    )
    p.add_argument("--skip-preflight", action="store_true", help="go on when a preflight check fails")
    p.set_defaults(
        trailing=p.add_argument(
            "switches", nargs="*", metavar="SWITCH=VALUE", help="what makes the candidate, beside its recipe"
        )
    )


def check_counts(args: argparse.Namespace) -> None:
    for flag, least in (("pilot", 0), ("legs", 2), ("max_legs", 2), ("smoke_steps", 1)):
        v = getattr(args, flag)
        if v is not None and not least <= v <= 1000:
            raise ConfigError(f"--{flag.replace('_', '-')} must be in {least}..1000, got {v}")
