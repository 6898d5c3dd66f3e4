"""What `speedrun certify` writes down, and the rule that nothing written changes afterwards: the plan
(`certify.json`: the arguments and the code's hash, checked on every `--resume`), the pre-registration
(`PREREGISTRATION.json`, written before the first certify leg; its sha256 is registered in the ledger and
carried by every later line, and an edited file is refused) and the ledger (`ledger.jsonl`, one line a
leg, rewritten atomically so a kill -9 leaves the old file or the new one, never half a line)."""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

import speedrun
from speedrun.atomic import read_regular, write_atomic
from speedrun.errors import ConfigError, DataError
from speedrun.printable import printable

PLAN_FILE, PREREG_FILE, LEDGER_FILE = "certify.json", "PREREGISTRATION.json", "ledger.jsonl"
#: the plan's keys a resumed certify must share with the one that started (the recipe, the code, the
#: compile cache's handling and everything the legs or the rule are made of)
PLAN_KEYS = (
    "recipe",
    "baseline",
    "switches",
    "set",
    "cache",
    "seeded",
    "smoke_steps",
    "pilot",
    "legs",
    "max_legs",
    "alpha",
    "target",
    "step_cut",
    "order_seed",
    "allow_mixed_cache",
)
_DRIVER = re.compile(r"Driver Version: *([0-9.]+)")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def code_hash() -> str:
    """sha256 over the speedrun package this process imports (and each leg's process: the same Python
    and path): every source and recipe file, by its path inside the package and its bytes."""
    root = Path(speedrun.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".toml") and p.is_file()):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def check_plan(out: Path, plan: dict, resume: bool) -> dict:
    """The plan this certify runs under: on a new --out, `plan` (written now); with --resume, the saved
    one, after refusing in one line any given argument, or the code, that differs from it."""
    path = out / PLAN_FILE
    if not resume:
        if path.exists():
            raise ConfigError(f"--out {out} holds a certify already: continue it with --resume {out}")
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ConfigError(f"--out {out} is not an empty folder; certify writes only into a new one")
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(path, (json.dumps(plan, indent=2) + "\n").encode())
        return plan
    if not path.is_file():
        raise ConfigError(f"--resume {out}: no certify there (no {PLAN_FILE})")
    try:
        saved = json.loads(read_regular(path))
    except (OSError, ValueError):
        raise DataError(f"{path}: unreadable; it cannot be resumed") from None
    for key in (*PLAN_KEYS, "code"):
        given = plan.get(key)
        if given is not None and given != saved.get(key):
            what = "the code (speedrun package sha256)" if key == "code" else key.replace("_", "-")
            raise ConfigError(
                f"refused: {out} was started with {what} {printable(json.dumps(saved.get(key)))}, this "
                f"call has {printable(json.dumps(given))}; a certify resumes only under its own plan"
            )
    return saved


class Ledger:
    """ledger.jsonl: one JSON object a line, appended by rewriting the whole file atomically."""

    def __init__(self, out: Path):
        self.path = out / LEDGER_FILE

    def lines(self) -> list[dict]:
        if not self.path.is_file():
            return []
        found = []
        for n, line in enumerate(read_regular(self.path).decode("utf-8").splitlines(), 1):
            try:
                entry = json.loads(line)
            except ValueError:
                raise DataError(f"{self.path}:{n}: not a JSON line (edited?)") from None
            if not isinstance(entry, dict) or "kind" not in entry:
                raise DataError(f"{self.path}:{n}: not a ledger entry (edited?)")
            found.append(entry)
        return found

    def append(self, entry: dict) -> None:
        old = read_regular(self.path) if self.path.is_file() else b""
        write_atomic(self.path, old, (json.dumps(entry, sort_keys=True) + "\n").encode())

    def legs(self, phase: str | None = None) -> list[dict]:
        return [e for e in self.lines() if e["kind"] == "leg" and phase in (None, e["phase"])]

    def registered(self) -> str | None:
        """The sha256 the pre-registration was registered with; None before it was."""
        return next((e["sha256"] for e in self.lines() if e["kind"] == "preregistered"), None)


def register(out: Path, ledger: Ledger, content: dict) -> str:
    """Write PREREGISTRATION.json, then register its sha256 in the ledger (a kill between the two leaves
    a file not yet registered, which the next call writes again)."""
    data = (json.dumps(content, indent=2) + "\n").encode()
    write_atomic(out / PREREG_FILE, data)
    digest = sha256_bytes(data)
    ledger.append({"kind": "preregistered", "sha256": digest, "at": now()})
    return digest


def registered_rule(out: Path, ledger: Ledger) -> tuple[dict, str] | None:
    """(the pre-registration, its sha256) once registered; refused in one line if it was changed."""
    digest = ledger.registered()
    if digest is None:
        return None
    path = out / PREREG_FILE
    try:
        data = read_regular(path)
    except OSError:
        raise DataError(
            f"refused: {path} was removed after it was registered (sha256 {digest[:12]})"
        ) from None
    if sha256_bytes(data) != digest:
        raise DataError(
            f"refused: {path} changed after it was registered (sha256 {digest[:12]}, now "
            f"{sha256_bytes(data)[:12]}); the decision rule is fixed before the first certify leg"
        )
    return json.loads(data), digest


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def leg_facts(folder: Path) -> dict:
    """What a leg's run folder records: steps, times, final val, device, driver and code line (None
    where it records nothing, as after a crash before its first step)."""
    from speedrun.tools.results import load_run
    from speedrun.tools.run_facts import parse_log

    facts = dict.fromkeys(("steps", "train_time_s", "final_val_loss", "device", "driver", "code_line"))
    facts["status"] = "missing"
    try:
        run = load_run(folder)
    except DataError:
        return facts
    facts |= {"steps": run.steps, "train_time_s": run.train_time_s, "final_val_loss": run.final_val_loss}
    facts["status"] = run.status
    summary = folder / "summary.json"
    if summary.is_file():
        s = json.loads(summary.read_text(encoding="utf-8"))
        if s.get("device_name") is not None:
            facts["device"] = f"{s.get('world_size')} x {s['device_name']}"
    try:
        text = (folder / "log.txt").read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    codes = parse_log(text)[0]
    facts["code_line"] = codes[0][0] if codes else None
    facts["driver"] = m.group(1) if (m := _DRIVER.search(text)) else None
    return facts
