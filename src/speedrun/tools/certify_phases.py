"""The legs of `speedrun certify` and how each one runs: its place in the ABBA order (race's blocks), its
own `python -m speedrun train` process (which dies with certify: a kill -9 leaves no orphan training), its
compile cache folder measured before it starts, and its ledger line written when it ends. A leg that
crashed is recorded and counts; one that certify's own death interrupted is recorded as interrupted and
run again; one that finished while certify died is recorded from its folder. None is ever dropped."""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from speedrun.atomic import json_object, write_atomic
from speedrun.tools import compile_cache
from speedrun.tools.certify_ledger import Ledger, leg_facts, now
from speedrun.tools.race import block_orders, ended

SMOKE_SEED, PILOT_SEED = 20_000, 10_000  # smoke and pilot seeds never repeat a certify leg's (1..N)
OUTLIER_Z, OUTLIER_LEAST = 5.0, 3  # robust z (median, 1.4826·MAD) beyond which a leg is flagged


@dataclass(frozen=True)
class Leg:
    phase: str  # "smoke" | "pilot" | "certify"
    arm: str  # "A" (baseline) | "B" (candidate) | "C<n>" (baseline with n fewer steps)
    index: int  # its pair in the phase (1-based)
    seed: int | None  # None: unseeded (drawn when it starts, and recorded)

    @property
    def name(self) -> str:
        return f"{self.phase}-{self.arm}-{self.index:02d}"


def arm_label(arm: str) -> str:
    return {"A": "baseline", "B": "candidate"}.get(arm) or f"baseline -{arm[1:]} steps"


def schedule(phase: str, pairs: int, arms: list[str], order_seed: int, seeded: bool, seed0: int) -> list[Leg]:
    """Legs in run order: race's ABBA/BAAB blocks of the pair (A, B); a step-cut arm runs after the pair in
    a block's first half and before it in the second, so every arm's mean place in a block is the same."""
    legs = []
    for k, order in enumerate(block_orders(pairs, order_seed)):
        for j, half in enumerate((order[:2], order[2:])):
            if not half:
                continue
            pair = 2 * k + j + 1
            cuts = [a for a in arms if a not in "AB"]
            for arm in [*half, *cuts] if j == 0 else [*cuts[::-1], *half]:  # the second half: a mirror
                legs.append(Leg(phase, arm, pair, seed0 + pair if seeded else None))
    return legs


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the leg's process gets SIGKILL when certify dies (PR_SET_PDEATHSIG), so a kill -9 of
    certify leaves no run training on in the background; elsewhere a no-op."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _robust_outlier(value: float | None, earlier: list[float]) -> bool:
    if value is None or len(earlier) < OUTLIER_LEAST:
        return False
    med = sorted(earlier)[len(earlier) // 2]
    mad = sorted(abs(x - med) for x in earlier)[len(earlier) // 2] * 1.4826
    return mad > 0 and abs(value - med) / mad > OUTLIER_Z


class Runner:
    """Runs the legs of one certify in `out` and writes their ledger lines."""

    def __init__(self, out: Path, plan: dict, arms: dict[str, tuple[str, list[str]]], ledger: Ledger):
        self.out, self.plan, self.arms, self.ledger = out, plan, arms, ledger
        self.hashes = {"plan": None, "preregistration": None}
        self.check: Callable[[Leg, dict], None] = lambda leg, cache: (
            None
        )  # alike and cache checks before a leg (certify.py)

    def files(self, leg: Leg, attempt: int) -> tuple[Path, Path, Path]:
        stem = self.out / "legs" / f"{leg.name}.{attempt}"
        return stem, stem.with_name(stem.name + ".start.json"), stem.with_name(stem.name + ".out")

    def cache_dir(self, leg: Leg, attempt: int) -> Path:
        shared = self.plan["cache"] == compile_cache.WARM
        return self.out / "cache" / ("shared" if shared else f"{leg.name}.{attempt}")

    def play(self, legs: list[Leg], say=print) -> None:
        """Every leg not yet recorded, in order (the finished and crashed ones are kept as recorded)."""
        for i, leg in enumerate(legs, 1):
            tries = [e for e in self.ledger.legs() if e["leg"] == leg.name]
            if any(e["outcome"] != "interrupted" for e in tries):
                continue
            attempt = len(tries) + 1
            folder, marker, _ = self.files(leg, attempt)
            if marker.is_file():  # started before certify died: finished since, or interrupted
                started = json_object(marker)
                facts = leg_facts(folder)
                if self.plan["cache"] == compile_cache.COLD:
                    shutil.rmtree(self.cache_dir(leg, attempt), ignore_errors=True)  # ours, used
                if facts["status"] == "finished":
                    summary = json_object(folder / "summary.json")
                    self._record(
                        leg,
                        attempt,
                        started,
                        "finished",
                        None,
                        summary.get("wall_time_s"),
                        None,
                        recovered=True,
                    )
                    say(f"=== {leg.name} ({i}/{len(legs)}): finished while certify was down, recorded ===")
                    continue
                self._record(leg, attempt, started, "interrupted", None, None, "certify stopped during it")
                say(f"=== {leg.name}: attempt {attempt} was interrupted (recorded); running it again ===")
                attempt += 1
            say(f"=== {leg.phase} {leg.name} ({i}/{len(legs)}): {arm_label(leg.arm)} ===")
            self._run(leg, attempt)

    def _run(self, leg: Leg, attempt: int) -> None:
        folder, marker, output = self.files(leg, attempt)
        cache = self.cache_dir(leg, attempt)
        state = compile_cache.measure(cache)
        self.check(leg, state.as_dict())
        seed = leg.seed if leg.seed is not None else secrets.randbelow(2**31 - 1) + 1
        started = {"seed": seed, "cache": state.as_dict(), "started": now(), "clock": time.time()}
        write_atomic(marker, (json.dumps(started) + "\n").encode())
        recipe, words = self.arms[leg.arm]
        if leg.phase == "smoke":
            words = [*words, f"train.steps={self.plan['smoke_steps']}"]
        cmd = [
            sys.executable,
            "-m",
            "speedrun",
            "train",
            "--recipe",
            recipe,
            "--out",
            str(folder),
            *words,
            f"train.seed={seed}",
        ]
        env = os.environ | {compile_cache.CACHE_ENV: str(cache.resolve())}
        begin = time.perf_counter()
        with open(output, "wb") as sink:
            child = subprocess.Popen(
                cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent
            )
            code = child.wait()
        wall = time.perf_counter() - begin
        facts = leg_facts(folder)
        error = None
        if code != 0 or facts["status"] != "finished":
            tail = output.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-1:]
            error = f"its run {ended(code, folder)}" + (f": {tail[0][:300]}" if tail else "")
        self._record(leg, attempt, started, "finished" if error is None else "crashed", code, wall, error)
        if self.plan["cache"] == compile_cache.COLD:
            shutil.rmtree(cache, ignore_errors=True)  # ours, and the next leg must not find it

    def _record(
        self,
        leg: Leg,
        attempt: int,
        started: dict,
        outcome: str,
        code: int | None,
        wall: float | None,
        error: str | None,
        recovered: bool = False,
    ) -> None:
        folder, _, _ = self.files(leg, attempt)
        facts = leg_facts(folder)
        cache = compile_cache.CacheState(**started["cache"])
        try:
            log = (folder / "log.txt").read_text(encoding="utf-8", errors="replace")
        except OSError:
            log = ""
        cache = compile_cache.after_run(cache, log).as_dict()
        same = [e for e in self.ledger.legs(leg.phase) if e["arm"] == leg.arm and e["outcome"] == "finished"]
        outlier = any(
            _robust_outlier(facts[key] if outcome == "finished" else None, [e[key] for e in same if e[key]])
            for key in ("train_time_s", "final_val_loss")
        )
        entry = {
            "kind": "leg",
            "leg": leg.name,
            "phase": leg.phase,
            "arm": leg.arm,
            "pair": leg.index,
            "attempt": attempt,
            "folder": str(folder.relative_to(self.out)),
            "outcome": outcome,
            "seed": started["seed"],
            "seeded": leg.seed is not None,
            "exit_code": code,
            "wall_s": wall,
            "train_time_s": facts["train_time_s"],
            "final_val_loss": facts["final_val_loss"],
            "steps": facts["steps"],
            "device": facts["device"],
            "driver": facts["driver"],
            "code": self.plan["code"],
            "code_line": facts["code_line"],
            "cache": cache,
            "crash": outcome == "crashed",
            "outlier": outlier,
            "error": error,
            "recovered": recovered,
            "started": started["started"],
            "ended": now(),
            **self.hashes,
        }
        self.ledger.append(entry)
