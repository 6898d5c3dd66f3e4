"""The GPU kit's A/B line for a CUDA-graph way: a `speedrun bench --json` run with SPEEDRUN_GRAPHS=WAY
against the plain run of the same recipe and stage (benchmarks/gpu_check.sh's part 1), read from their
JSON files. Prints one line per stage both timed:

    graphs WAY RECIPE stage N: X ms/step with graphs, Y ms/step plain, plain/graphs Z

(above 1: the graphs win) and exits 0; a missing or unreadable file, or a graphs run whose `cuda_graphs`
line says it ran without them, prints `graphs WAY: no ratio (...)`.

    python benchmarks/graph_ratio.py PLAIN.json GRAPHS.json WAY
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def ratio_lines(plain: dict, graphs: dict, way: str) -> list[str]:
    line = graphs.get("cuda_graphs", "")
    if not line.startswith(f"CUDA graphs: {way} "):  # the arm fell back to the plain step: no A/B
        return [f"graphs {way}: no ratio (the bench ran without them: {line or 'no cuda_graphs entry'})"]
    base = {s["stage"]: s for s in plain["stages"]}
    out = []
    for s in graphs["stages"]:
        b = base.get(s["stage"])
        if b is None:
            continue
        out.append(
            f"graphs {way} {graphs['recipe']} stage {s['stage']}: {s['step_ms']:.1f} ms/step with graphs, "
            f"{b['step_ms']:.1f} ms/step plain, plain/graphs {b['step_ms'] / s['step_ms']:.3f}"
        )
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: graph_ratio.py PLAIN.json GRAPHS.json WAY", file=sys.stderr)
        return 2
    plain_path, graphs_path, way = argv
    try:
        plain, graphs = (json.loads(Path(p).read_text()) for p in (plain_path, graphs_path))
        lines = ratio_lines(plain, graphs, way)
    except (OSError, ValueError, KeyError) as e:
        print(f"graphs {way}: no ratio ({type(e).__name__}: {e})", flush=True)
        return 0
    for line in lines or [f"graphs {way}: no ratio (no stage timed in both)"]:
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
