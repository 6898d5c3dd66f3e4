"""Run `python -m MODULE ARGS...` and write every thread's Python stack to FILE every SECONDS, so a step
that never finishes (a compile, a stall) says where it is; gpu_check.sh wraps its bench parts in it.

    python benchmarks/with_stacks.py SECONDS FILE MODULE [ARGS...]

The stacks come from a Python thread holding the GIL (`sys._current_frames`), not from faulthandler's
watchdog, which reads frames without the GIL and crashed a CUDA compile with SIGSEGV on torch 2.11."""

from __future__ import annotations

import faulthandler
import runpy
import sys
import threading
import time
import traceback


def _dump_every(seconds: float, out, began: float) -> None:
    me = threading.get_ident()
    names = {}
    while True:
        time.sleep(seconds)
        names.update({t.ident: t.name for t in threading.enumerate()})
        out.write(f"--- {time.monotonic() - began:.0f} s\n")
        for ident, frame in sys._current_frames().items():
            if ident != me:
                out.write(f"thread {names.get(ident, ident)}\n{''.join(traceback.format_stack(frame))}\n")
        out.flush()


def main() -> None:
    if len(sys.argv) < 4:
        sys.exit("usage: with_stacks.py SECONDS FILE MODULE [ARGS...]")
    seconds, path, module = float(sys.argv[1]), sys.argv[2], sys.argv[3]
    out = open(path, "w")  # open for the process's life
    faulthandler.enable(file=out)  # a real crash still leaves its stack
    threading.Thread(target=_dump_every, args=(seconds, out, time.monotonic()), daemon=True).start()
    sys.argv = [module, *sys.argv[4:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
