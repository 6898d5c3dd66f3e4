"""No import circle in the package (issue 36; docs/architecture.md, "Import rules"). Every module is
parsed with `ast`; its imports are listed twice: at the top (what runs when the module is imported,
`if TYPE_CHECKING:` blocks included, so a type checker sees no circle either) and inside functions. The
top-level graph has no cycle at all; with the function-level imports added, only the cycles listed in
KNOWN_LAZY_CYCLES remain, each with its reason, and the list may not go stale."""

from __future__ import annotations

import ast
from pathlib import Path

import speedrun
from tests.unit.test_config_layers import cycles

PACKAGE = Path(speedrun.__file__).parent

#: cycles closed only through a function-level import, each with why it is not closed yet
KNOWN_LAZY_CYCLES = {
    # sources opens the hub's documents when prepare asks; hub reads the files with sources' readers
    frozenset({"speedrun.data.hub", "speedrun.data.sources"}),
}


def _name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> tuple[set[str], set[str]]:
    """(top-level, function-level) package modules `path` imports; `from a import b` names a.b when that
    is a module, else a; importing a.b.c also runs a and a.b, so those are edges too (but not the
    module's own packages: they are imported before it)."""
    module = _name(path)
    anchor = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    top: set[str] = set()
    inner: set[str] = set()

    def add(names: set[str], dotted: str) -> None:
        parts = dotted.split(".")
        names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules)

    def visit(node: ast.AST, into: set[str]) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            into = inner
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(into, alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            add(into, base)
            for alias in node.names:
                add(into, f"{base}.{alias.name}")
        for child in ast.iter_child_nodes(node):
            visit(child, into)

    visit(ast.parse(path.read_text(), str(path)), top)
    own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}  # itself, its packages
    return top - own, inner - own


def graphs(root: Path = PACKAGE) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """The top-level import graph and the one with function-level imports added."""
    files = {_name(p): p for p in root.rglob("*.py")}
    top, both = {}, {}
    for module, path in files.items():
        t, i = imports(path, set(files))
        top[module], both[module] = t, t | i
    return top, both


def _named(found: list[set[str]]) -> str:
    return "; ".join(" <-> ".join(sorted(c)) for c in found)


def test_the_walker_separates_top_level_from_function_level_imports():
    top, both = graphs()
    assert "speedrun.config.labels" in top["speedrun.config.files"]
    assert "speedrun.config" not in top["speedrun.config.files"]  # its own package is imported before it
    # a lazy import (compare's data.meta in check_report's body) is function-level only
    assert "speedrun.data.meta" in both["speedrun.tools.results"]
    assert "speedrun.data.meta" not in top["speedrun.tools.results"]


def test_no_module_imports_itself_back_at_import_time():
    top, _ = graphs()
    found = cycles(top)
    assert not found, f"import cycles at import time: {_named(found)}"


def test_function_level_imports_close_no_new_cycle():
    _, both = graphs()
    found = {frozenset(c) for c in cycles(both)}
    new = [set(c) for c in found - KNOWN_LAZY_CYCLES]
    assert not new, f"import cycles through function-level imports: {_named(new)}"
    stale = [set(c) for c in KNOWN_LAZY_CYCLES - found]
    assert not stale, f"closed, remove from KNOWN_LAZY_CYCLES: {_named(stale)}"


def test_what_is_decided_before_step_0_and_what_a_run_writes_never_import_the_loop():
    """train/plan/ (budget, host fit, memory, precision, run data) and train/run/ (run folder, checkpoints,
    tracking) sit below the loop: they never import it, lazily or not, so a tool can plan or read a run
    without the loop (issue 36's train/ split)."""
    _, both = graphs()
    loop = {"speedrun.train.loop", "speedrun.train.warmup", "speedrun.tools", "speedrun.cli"}
    below = [m for m in both if m.startswith(("speedrun.train.plan", "speedrun.train.run"))]
    assert len(below) >= 10, below
    bad = {m: sorted(n for n in both[m] if any(n == x or n.startswith(x + ".") for x in loop)) for m in below}
    assert not any(bad.values()), bad
    written = [m for m in below if m.startswith("speedrun.train.run")]
    assert not any(n.startswith("speedrun.train.plan") for m in written for n in both[m])
