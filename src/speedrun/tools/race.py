"""`speedrun race`: is B faster than A on this machine? Same-hardware paired timing of two arms.

A is the recipe; B is the recipe with the switches, or the same recipe run by another Python
(`--python-b`, so two checkouts race). Pair i trains A and B with `train.seed=i`. Pairs come in
blocks of two run in the order ABBA or BAAB (drawn from `--seed`), so a machine that drifts (heat,
other jobs) weighs on both arms alike. The plan, with that order, is written to `OUT/race.json`
before the first run; a second call with the same arguments reuses finished runs and resumes stopped
ones, and other arguments are refused. Every run is its own process (`python -m speedrun train`),
so neither arm inherits the other's warm caches. Runs that are not alike (tools/alike.py: hardware,
threads, data, ...) never mix in one race.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speedrun.config import Config
from speedrun.errors import ConfigError, DataError, SpeedrunError
from speedrun.tools import compile_cache
from speedrun.tools.alike import DataHold, allowed_by, refuse_unlike, setting
from speedrun.tools.alike import this_host as this_setting

PLAN_FILE = "race.json"
ORDERS = ("ABBA", "BAAB")
NEEDS_PAIRS = "n/a (needs 2 pairs)"  # an estimate that one pair cannot give


@dataclass
class Leg:
    """One run of the race: its arm, pair and folder, and the config it must have (None: resolved by
    `--python-b`'s own code, which this process cannot read)."""

    arm: str  # "A" | "B"
    pair: int
    folder: Path
    config: Config | None

    @property
    def tag(self) -> str:
        return f"{self.arm}{self.pair}"


def block_orders(pairs: int, seed: int) -> list[str]:
    """ABBA or BAAB per block of two pairs (an odd last pair gets its block's first half), seeded."""
    rng = random.Random(seed)
    orders = [rng.choice(ORDERS) for _ in range((pairs + 1) // 2)]
    if pairs % 2:
        orders[-1] = orders[-1][:2]
    return orders


def schedule(orders: list[str]) -> list[tuple[str, int]]:
    """(arm, pair) in run order: block k holds pairs 2k+1 and 2k+2, in `ABBA`'s order the pairs of
    block 1 run as A1 B1 B2 A2."""
    legs = []
    for k, order in enumerate(orders):
        seen: dict[str, int] = {}
        for arm in order:
            seen[arm] = seen.get(arm, 0) + 1
            legs.append((arm, 2 * k + seen[arm]))
    return legs


def _budget_refusal(recipe: str, cfg: Any, sets: list[str]) -> str:
    """The remedy that works (issue 46): without the budget a leg trains `train.steps`, which a budgeted
    recipe states as a cap (demo: 1,000 steps, hours on a CPU), so the fix names the step count too."""
    t, given = cfg.train, {s.partition("=")[0].strip() for s in sets}
    fix = ["train.time_budget_s=0"] + (["train.budget_min_steps=0"] if t.budget_min_steps else [])
    cap = ""
    if "train.steps" not in given:
        fix.append("train.steps=N")
        cap = f"; without the budget each leg trains {recipe}'s cap, train.steps={t.steps}, so give N"
    return (
        f"race times a fixed number of steps, but {recipe} has train.time_budget_s={t.time_budget_s:g} "
        f"(both arms would train for that time): add {' '.join('--set ' + f for f in fix)}{cap}"
    )


def _train_words(args: argparse.Namespace, arm: str, pair: int) -> list[str]:
    return [*args.set, *(args.switches if arm == "B" else []), f"train.seed={pair}"]


def speedrun_of(python: str) -> str:
    """The speedrun package `python` imports (PYTHONPATH included: it reaches both arms' processes),
    so the report says which code each arm ran."""
    if shutil.which(python) is None:
        raise ConfigError(f"--python-b {python}: no such executable")
    probe = "import speedrun; print(speedrun.__version__, speedrun.__file__)"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"--python-b {python}: cannot run it ({e})") from None
    if done.returncode != 0 or not done.stdout.strip():
        raise ConfigError(
            f"--python-b {python} cannot import speedrun: install it there (pip install -e CHECKOUT)"
        )
    version, _, path = done.stdout.strip().splitlines()[-1].partition(" ")
    return f"speedrun {version} from {Path(path).parent}"


def plan(args: argparse.Namespace) -> tuple[dict, list[Leg]]:
    """The race's plan (what race.json holds) and its legs, every config resolved and checked first."""
    from speedrun.recipes import load_recipe
    from speedrun.tools.ablate import config_hash

    if not args.switches and args.python_b is None:
        raise ConfigError("nothing to race: give B's switches (SWITCH=VALUE ...) or --python-b PY")
    for item in [*args.set, *args.switches]:
        if item.partition("=")[0].strip() == "train.seed":
            raise ConfigError("race sets train.seed to the pair's number; drop the train.seed= override")
    code = {"A": speedrun_of(sys.executable), "B": speedrun_of(args.python_b)} if args.python_b else None
    recipe = args.recipe
    if recipe.endswith(".toml"):  # the same file for the other checkout, wherever it runs from
        recipe = str(Path(recipe).resolve())
    base = load_recipe(recipe, args.set)
    out = args.out if args.out is not None else Path("runs") / f"race-{base.recipe}"
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a folder")
    legs = []
    for arm, pair in schedule(block_orders(args.pairs, args.seed)):
        cfg = None
        if arm == "A" or args.python_b is None:  # B under another Python: its code resolves the config
            cfg = load_recipe(recipe, _train_words(args, arm, pair))
            if cfg.train.time_budget_s > 0:
                raise ConfigError(_budget_refusal(base.recipe, cfg, args.set))
        legs.append(Leg(arm, pair, out / f"{arm}-pair{pair}", cfg))
    if args.python_b is None:
        a, b = (next(leg.config for leg in legs if leg.tag == tag) for tag in ("A1", "B1"))
        if config_hash(a) == config_hash(b):
            raise ConfigError("B's switches are the recipe's own values: the arms would be the same")
    saved = {
        "recipe": recipe,
        "set": args.set,
        "switches": args.switches,
        "python_b": args.python_b,
        "code": code,  # the speedrun package each arm's Python imports
        "pairs": args.pairs,
        "seed": args.seed,
        "blocks": block_orders(args.pairs, args.seed),
        "runs": [f"{leg.tag}: {leg.folder.name}" for leg in legs],
    }
    return saved, legs


def write_plan(out: Path, saved: dict) -> None:
    """race.json before the first run; a race already planned there must be this one."""
    from speedrun.atomic import write_atomic

    path = out / PLAN_FILE
    if path.is_file():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise DataError(f"{path}: unreadable; remove {out} to race again") from None
        if old != saved:
            diff = sorted(k for k in saved if not isinstance(old, dict) or old.get(k) != saved[k])
            raise ConfigError(
                f"{out} holds another race (its {PLAN_FILE} differs in {', '.join(diff)}); "
                "choose another --out"
            )
        return
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(path, (json.dumps(saved, indent=2) + "\n").encode())


def leg_state(leg: Leg) -> str:
    """ablate's states: new, finished, stopped, other (a run of another config), broken."""
    from speedrun.tools.ablate import _found, state

    return state(leg.folder, leg.config) if leg.config is not None else _found(leg.folder)


def this_host(cfg: Config) -> str:
    """What summary.json will say a run of `cfg` trains on here: one process (race never launches
    more), on the device `train.device` names or the one `auto` picks."""
    import torch

    from speedrun.train.run.tracking import hardware_name

    device = cfg.train.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return f"1 x {hardware_name(device)}"


def run_legs(args: argparse.Namespace, saved: dict, legs: list[Leg]) -> None:
    """Train what is missing in the planned order, each run a process of its arm's Python."""
    states = {leg.folder: leg_state(leg) for leg in legs}
    for leg in legs:
        if states[leg.folder] in ("other", "broken"):
            raise DataError(
                f"{leg.folder} holds neither this race's finished run nor a checkpoint to resume; "
                "remove it to train that run again"
            )
    hold = DataHold()  # the data folder stays the one every arm trains on, to the report
    try:
        for i, leg in enumerate(legs, 1):
            _run_leg(args, saved, leg, f"{leg.tag} ({i}/{len(legs)}): {leg.folder}", states, legs, hold)
    finally:
        hold.close()


def allowed_facts(args: argparse.Namespace) -> tuple[str, ...]:
    """What B's switches (or its other Python: the code) change on purpose."""
    keys = {part.partition("=")[0].strip() for part in args.switches}
    return allowed_by(keys) + (("code",) if args.python_b else ())


def run_child(cmd: list[str]) -> tuple[int, int | None]:
    """(exit code, the stop signal this process received while it ran, or None) of a run's process. The
    run is in its own session, so a Ctrl-C reaches it once, forwarded from here (each signal received is
    sent on: a second one quits at once, as in `train`), and the race knows it was stopped."""
    from speedrun.train.signals import STOP_SIGNALS

    child = subprocess.Popen(cmd, start_new_session=True)
    received: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
    try:
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code, received[0] if received else None


def ended(code: int, folder: Path) -> str:
    """How a run's process ended, for a one-line error: a negative code is the signal that killed it,
    which printed nothing (SIGKILL: most often the kernel's out-of-memory killer)."""
    if code >= 0:
        return f"ended with exit code {code} (its error is above)"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    why = "; likely out of memory (see `dmesg`) or an external kill" if -code == signal.SIGKILL else ""
    return f"was killed by {name} (signal {-code}{why}); its log: {folder / 'log.txt'}"


def _run_leg(args, saved: dict, leg: Leg, tag: str, states: dict, legs: list[Leg], hold: DataHold) -> None:
    """One leg, after checking that it would be alike the legs already run (alike.py's rule)."""
    python = args.python_b if leg.arm == "B" and args.python_b else sys.executable
    if states[leg.folder] == "finished":
        print(f"=== {tag}: finished before, reused ===", flush=True)
        return
    a_config = next(x.config for x in legs if x.arm == "A")
    here = this_setting() | {"hardware": this_host(a_config)} | hold.check(leg.config or a_config)
    refuse_unlike([x.folder for x in legs], "the race", here, allowed_facts(args))
    if states[leg.folder] == "stopped":
        print(f"=== {tag}: resumed ===", flush=True)
        argv = ["train", "--resume", str(leg.folder)]
    else:
        print(f"=== {tag} ===", flush=True)
        argv = ["train", "--recipe", saved["recipe"], "--out", str(leg.folder)]
        argv += _train_words(args, leg.arm, leg.pair)
    cache = compile_cache.measure(compile_cache.cache_folder())  # what the run finds when it starts
    code, signum = run_child([python, "-m", "speedrun", *argv])
    compile_cache.record(leg.folder, cache)
    if signum is not None:
        from speedrun.train.signals import RunInterrupted

        raise RunInterrupted(
            f"race stopped by {signal.Signals(signum).name} in {leg.folder} ("
            + ("its run stopped as asked, message above" if code == 128 + signum else ended(code, leg.folder))
            + "); run the same command again to resume it",
            signum,
        )
    if code != 0:
        raise SpeedrunError(f"{leg.folder}: arm {leg.arm}'s run {ended(code, leg.folder)}")


@dataclass
class Result:
    """What the report reads from one finished leg."""

    train_time_s: float
    step_s: float | None  # mean step time after the first timed log interval
    val_loss: float | None


def steady_step_s(folder: Path, warmup_steps: int) -> float | None:
    """Seconds per step between the first log point after the untimed warm-up's first timed interval
    and the last one: training time without the first steps, where compilation and caches warm up."""
    from speedrun.train.run.rundir import read_records

    records, _ = read_records(folder / "metrics.jsonl")
    timed = [r for _, r in records if "train_loss" in r and r["step"] > warmup_steps and "time_s" in r]
    if len(timed) < 2 or timed[-1]["step"] <= timed[0]["step"] or timed[-1]["time_s"] <= timed[0]["time_s"]:
        return None  # too few log points after the warm-up to time a step
    return (timed[-1]["time_s"] - timed[0]["time_s"]) / (timed[-1]["step"] - timed[0]["step"])


def read_result(leg: Leg) -> Result:
    from speedrun.tools.results import load_run

    run = load_run(leg.folder)
    if not run.finished or run.train_time_s is None or run.train_time_s <= 0:
        raise DataError(f"{leg.folder}: not a finished run with a training time; remove it to train it again")
    warmup = run.config.get("train.timing_warmup_steps") or 0
    return Result(run.train_time_s, steady_step_s(leg.folder, warmup), run.final_val_loss)


def _ratio_text(what: str, a: list[float], b: list[float]) -> str:
    from speedrun.tools.stats import paired_ratio

    r = paired_ratio(a, b)
    missing = NEEDS_PAIRS if r.n < 2 else "- (no spread)"  # one pair: no interval, not a zero-width one
    ci = f"95% CI [{r.low:.4f}, {r.high:.4f}]" if r.low is not None else f"95% CI {missing}"
    t_p = f"paired t p={r.t_p:.3g}" if r.t_p is not None else f"paired t p {missing}"
    return (
        f"{what} B/A: geometric mean {r.geomean:.4f}, {ci}; B faster in {r.faster}/{r.n} pairs, "
        f"sign test p={r.sign_p:.3g}; {t_p}"
    )


def report(saved: dict, legs: list[Leg], hardware: str | None, allow_mixed_cache: bool = False) -> str:
    """Per block and overall: the paired B/A ratios of training time and steady step time, and each
    arm's final val loss with Welch's test; refused when compiled legs mix cold and warm caches."""
    from speedrun.tools.stats import mean_sd, paired_ratio, welch_test

    caches = compile_cache.recorded([leg.folder for leg in legs])
    kind = compile_cache.refuse_mixed(caches, "the race", allow_mixed_cache)
    res = {leg.tag: read_result(leg) for leg in legs}
    pairs = range(1, saved["pairs"] + 1)
    b_is = " ".join(saved["switches"]) or "the recipe"
    b_is += f" run by {saved['python_b']}" if saved["python_b"] else ""
    lines = [
        f"race of {Path(saved['recipe']).name}: A = the recipe, B = {b_is}; {saved['pairs']} pair(s) in "
        f"{len(saved['blocks'])} block(s) (order seed {saved['seed']}) on {hardware}",
        *([f"code: A {saved['code']['A']}; B {saved['code']['B']}"] if saved["python_b"] else []),
        "block  order  pairs  train time B/A  step time B/A",
    ]
    for k, order in enumerate(saved["blocks"]):
        ids = [p for p in (2 * k + 1, 2 * k + 2) if p in pairs]
        ratios = []
        for key in ("train_time_s", "step_s"):
            a = [getattr(res[f"A{p}"], key) for p in ids]
            b = [getattr(res[f"B{p}"], key) for p in ids]
            ratios.append("-" if None in a + b else f"{paired_ratio(a, b).geomean:.4f}")
        lines.append(f"{k + 1:<6} {order:<6} {','.join(map(str, ids)):<6} {ratios[0]:<15} {ratios[1]}")
    lines.append(f"overall ({saved['pairs']} pairs):")
    for key, what in (("train_time_s", "train time"), ("step_s", "step time after warm-up")):
        a, b = [getattr(res[f"A{p}"], key) for p in pairs], [getattr(res[f"B{p}"], key) for p in pairs]
        lines.append(
            "  " + (_ratio_text(what, a, b) if None not in a + b else f"{what}: - (too few log points)")
        )
    losses = {
        arm: [res[f"{arm}{p}"].val_loss for p in pairs if res[f"{arm}{p}"].val_loss is not None]
        for arm in "AB"
    }
    shown = []
    for arm in "AB":
        mean, sd = mean_sd(losses[arm])
        spread = NEEDS_PAIRS if sd is None and mean is not None else "-" if sd is None else f"{sd:.4f}"
        shown.append(f"{arm} {'-' if mean is None else f'{mean:.4f}'} ± {spread}")
    test = welch_test(losses["B"], losses["A"], "race")
    lines.append(
        f"  val loss: {', '.join(shown)}; Welch p={test[1]:.3g}"
        if test
        else f"  val loss: {', '.join(shown)}"
    )
    lines.append("  " + compile_cache.summary_line(caches, kind))
    return "\n".join(lines)


def cmd_race(args: argparse.Namespace) -> int:
    saved, legs = plan(args)
    write_plan(legs[0].folder.parent, saved)
    run_legs(args, saved, legs)
    refuse_unlike([leg.folder for leg in legs], "the race", allowed=allowed_facts(args))  # reused runs too
    print(report(saved, legs, setting(legs[0].folder)["hardware"], args.allow_mixed_cache))
    return 0
