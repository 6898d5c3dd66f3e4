"""Peak host memory of the CPU attention tiers at a long sequence with a short window.

The blocked tier (model/gpt2026/attention_tiers.py) gives each block of queries only the keys it can see, so
its memory grows with T·window; the dense reference builds a T × T mask and T × T scores. Each variant
runs in a fresh process and reports how far its peak resident memory (ru_maxrss) rose above the
level after its inputs were allocated.

    python benchmarks/bench_attention_memory.py [--T 8192] [--window 512] [--heads 4] [--dim 64] [--backward]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/ holds the dense reference


def measure(variant: str, T: int, window: int, heads: int, dim: int, backward: bool) -> dict:
    import torch
    from tests.model_refs import dense_reference

    from speedrun.model.gpt2026 import attention_tiers as tiers

    torch.manual_seed(0)
    q, k, v = (torch.randn(T, heads, dim, requires_grad=backward) for _ in range(3))
    cu = torch.tensor([0, T // 3, T // 3 + 100, T], dtype=torch.int32)
    fn = tiers.blocked_attention if variant == "blocked" else dense_reference
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with torch.set_grad_enabled(backward):
        out = fn(q, k, v, cu, window, 0.12)
        if backward:
            out.square().sum().backward()
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"variant": variant, "peak_rise_mib": round((peak - base) / 1024, 1), "seconds": round(seconds, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--backward", action="store_true")
    p.add_argument("--variant", choices=["blocked", "dense"])  # internal: one measurement in this process
    a = p.parse_args()
    if a.variant:
        print(json.dumps(measure(a.variant, a.T, a.window, a.heads, a.dim, a.backward)))
        return
    common = [f"--T={a.T}", f"--window={a.window}", f"--heads={a.heads}", f"--dim={a.dim}"]
    common += ["--backward"] if a.backward else []
    print(f"T={a.T} window={a.window} heads={a.heads} dim={a.dim} backward={a.backward}")
    for variant in ("blocked", "dense"):
        out = subprocess.run(
            [sys.executable, __file__, f"--variant={variant}", *common], capture_output=True, text=True
        )
        print(out.stdout.strip() or out.stderr.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
