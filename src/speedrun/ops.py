"""The named plain ops the algorithm calls through one indirection, so the speed layer can swap them.

The model and the optimizers call a few hot ops (the Gram matrix of an orthogonalization step, the
softcapped training loss) as ``ops.<name>(...)``. Each is declared where the algorithm defines it, by
decorating its plain PyTorch body with ``@plain_op("name")``: that body is the op's meaning and its twin.
The speed layer (``speedrun.perf``, which nothing in the algorithm imports) replaces an op from outside
with ``install(name, fn)`` before the model is built; ``reset()`` puts every plain body back.

What a call costs: one dict read of the installed function. Under ``torch.compile`` dynamo reads it at
trace time and guards on it, so the graph holds only the chosen op; choosing (which device, is Triton
importable) never runs inside a graph: it is done once, by ``speedrun.perf.swaps.install``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

#: name -> the plain body (the twin every replacement is tested against)
_PLAIN: dict[str, Callable[..., Any]] = {}
#: name -> what calls run now (the plain body unless the speed layer installed a replacement)
_CURRENT: dict[str, Callable[..., Any]] = {}


def plain_op(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare `fn` the plain body of op `name`; the decorated function dispatches to what is installed
    (``.plain`` is the body itself)."""

    def declare(fn: Callable[..., Any]) -> Callable[..., Any]:
        assert name not in _PLAIN, f"op {name!r} declared twice"
        _PLAIN[name] = _CURRENT[name] = fn

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            return _CURRENT[name](*args, **kwargs)

        call.plain = fn  # type: ignore[attr-defined]
        return call

    return declare


def plain(name: str) -> Callable[..., Any]:
    """The plain body of op `name` (a replacement falls back to it where it does not apply)."""
    return _PLAIN[name]


def names() -> tuple[str, ...]:
    return tuple(sorted(_PLAIN))


def install(name: str, fn: Callable[..., Any]) -> None:
    """Make calls of op `name` run `fn` (same signature and meaning as the plain body)."""
    assert name in _PLAIN, f"no op {name!r} (declared: {', '.join(names())})"
    _CURRENT[name] = fn


def installed() -> dict[str, Callable[..., Any]]:
    """The ops that run something other than their plain body now."""
    return {n: f for n, f in _CURRENT.items() if f is not _PLAIN[n]}


def reset() -> None:
    """Every op back to its plain body."""
    _CURRENT.update(_PLAIN)
