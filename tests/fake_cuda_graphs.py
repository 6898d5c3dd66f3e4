"""A stand-in for the part of `torch.cuda` a CUDA-graph capture uses, for running speedrun/perf/graphs.py's
CUDA branch on the CPU. Like a real capture, `graph(...)` records the aten ops its block launches and a
replay runs exactly those ops again on the same tensors (Python values baked, inputs read at their
addresses); the outputs a capture creates are filled with NaN afterwards, since a real capture records
without executing. Inside the block a host sync (`.item()`, `nonzero`, ...) raises as CUDA's "operation
not permitted when stream is capturing" does, and so does an import outside torch's own code of a module
not loaded yet (the last GPU lease failed on one inside a compiled graph). Every call goes to `calls`.
With `record=False` (a torch.compile'd body: dynamo runs under no dispatch mode) only the import guard
acts, and a replay does nothing, so only a key's capturing visit computes (the capture ran the body)."""

from __future__ import annotations

import builtins
import contextlib
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten
HOST_SYNCS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.is_nonzero.default,
    aten.equal.default,
}


class CaptureError(RuntimeError):
    pass


class Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_SYNCS:
            raise CaptureError(f"host sync inside a CUDA-graph capture: {func}")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


class FakeGraph:
    def __init__(self, calls: list) -> None:
        self.ops: list | None = []
        self.calls = calls

    def replay(self) -> None:
        self.calls.append("replay")
        if self.ops is None:  # not recorded (a compiled body): the capture's own run is all there is
            return
        with torch.no_grad():
            for func, args, kwargs, out in self.ops:
                new = func(*args, **kwargs)
                for o, n in zip(tree_flatten(out)[0], tree_flatten(new)[0], strict=True):
                    if isinstance(o, torch.Tensor) and not same_memory(o, n):
                        o.copy_(n)


class FakeStream:
    def __init__(self, calls: list, name: str) -> None:
        self.calls, self.name = calls, name

    def wait_stream(self, other: FakeStream) -> None:
        self.calls.append(f"{self.name} waits for {other.name}")


class FakeCuda:
    """The `cuda` argument of perf/graphs.CudaBackend."""

    def __init__(self, record: bool = True) -> None:
        self.record = record  # False: torch.compile'd bodies, which run under no dispatch mode
        self.calls: list[str] = []
        self.capturing = False
        self.main = FakeStream(self.calls, "main")

    def Stream(self, device=None) -> FakeStream:  # noqa: N802 (torch.cuda's name)
        return FakeStream(self.calls, "side")

    def graph_pool_handle(self) -> str:
        return "pool"

    def current_stream(self) -> FakeStream:
        return self.main

    def synchronize(self) -> None:
        assert not self.capturing, "synchronize inside a capture"
        self.calls.append("synchronize")

    @contextlib.contextmanager
    def stream(self, s: FakeStream):
        self.calls.append(f"on {s.name}")
        yield

    def CUDAGraph(self) -> FakeGraph:  # noqa: N802
        return FakeGraph(self.calls)

    @contextlib.contextmanager
    def graph(self, g: FakeGraph, pool=None, stream=None, capture_error_mode="global"):
        self.calls.append("capture")
        original, depth = builtins.__import__, [0]

        def no_new_imports(name, globals=None, locals=None, fromlist=(), level=0):
            before = set(sys.modules)
            depth[0] += 1
            try:
                module = original(name, globals, locals, fromlist, level)
            finally:
                depth[0] -= 1
            new = set(sys.modules) - before
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if new and depth[0] == 0 and not caller.startswith("torch"):  # torch's lazy imports are its own
                raise CaptureError(f"import of {name} inside a CUDA-graph capture (loads {sorted(new)[:3]})")
            return module

        recorder = Recorder() if self.record else contextlib.nullcontext()
        builtins.__import__ = no_new_imports
        self.capturing = True
        try:
            with recorder:
                yield
        finally:
            self.capturing = False
            builtins.__import__ = original
        if self.record:
            g.ops = recorder.ops
            poison(recorder.ops)
        else:
            g.ops = None


def poison(ops: list) -> None:
    """NaN into every floating tensor the capture created (not the inputs it read or wrote in place)."""
    outside: set[int] = set()
    made: dict[int, torch.Tensor] = {}
    for _, args, kwargs, out in ops:
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in made:
                outside.add(t.untyped_storage().data_ptr())
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t._is_view():
                made.setdefault(t.untyped_storage().data_ptr(), t)
    with torch.no_grad():
        for ptr, t in made.items():
            if ptr not in outside and t.is_floating_point() and t.numel():
                t.fill_(float("nan"))


def same_memory(a: torch.Tensor, b: object) -> bool:
    return isinstance(b, torch.Tensor) and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
