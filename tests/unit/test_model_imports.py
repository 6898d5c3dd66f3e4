"""The model's shared parts know no family: the decoder, the attention contexts, masks and layers import
neither model/gpt2026/ nor the gpt2024 GPT's own modules (read from their source with ast, lazy imports
inside functions included), so a family's attention reaches decoding only through the context interface."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

MODEL = Path(__file__).resolve().parents[2] / "src" / "speedrun" / "model"
#: every module directly in model/ is shared, except the family record that builds either family
SHARED = sorted(p.name for p in MODEL.glob("*.py") if p.name not in ("families.py", "__init__.py"))
FAMILY = ("speedrun.model.gpt2026", "speedrun.model.gpt2024")


def imported(path: Path) -> set[str]:
    """Every module an `import` or `from … import` anywhere in the file names (relative ones resolved)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from . import x / from .gpt2026 import y, inside speedrun.model
                base = "speedrun.model" + (f".{base}" if base else "")
            names |= {base} | {f"{base}.{a.name}" for a in node.names}
    return names


def family_imports(names: set[str]) -> set[str]:
    return {n for n in names if any(n == f or n.startswith(f + ".") for f in FAMILY)}


@pytest.mark.parametrize("name", SHARED)
def test_shared_model_parts_import_no_family(name: str):
    assert not family_imports(imported(MODEL / name)), name


def test_the_rule_sees_a_lazy_family_import(tmp_path: Path):
    """The check fails on what the decoder did before: a gpt2026 import inside a function."""
    old = tmp_path / "old.py"
    old.write_text(
        "def f():\n    from speedrun.model.gpt2026.dc import dc_valid\n    from . import gpt2024\n"
    )
    assert family_imports(imported(old)) == {
        "speedrun.model.gpt2026.dc",
        "speedrun.model.gpt2026.dc.dc_valid",
        "speedrun.model.gpt2024",
    }


@pytest.mark.parametrize(("family", "other"), [("gpt2024", "gpt2026"), ("gpt2026", "gpt2024")])
def test_the_families_never_import_each_other(family: str, other: str):
    """model/gpt2024/ and model/gpt2026/ share only the parts in model/ (issue 36)."""
    files = sorted((MODEL / family).rglob("*.py"))
    assert files, family
    for path in files:
        names = imported(path)
        assert not {
            n for n in names if n == f"speedrun.model.{other}" or n.startswith(f"speedrun.model.{other}.")
        }, path
