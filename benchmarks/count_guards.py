"""Guard lines: how much of the package checks instead of computing (issue 18 aims at <= 12 %).

How it counts, per `.py` file under the folder given (default: src/speedrun), with Python's `ast`:
- code lines: lines that are not blank and not only a comment (docstrings count as code lines);
- guard lines: the distinct lines spanned by
  1. an `if` statement whose whole body is one `raise` and that has no `else` (condition and raise),
  2. an `except` handler (its `except ...:` line and its body; the `try` body is not counted),
  3. an `assert` statement,
  4. any other `raise` statement.
Prints each file's guard/code lines (largest first) and the total with its percentage. With
`--by-scope [REV]` (default 814659c, main just before issue 25's work) it prints instead the code
lines of the modules that existed at REV (now and then) apart from those of the modules added since.

    python benchmarks/count_guards.py [FOLDER] [--by-scope [REV]]
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path


def _span(node: ast.AST) -> set[int]:
    return set(range(node.lineno, node.end_lineno + 1))


def guard_lines(source: str) -> set[int]:
    """Line numbers (1-based) of `source` that are guard code, by the four rules above."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.If) and not node.orelse and len(node.body) == 1:
            if isinstance(node.body[0], ast.Raise):
                lines |= _span(node)
        elif isinstance(node, ast.ExceptHandler | ast.Assert | ast.Raise):
            lines |= _span(node)
    return lines


def code_lines(source: str) -> set[int]:
    return {
        i
        for i, line in enumerate(source.splitlines(), 1)
        if line.strip() and not line.lstrip().startswith("#")
    }


def count(folder: Path) -> list[tuple[str, int, int]]:
    """(file, guard lines, code lines) for every .py file under `folder`."""
    rows = []
    for path in sorted(folder.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        code = code_lines(source)
        rows.append((str(path.relative_to(folder)), len(guard_lines(source) & code), len(code)))
    return rows


FILING_REV = "814659c"  # landed main just before issue 25's work began (10,919 code lines)


def by_scope(folder: Path, rev: str) -> None:
    """Code lines of the modules that existed at `rev` (now, and at `rev`) vs the modules added since,
    so a reduction is not hidden by (or credited for) new features."""
    top = Path(
        subprocess.check_output(["git", "rev-parse", "--show-toplevel"], cwd=folder, text=True).strip()
    )
    prefix = folder.resolve().relative_to(top).as_posix()
    listed = subprocess.check_output(["git", "ls-tree", "-r", "--name-only", rev, prefix], cwd=top, text=True)
    old = {p[len(prefix) + 1 :]: p for p in listed.split() if p.endswith(".py")}
    then = sum(
        len(code_lines(subprocess.check_output(["git", "show", f"{rev}:{p}"], cwd=top, text=True)))
        for p in old.values()
    )
    rows = count(folder)
    kept = sum(code for name, _, code in rows if name in old)
    added = [(name, code) for name, _, code in rows if name not in old]
    print(f"modules that existed at {rev}: {kept} code lines now, {then} then ({kept - then:+d})")
    print(f"modules added since {rev}: {sum(c for _, c in added)} code lines in {len(added)} files")
    print(f"total: {kept + sum(c for _, c in added)} code lines now, {then} at {rev}")


def main() -> None:
    args = sys.argv[1:]
    if "--by-scope" in args:
        i = args.index("--by-scope")
        rev = args.pop(i + 1) if i + 1 < len(args) and not Path(args[i + 1]).is_dir() else FILING_REV
        args.pop(i)
        by_scope(Path(args[0] if args else "src/speedrun"), rev)
        return
    folder = Path(args[0] if args else "src/speedrun")
    rows = count(folder)
    for name, guards, code in sorted(rows, key=lambda r: -r[1]):
        if guards:
            print(f"{guards:5d} / {code:5d}  {name}")
    guards, code = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(f"total: {guards} guard lines of {code} code lines = {100 * guards / code:.1f} %")


if __name__ == "__main__":
    main()
