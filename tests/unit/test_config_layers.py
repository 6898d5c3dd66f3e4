"""The config layer stands alone (issue 25): it imports no torch and nothing from speedrun.train or
speedrun.model, no import cycle passes through it, and every bundled recipe loads, checks and prints
in a process where importing torch fails (docs/architecture.md, "Import rules")."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import speedrun

PACKAGE = Path(speedrun.__file__).parent
#: The config layer: what loading, checking and printing a recipe runs (docs/architecture.md).
CONFIG_LAYER = {
    "speedrun.config", "speedrun.config.checks", "speedrun.config.files", "speedrun.config.types",
    "speedrun.config.stages", "speedrun.config.labels", "speedrun.recipes", "speedrun.errors",
    "speedrun.printable", "speedrun.config.families", "speedrun.config.data", "speedrun.config.gpt2026",
}  # fmt: skip
FORBIDDEN = ("torch", "tiktoken", "speedrun.train", "speedrun.model", "speedrun.data")


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Every module this file imports when it runs: at the top, inside functions, under try; not what
    only a type checker reads (`if TYPE_CHECKING:`). `from a import b` names a.b when b is a module
    (resolved by the caller), else a; relative imports are made absolute."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module → the modules it imports (of the package: only those that exist; outside it: the top
    name, e.g. torch). Importing a.b.c also runs a/__init__ and a/b/__init__, so those are edges too
    (except the module's own packages)."""
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        edges: set[str] = set()
        for name in _imported(ast.parse(path.read_text(), str(path)), module, path.name == "__init__.py"):
            if name.split(".")[0] != root.name:
                edges.add(name.split(".")[0])
                continue
            parts = name.split(".")
            edges.update(
                ".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in files
            )
        own = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 2)}
        graph[module] = edges - own  # its own packages are imported before it, not by it
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan), i.e. every import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def reachable(graph: dict[str, set[str]], start: set[str]) -> dict[str, str]:
    """Every module imported, directly or not, from `start` → the module that imports it."""
    seen: dict[str, str] = {}
    todo = list(start)
    while todo:
        v = todo.pop()
        for w in graph.get(v, ()):
            if w not in seen and w not in start:
                seen[w] = v
                todo.append(w)
    return seen


def test_the_graph_walk_finds_a_cycle_and_a_forbidden_import(tmp_path):
    """The walker itself: a planted cycle through a config module (one leg lazy, one relative) and a
    torch import reached through a helper are both found; a TYPE_CHECKING import is not an edge."""
    pkg = tmp_path / "speedrun"
    (pkg / "train").mkdir(parents=True)
    (pkg / "config").mkdir()
    files = {
        "__init__.py": "",
        "config/__init__.py": "from speedrun.config.checks import check\n",
        "config/checks.py": "def check():\n    from speedrun.train import stages\n",
        "train/__init__.py": "",
        "train/stages.py": "from ..config import x\nfrom . import helper\n",
        "train/helper.py": "import torch.nn\n",
        "config/types.py": "import typing\nif typing.TYPE_CHECKING:\n    from speedrun import config\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(pkg)
    assert {"speedrun.config", "speedrun.config.checks", "speedrun.train.stages"} in cycles(graph)
    assert "speedrun.config" not in graph["speedrun.config.types"]
    assert "torch" in reachable(graph, {"speedrun.config"})


def test_no_import_cycle_passes_through_the_config_layer():
    graph = import_graph(PACKAGE)
    assert CONFIG_LAYER <= set(graph), "a config-layer module was renamed: update CONFIG_LAYER and the doc"
    bad = [sorted(c) for c in cycles(graph) if any(m.split(".")[1].startswith("config") for m in c)]
    assert not bad, f"import cycles through the config layer: {bad}"


def test_the_config_layer_imports_no_torch_and_nothing_from_train_or_model():
    graph = import_graph(PACKAGE)
    via = reachable(graph, CONFIG_LAYER)
    bad = {m: via[m] for m in via if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)}
    chains = []
    for m in sorted(bad):
        chain = [m]
        while chain[-1] in via:
            chain.append(via[chain[-1]])
        chains.append(" <- ".join(chain))
    assert not chains, "the config layer reaches: " + "; ".join(chains)


#: Lower layers → what they never import: the model, the optimizer and the data pipeline know nothing of
#: the training loop, the tools or the command line (principle 3; docs/architecture.md).
NEVER_ABOVE = {
    "speedrun.model": ("speedrun.train", "speedrun.tools", "speedrun.cli"),
    "speedrun.optim": ("speedrun.train", "speedrun.tools", "speedrun.cli"),
    "speedrun.data": ("speedrun.train", "speedrun.tools", "speedrun.cli", "speedrun.model", "speedrun.optim"),
}


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_model_optim_and_data_never_import_the_layers_above_them():
    graph = import_graph(PACKAGE)
    bad = sorted(
        f"{m} -> {e}"
        for m, edges in graph.items()
        for layer, above in NEVER_ABOVE.items()
        if _within(m, layer)
        for e in edges
        if any(_within(e, a) for a in above)
    )
    assert not bad, f"imports against the layering: {bad}"


BLOCK_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked in this test")
sys.meta_path.insert(0, _NoTorch())
"""


def _without_torch(code: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")]),
    }
    script = BLOCK_TORCH + textwrap.dedent(code)
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )


def test_every_recipe_loads_checks_and_prints_where_torch_cannot_be_imported():
    proc = _without_torch(
        """
        import runpy
        from speedrun.recipes import load_recipe, recipe_names
        import speedrun.config.stages, speedrun.config.files, speedrun.printable
        names = recipe_names()
        for name in names:
            cfg = load_recipe(name)
            if cfg.train.stages:
                assert speedrun.config.stages.stage_plan(cfg) is not None
        assert "torch" not in sys.modules
        print(len(names))
        sys.argv = ["speedrun", "recipes", "stages-2025-12", "--json"]
        try:
            runpy.run_module("speedrun", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            assert not e.code, e.code
        from speedrun.config.labels import format_table, label_table
        cfg = load_recipe("stages-2025-12")
        print(format_table(cfg.optim, label_table(cfg.optim, cfg.model.n_embd // cfg.model.n_head)))
        assert "torch" not in sys.modules
        """
    )
    assert proc.returncode == 0, proc.stderr
    count, _, shown = proc.stdout.partition("\n")
    assert int(count) == len(list((PACKAGE / "recipes").glob("*.toml"))) > 20
    config, _, table = shown.partition("\n}\n")
    assert json.loads(config + "}")["recipe"] == "stages-2025-12"
    assert table.startswith("optimizer labels:") and "\nqkv " in table  # the label table, torch-free


def test_dry_run_prints_the_config_and_then_says_in_one_line_that_the_model_needs_torch():
    proc = _without_torch(
        """
        from speedrun.cli import main
        sys.exit(main(["train", "--recipe", "stages-2025-12", "--dry-run", "train.steps=300"]))
        """
    )
    assert proc.returncode == 1, proc.stderr
    assert json.loads(proc.stdout)["train"]["steps"] == 300
    assert proc.stderr.strip().splitlines() == [
        "speedrun: error: the model summary of --dry-run needs torch, which cannot be imported "
        "(torch is blocked in this test)"
    ]


BLOCK_DATA = """
import sys
class _NoData:
    def find_spec(self, name, path=None, target=None):
        if name in ("tiktoken", "speedrun.data") or name.startswith(("tiktoken.", "speedrun.data.")):
            raise ImportError(f"{name} is blocked in this test")
sys.meta_path.insert(0, _NoData())
"""


def test_the_demo_recipes_load_and_check_where_tiktoken_and_the_data_package_cannot_be_imported():
    """Issue 36: the config checks imported speedrun.data (and with it tiktoken) to check data.source and
    data.tokenizer; the names' rules live in config/data.py now."""
    script = BLOCK_DATA + textwrap.dedent(
        """
        from speedrun.config.checks import validate
        from speedrun.recipes import load_recipe
        for name in ("demo", "demo-2026", "record-2026-07"):
            cfg = load_recipe(name)
            cfg.data.tokenizer = "bpe:4096"  # the BPE name's rule runs too
            validate(cfg)
        assert not [m for m in sys.modules if m.split(".")[0] == "tiktoken" or m.startswith("speedrun.data")]
        print("ok")
        """
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
