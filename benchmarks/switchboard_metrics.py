"""How much of the model code is switchboard (issue 36): per folder, source lines, `if` statements,
conditional expressions and their share of the lines ("guard share"), and for the gpt2026 hub the
branches in its forward and the config fields it reads. Run on any checkout:

    python benchmarks/switchboard_metrics.py [SRC]        # SRC defaults to this checkout's src/speedrun

Pure `ast`; it imports nothing of the package, so an old commit can be measured from `git worktree`."""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def docstring_lines(tree: ast.Module) -> set[int]:
    """Line numbers of the module's, classes' and functions' docstrings."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str):
                    found.update(range(first.lineno, first.end_lineno + 1))
    return found


def count(paths: list[Path]) -> dict[str, int]:
    """Source lines (non-blank, non-comment), code lines (those without the docstrings), `if`
    statements, conditional expressions, `if` guards in comprehensions, and `cfg.x` / `m.x` /
    `config.x` attribute reads."""
    lines = code = ifs = conds = reads = 0
    for p in paths:
        text = p.read_text()
        tree = ast.parse(text)
        docs = docstring_lines(tree)
        source = [
            i for i, s in enumerate(text.splitlines(), 1) if s.strip() and not s.strip().startswith("#")
        ]
        lines += len(source)
        code += sum(1 for i in source if i not in docs)
        for node in ast.walk(tree):
            ifs += isinstance(node, ast.If)
            conds += isinstance(node, ast.IfExp)
            conds += len(node.ifs) if isinstance(node, ast.comprehension) else 0
            reads += (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in ("cfg", "config", "m", "mc")
            )
    return {"files": len(paths), "lines": lines, "code": code, "if": ifs, "cond": conds, "cfg_reads": reads}


def forward_branches(model: Path) -> int:
    """`if` statements and conditional expressions inside the hub's forward-path methods."""
    tree = ast.parse(model.read_text())
    n = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name in ("forward", "hidden", "_hidden", "logits"):
            n += sum(isinstance(x, ast.If | ast.IfExp) for x in ast.walk(node))
    return n


def main(src: Path) -> None:
    groups = {
        "model/gpt2026": sorted((src / "model" / "gpt2026").rglob("*.py")),
        "model (all)": sorted((src / "model").rglob("*.py")),
        "config (all)": sorted(src.glob("config*.py")) + sorted((src / "config").rglob("*.py")),
        "package": sorted(src.rglob("*.py")),
    }
    print(
        f"{'where':<16}{'files':>6}{'lines':>8}{'code':>7}{'if':>6}{'cond':>6}"
        f"{'guard share':>13}{'cfg reads':>11}"
    )
    for name, paths in groups.items():
        c = count(paths)
        share = (c["if"] + c["cond"]) / max(1, c["lines"])
        print(
            f"{name:<16}{c['files']:>6}{c['lines']:>8}{c['code']:>7}{c['if']:>6}{c['cond']:>6}{share:>12.1%}{c['cfg_reads']:>11}"
        )
    hub = src / "model" / "gpt2026" / "model.py"
    if hub.exists():
        lines, branches = count([hub])["lines"], forward_branches(hub)
        print(f"gpt2026/model.py: {lines} lines, {branches} branches on its forward path")
    print(f"gpt2026 config top-level fields: {top_level_fields(src)}")


def top_level_fields(src: Path) -> int:
    """Annotated fields of the class named Gpt2026Config, wherever it lives."""
    for p in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and node.name == "Gpt2026Config":
                return sum(isinstance(x, ast.AnnAssign) for x in node.body)
    return -1


if __name__ == "__main__":
    main(
        Path(sys.argv[1])
        if len(sys.argv) > 1
        else Path(__file__).resolve().parent.parent / "src" / "speedrun"
    )
