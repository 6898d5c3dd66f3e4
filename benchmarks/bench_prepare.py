"""Benchmark `speedrun prepare` at scale: peak memory of the whole process tree and throughput.

Generates a corpus of `--size-mb` MB (default 1100, i.e. more than 1 GB) of realistic English: documents of
5-40 sentences drawn with a seeded generator from the bundled wiki-vital articles, written as
8 `.jsonl` files. Then, in one run:

- a plain single-process tiktoken loop (read each line, `json.loads`, `encode_ordinary`) with GPT-2;
- `speedrun prepare text:DIR` with `gpt2` and with `bpe:4096`, each with 1 and 2 workers, as a
  child process whose tree's resident memory (main + workers, summed from /proc) is sampled every
  50 ms.

Prints a Markdown table for docs/benchmarks.md and checks along the way that 1 and 2 workers give
identical shards and that prepare's token count equals the plain loop's (plus one eot per document).
Linux only (reads /proc). Run it niced on a shared machine:

    nice -n 10 python benchmarks/bench_prepare.py --size-mb 1100
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from speedrun.data.sources import iter_documents
from speedrun.data.tokenizers import gpt2_tokenizer

N_FILES = 8


def make_corpus(folder: Path, size_mb: int, seed: int = 0) -> int:
    """Write documents of 5-40 wiki-vital sentences until `size_mb` MB; returns the text bytes."""
    sentences = [
        s.strip()
        for doc in iter_documents("wiki-vital")
        for s in re.split(r"(?<=[.!?])\s+", doc)
        if len(s.strip()) > 20
    ]
    rng = np.random.default_rng(seed)
    target, written = size_mb * 1_000_000, 0
    files = [open(folder / f"part-{i:02d}.jsonl", "w", encoding="utf-8") for i in range(N_FILES)]
    try:
        while written < target:
            picks = rng.integers(0, len(sentences), size=(4096, 40))
            lengths = rng.integers(5, 41, size=4096)
            for row, n in zip(picks, lengths, strict=True):
                text = " ".join(sentences[j] for j in row[:n])
                part = files[min(N_FILES - 1, (written * N_FILES) // target)]
                part.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                written += len(text.encode("utf-8"))
    finally:
        for f in files:
            f.close()
    return written


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and all its descendants, from /proc."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2 :].split()
            p = int(entry)
            children.setdefault(int(fields[1]), []).append(p)
            rss[p] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            continue
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        total += rss.get(p, 0)
        stack.extend(children.get(p, []))
    return total


def run_prepare(corpus: Path, out: Path, tokenizer: str, workers: int) -> dict:
    cmd = [sys.executable, "-m", "speedrun", "prepare", f"text:{corpus}", "--tokenizer", tokenizer]
    cmd += ["--workers", str(workers), "--data-dir", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, tree_rss(proc.pid))
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"prepare failed with exit code {proc.returncode}")
    meta = json.loads((out / "meta.json").read_text())
    s = meta["splits"]
    return {
        "wall": wall,
        "peak": peak,
        "bytes": s["train"]["bytes"] + s["val"]["bytes"],
        "tokens": s["train"]["tokens"] + s["val"]["tokens"],
        "docs": s["train"]["documents"] + s["val"]["documents"],
        "shards": s["val"]["shards"] + s["train"]["shards"],
    }


def plain_loop(corpus: Path) -> dict:
    enc = gpt2_tokenizer().encoding
    t0 = time.perf_counter()
    n_bytes = n_tokens = n_docs = 0
    for path in sorted(corpus.glob("*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                text = json.loads(line)["text"]
                n_tokens += len(enc.encode_ordinary(text))
                n_bytes += len(text.encode("utf-8"))
                n_docs += 1
    return {"wall": time.perf_counter() - t0, "bytes": n_bytes, "tokens": n_tokens, "docs": n_docs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=1100)
    ap.add_argument("--workdir", type=Path, default=None, help="default: a temporary folder, removed after")
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-prepare-"))
    corpus = work / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        size = make_corpus(corpus, args.size_mb)
        print(f"corpus: {size / 1e6:,.0f} MB of text in {N_FILES} files ({time.perf_counter() - t0:.0f} s)")
        plain = plain_loop(corpus)
        plain_mbs = plain["bytes"] / plain["wall"] / 1e6
        print(f"plain tiktoken loop: {plain['wall']:.0f} s, {plain_mbs:.2f} MB/s, {plain['tokens']:,} tokens")
        rows = []
        for tokenizer in ("gpt2", "bpe:4096"):
            outs = {}
            for workers in (1, 2):
                out = work / f"out-{tokenizer.replace(':', '')}-w{workers}"
                r = run_prepare(corpus, out, tokenizer, workers)
                outs[workers] = (out, r)
                mbs = r["bytes"] / r["wall"] / 1e6
                rows.append((tokenizer, workers, r, mbs))
                print(
                    f"prepare {tokenizer} workers={workers}: {r['wall']:.0f} s, {mbs:.2f} MB/s "
                    f"({mbs / plain_mbs:.2f}x plain), peak tree RSS {r['peak'] / 2**20:,.0f} MiB, "
                    f"{r['tokens']:,} tokens",
                    flush=True,
                )
                if tokenizer == "gpt2":
                    assert r["bytes"] == plain["bytes"] and r["docs"] == plain["docs"]
                    assert r["tokens"] == plain["tokens"] + plain["docs"], "token count differs from tiktoken"
            (o1, r1), (o2, r2) = outs[1], outs[2]
            same = r1["shards"] == r2["shards"] and all(
                filecmp.cmp(o1 / n, o2 / n, shallow=False) for n in r1["shards"]
            )
            print(f"{tokenizer}: shards identical for 1 and 2 workers: {same}")
            assert same
            for o, _ in outs.values():
                shutil.rmtree(o)
        print("\n| tokenizer | workers | wall s | MB/s | vs plain loop | peak RSS (tree) |")
        print("|---|---|---|---|---|---|")
        print(f"| gpt2 (plain tiktoken loop) | 1 | {plain['wall']:.0f} | {plain_mbs:.2f} | 1.00x | - |")
        for tokenizer, workers, r, mbs in rows:
            print(
                f"| {tokenizer} | {workers} | {r['wall']:.0f} | {mbs:.2f} | {mbs / plain_mbs:.2f}x "
                f"| {r['peak'] / 2**20:,.0f} MiB |"
            )
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
