"""The demo against what a user would pick instead: LitGPT's `litgpt pretrain`, same data, same clock.

Both systems train a model of the demo's size (4 layers, width 256, 4 heads, sequence 256, 8,192 tokens
a step, vocabulary bpe:4096) on the same wiki-vital documents for the same training time (the demo's
`--budget`, 150 s; LitGPT gets what the demo really trained, which a busy host makes longer), and ONE
evaluator written here scores every checkpoint of both: bits per byte = summed token NLL (nats, fp64)
/ ln 2 / UTF-8 bytes of the val documents. The table gives steps, tokens, train seconds, final val bpb,
and how long each system took to reach the worse system's final bpb (interpolated on the checkpoints).

  speedrun: `speedrun train` (the demo, no recipe) with a checkpoint every --every steps, at the recipe's
            size (no host-fit shrinking); seconds are its own `time_s` (timed training: no compile,
            warm-up or validation, checkpoints), plus its first 4 steps, trained but not on its
            clock, at its median step time.
  litgpt:   `litgpt pretrain` on a Llama-style model of the demo's size (RMSNorm, rotary, SwiGLU MLP with
            the demo MLP's parameter count, untied head), AdamW with warm-up and cosine decay, the
            precision the demo resolved (bf16-mixed or 32-true). Its data are the demo's own tokens
            (the same documents, re-split from the source and checked token for token against the
            demo's shards) written as LitData chunks for `litgpt.data.LitData`. LitGPT has no time
            budget (TrainArgs.max_time is not read by pretrain in 0.5.x), so a short calibration run
            measures its step time and `train.max_tokens` is set to what fits the demo's clock; it
            always compiles; its seconds are its logged clock minus the first iterations' compile
            excess and the checkpoint saves.

Benchmark-only requirement (not a dependency of the package): LitGPT with LitData in a separate venv
that sees this environment's torch, e.g.

    python -m venv --system-site-packages /work/venvs/litgpt
    /work/venvs/litgpt/bin/pip install litgpt litdata "torch==2.13.0"   # the torch this env has
    PYTHONPATH=src /work/venvs/litgpt/bin/python benchmarks/bench_peers.py --out /tmp/peers --json peers.json

(pip may pull a CUDA torch with torchvision into the venv: uninstall torch/torchvision/triton/nvidia-*
there so the venv uses the global torch.)
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

SYSTEMS = ("speedrun", "litgpt")
EVAL_ROWS = 8  # rows of seq_len per forward in the evaluator
CALIBRATION_STEPS = 10  # litgpt's step time: the median of these after the first 4 (compiling)
Logits = Callable[[torch.Tensor], torch.Tensor]  # (B, T) token ids -> (B, T, V) logits


class BenchError(Exception):
    """A failure the script reports in one line (exit 1)."""


# ------------------------------------------------------------------------------------------ evaluator


@dataclass
class Score:
    nll_nats: float  # summed over every scored target
    tokens: int
    bytes: int  # UTF-8 bytes of the scored targets (the end-of-text token has none)
    bpb: float


@torch.no_grad()
def score_stream(
    logits_fn: Logits,
    stream: np.ndarray,
    token_bytes: np.ndarray,
    seq_len: int,
    max_tokens: int | None = None,
) -> Score:
    """Bits per byte of a model over a token stream laid out as the val shards are (each document preceded
    by end-of-text): rows of `seq_len` inputs at stride `seq_len`, so every token after the first is a
    target exactly once (the last row may be shorter). `logits_fn(x)` maps (B, T) ids to (B, T, V) logits;
    the NLL is computed here in fp64, not by either system's loss."""
    n = len(stream) - 1 if max_tokens is None else min(max_tokens, len(stream) - 1)
    assert n > 0, "nothing to score"
    ids = torch.from_numpy(stream[: n + 1].astype(np.int64))
    nll, rows = 0.0, [(a, min(a + seq_len, n)) for a in range(0, n, seq_len)]
    full = [r for r in rows if r[1] - r[0] == seq_len]
    groups = [full[i : i + EVAL_ROWS] for i in range(0, len(full), EVAL_ROWS)] + [
        [r] for r in rows[len(full) :]
    ]
    for group in groups:
        x = torch.stack([ids[a:b] for a, b in group])
        y = torch.stack([ids[a + 1 : b + 1] for a, b in group])
        logits = logits_fn(x).double()
        nll += float(F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum"))
    n_bytes = int(token_bytes[stream[1 : n + 1]].sum())
    return Score(nll, n, n_bytes, nll / math.log(2) / n_bytes)


def speedrun_logits(checkpoint: Path) -> Logits:
    """The speedrun model of a run or checkpoint (the package's load_model), as a logits function in fp32."""
    from speedrun.tools.runs import load_model

    model, _, _ = load_model(checkpoint, "cpu")
    return lambda x: model(x)


def litgpt_logits(checkpoint: Path) -> Logits:
    """A LitGPT checkpoint folder (`lit_model.pth` + `model_config.yaml`) as a logits function in fp32."""
    from litgpt.config import Config
    from litgpt.model import GPT

    model = GPT(Config.from_file(checkpoint / "model_config.yaml"))
    state = torch.load(checkpoint / "lit_model.pth", map_location="cpu", weights_only=False)
    weights = {k.removeprefix("_orig_mod."): v for k, v in state.get("model", state).items()}
    model.load_state_dict(weights)
    model.eval()
    return lambda x: model(x)


# -------------------------------------------------------------------------------------------- the data


def split_documents(data_dir: Path) -> tuple[dict, list[str], list[str], object]:
    """(meta, train docs, val docs, tokenizer) of a prepared folder, re-split from its source with its
    seed and val fraction, and checked token for token against its shards: the same documents."""
    from speedrun.data.meta import load_meta, shard_paths, tokenizer_for_data
    from speedrun.data.pipeline import assign_splits
    from speedrun.data.shards import open_shard
    from speedrun.data.sources import iter_documents

    meta = load_meta(data_dir)
    tok = tokenizer_for_data(data_dir, meta)
    docs: dict[bool, list[str]] = {False: [], True: []}
    for doc, is_val in assign_splits(iter_documents(meta["source"]), meta["val_fraction"], meta["seed"]):
        docs[is_val].append(doc)
    for split, texts in (("train", docs[False]), ("val", docs[True])):
        shards = np.concatenate([np.asarray(open_shard(p)) for p in shard_paths(data_dir, split, meta)])
        if not np.array_equal(shards, document_stream(texts, tok)):
            raise BenchError(
                f"{data_dir}: the {split} documents re-split from {meta['source']} differ from its shards"
            )
    return meta, docs[False], docs[True], tok


def document_stream(docs: list[str], tok) -> np.ndarray:
    """Token ids of `docs`, each preceded by end-of-text, as `speedrun prepare` writes them."""
    parts = [np.asarray([tok.eot_id, *ids], dtype=np.int64) for ids in map(tok.encode, docs)]
    return np.concatenate(parts)


def _litdata_items(path: str):
    yield torch.from_numpy(np.load(path).astype(np.int32))


def export_litdata(stream: np.ndarray, folder: Path, seq_len: int) -> None:
    """A token stream as LitData chunks of blocks of seq_len + 1 (what `litgpt.data.LitData` reads)."""
    from litdata import optimize
    from litdata.streaming import TokensLoader

    folder.mkdir(parents=True, exist_ok=True)
    src = folder.with_suffix(".npy")
    np.save(src, stream.astype(np.int32))
    optimize(
        fn=_litdata_items,
        inputs=[str(src)],
        output_dir=str(folder),
        num_workers=1,
        chunk_bytes="50MB",
        item_loader=TokensLoader(block_size=seq_len + 1),
    )


# --------------------------------------------------------------------------------------- the systems


def run(cmd: list[str], cwd: Path, log: Path) -> None:
    """Run a training command, its output to `log`; a failure ends the benchmark in one line."""
    with open(log, "w") as f:
        code = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT).returncode
    if code != 0:
        tail = (log.read_text().strip().splitlines() or [""])[-1]
        raise BenchError(f"{cmd[0]} {' '.join(cmd[1:3])} failed (exit {code}, see {log}): {tail[:200]}")


def train_speedrun(out: Path, budget: float, every: int) -> Path:
    """The demo (`speedrun train`, no recipe) with checkpoints every `every` steps and at the end, at the
    recipe's size: `budget_min_steps=0` keeps a busy host from shrinking batch and width (host fit), so
    both systems train the same model size whatever the load."""
    run_dir = out / "speedrun"
    cmd = [
        sys.executable,
        "-m",
        "speedrun",
        "train",
        "--out",
        str(run_dir),
        f"train.time_budget_s={budget:g}",
        "train.budget_min_steps=0",
        f"train.checkpoint_every={every}",
        "train.checkpoint_keep=0",
        "train.checkpoint_at_end=true",
    ]
    run(cmd, out, out / "speedrun.log")
    return run_dir


def speedrun_curve(run_dir: Path) -> list[dict]:
    """(step, tokens, seconds, checkpoint) of every checkpoint. Seconds: the run's own time_s, plus its
    first `train.timing_warmup_steps` steps, which it trains but leaves off its clock (time_s 0), counted
    at its median step time: as LitGPT's first iterations are counted (`litgpt_seconds`)."""
    from speedrun.train.run.checkpoint import checkpoint_step, list_checkpoints

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in records if "time_s" in r and "train_loss" in r}
    untimed = [s for s, r in train.items() if r["time_s"] == 0]
    timed_ms = [r["step_ms"] for r in train.values() if r["time_s"] > 0 and "step_ms" in r]
    median_s = statistics.median(timed_ms) / 1000 if timed_ms else 0.0
    batch = json.loads((run_dir / "config.json").read_text())["train"]["global_batch_tokens"]
    points = []
    for ckpt in list_checkpoints(run_dir):
        step = checkpoint_step(ckpt)
        seconds = train[step]["time_s"] + median_s * sum(1 for s in untimed if s <= step)
        points.append({"step": step, "tokens": step * batch, "seconds": seconds, "checkpoint": str(ckpt)})
    return points


def litgpt_config(
    out: Path, data: Path, model: dict, batch: int, steps: int, every: int, precision: str, lr: float
) -> Path:
    """A `litgpt pretrain --config` file: the demo's size and batch (`batch` sequences), AdamW, warm-up
    10% then cosine to lr/10."""
    config = {
        "model_name": "speedrun-demo-size",
        "model_config": model,
        "out_dir": str(out),
        "precision": precision,
        "data": {
            "class_path": "litgpt.data.LitData",
            "init_args": {"data_path": str(data), "split_names": ["train", "val"], "num_workers": 1},
        },
        "train": {
            "save_interval": every,
            "log_interval": 1,
            "global_batch_size": batch,
            "micro_batch_size": batch,
            "max_tokens": steps * batch * model["block_size"],
            "max_norm": 1.0,
            "lr_warmup_steps": max(1, steps // 10),
            "min_lr": lr / 10,
            "tie_embeddings": False,
            "max_seq_length": model["block_size"],
        },
        "eval": {"interval": 10**9, "max_iters": 2, "initial_validation": False, "final_validation": False},
        "optimizer": {
            "class_path": "torch.optim.AdamW",
            "init_args": {"lr": lr, "weight_decay": 0.1, "betas": [0.9, 0.95]},
        },
        "devices": 1,
        "logger_name": "csv",
        "seed": 1337,
    }
    path = out.with_suffix(".json")
    path.write_text(json.dumps(config, indent=1))
    return path


def demo_size(speedrun_cfg: dict) -> dict:
    """A LitGPT model config of the demo run's size: same layers, width, heads, context and vocabulary;
    the SwiGLU hidden width gives the demo's ReLU² MLP parameter count (3 matrices instead of 2)."""
    m = speedrun_cfg["model"]
    hidden = round(4 * m["n_embd"] * 2 / 3 / 8) * 8
    return {
        "name": "speedrun-demo-size",
        "block_size": speedrun_cfg["train"]["seq_len"],
        "vocab_size": m["vocab_size"],
        "padded_vocab_size": m["vocab_size"],
        "padding_multiple": 128,
        "n_layer": m["n_layer"],
        "n_head": m["n_head"],
        "n_embd": m["n_embd"],
        "n_query_groups": m["n_head"],
        "rotary_percentage": 1.0,
        "parallel_residual": False,
        "bias": False,
        "norm_class_name": "RMSNorm",
        "mlp_class_name": "LLaMAMLP",
        "intermediate_size": hidden,
    }


def litgpt_log(out: Path) -> list[dict]:
    rows = list(csv.DictReader(open(next(out.glob("logs/csv/version_*/metrics.csv")))))
    return [r for r in rows if r.get("iter_time")]


def litgpt_seconds(rows: list[dict], save_every: int) -> dict[int, float]:
    """Seconds of training at each optimizer step (one iteration each: no accumulation): the logged clock
    minus what the first 4 iterations took beyond the median iteration (compilation: the demo compiles
    before its clock starts) and minus the checkpoint saves (the demo's clock stops for them): the gap
    after a save step beyond the median gap between iterations."""
    steps = [int(r["iter"]) for r in rows]
    clock = [float(r["time"]) for r in rows]
    iters = [float(r["iter_time"]) for r in rows]
    median = statistics.median(iters)
    compile_s = sum(max(0.0, t - median) for t in iters[:4])
    overhead = [clock[i] - clock[i - 1] - iters[i] for i in range(1, len(rows))]
    usual = statistics.median(overhead) if overhead else 0.0
    seconds, saves = {}, 0.0
    for i, step in enumerate(steps):
        if i > 0 and steps[i - 1] % save_every == 0:
            saves += max(0.0, overhead[i - 1] - usual)
        seconds[step] = clock[i] - compile_s - saves
    return seconds


def train_litgpt(
    out: Path,
    data: Path,
    cfg: dict,
    dtype: str,
    budget: float,
    lr: float,
    steps: int | None,
    every: int,
    exe: str,
) -> Path:
    """Calibrate the step time (unless `steps` is given), then pretrain for what fits `budget`, in the
    precision the demo trained in (`dtype`: bf16 or fp32)."""
    precision = "bf16-mixed" if dtype == "bf16" else "32-true"
    model = demo_size(cfg)
    batch = cfg["train"]["global_batch_tokens"] // model["block_size"]
    if steps is None:
        probe = out / "litgpt-calibrate"
        config = litgpt_config(probe, data, model, batch, CALIBRATION_STEPS, 10**9, precision, lr)
        run([exe, "pretrain", "--config", str(config)], out, out / "litgpt-calibrate.log")
        step_s = statistics.median(float(r["iter_time"]) for r in litgpt_log(probe)[4:])
        steps = max(1, int(budget / step_s))
    target = out / "litgpt"
    config = litgpt_config(target, data, model, batch, steps, every, precision, lr)
    run([exe, "pretrain", "--config", str(config)], out, out / "litgpt.log")
    return target


def litgpt_curve(out: Path) -> list[dict]:
    config = json.loads(out.with_suffix(".json").read_text())["train"]
    seconds = litgpt_seconds(litgpt_log(out), config["save_interval"])
    points = []
    for ckpt in sorted(out.glob("step-*")) + [out / "final"]:
        step = max(seconds) if ckpt.name == "final" else int(ckpt.name.split("-")[1])
        if not points or points[-1]["step"] != step:
            points.append(
                {
                    "step": step,
                    "tokens": step * config["global_batch_size"] * config["max_seq_length"],
                    "seconds": seconds[step],
                    "checkpoint": str(ckpt),
                }
            )
    return points


# ---------------------------------------------------------------------------------------- the report


def time_to(curve: list[dict], bpb: float) -> float | None:
    """Seconds until the curve first reaches `bpb`, linear between checkpoints (the first checkpoint's
    time when it is already there); None when it never does."""
    for i, p in enumerate(curve):
        if p["bpb"] <= bpb:
            if i == 0:
                return p["seconds"]
            q = curve[i - 1]
            return q["seconds"] + (p["seconds"] - q["seconds"]) * (q["bpb"] - bpb) / (q["bpb"] - p["bpb"])
    return None


def report(curves: dict[str, list[dict]]) -> dict:
    """Per system: steps, tokens, seconds, final bpb, and the time to the worse system's final bpb, with
    its ratio to the fastest system's time (> 1: slower). `at_first_point`: the system was already there
    at its first scored checkpoint, so its time is an upper bound (and the others' ratios lower bounds)."""
    target = max(c[-1]["bpb"] for c in curves.values())
    rows = {
        name: {
            **{k: c[-1][k] for k in ("step", "tokens", "seconds", "bpb")},
            "time_to_target": time_to(c, target),
            "at_first_point": c[0]["bpb"] <= target,
        }
        for name, c in curves.items()
    }
    best = min(r["time_to_target"] for r in rows.values())
    for r in rows.values():
        r["ratio"] = r["time_to_target"] / best
    return {"target_bpb": target, "systems": rows}


def print_table(result: dict) -> None:
    print(
        f"time to bpb {result['target_bpb']:.4f} (the worse final bpb), one evaluator over all val documents"
    )
    head = ("system", "steps", "tokens", "train s", "val bpb", "s to target", "ratio")
    print(f"{head[0]:<10} {head[1]:>6} {head[2]:>10} {head[3]:>8} {head[4]:>8} {head[5]:>11} {head[6]:>7}")
    rows = result["systems"].values()
    bound = min(rows, key=lambda r: r["time_to_target"])["at_first_point"]  # the fastest time is at most
    for name, r in result["systems"].items():
        at_most = "<=" if r["at_first_point"] else ""
        at_least = ">=" if bound and r["ratio"] > 1 else ""
        print(
            f"{name:<10} {r['step']:>6} {r['tokens']:>10,} {r['seconds']:>8.1f} {r['bpb']:>8.4f} "
            f"{at_most + format(r['time_to_target'], '.1f'):>11} {at_least + format(r['ratio'], '.2f'):>7}"
        )


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the command line, in one line (None: nothing)."""
    systems = args.systems.split(",")
    if "speedrun" not in systems or any(s not in SYSTEMS for s in systems):
        return f"--systems {args.systems}: name speedrun and any of {', '.join(SYSTEMS)}, comma-separated"
    if args.budget <= 0 or args.every < 1 or args.points < 1 or (args.litgpt_steps or 1) < 1:
        return "--budget, --every, --points and --litgpt-steps must be positive"
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        return f"--out {args.out}: exists and is not an empty folder"
    if args.speedrun_run is not None and not (args.speedrun_run / "metrics.jsonl").is_file():
        return f"--speedrun-run {args.speedrun_run}: not a finished run folder (no metrics.jsonl)"
    if "litgpt" in systems and not Path(args.litgpt).is_file():
        return f"--litgpt {args.litgpt}: not found (install litgpt and litdata: see the script's docstring)"
    return None


def evenly(points: list[dict], n: int) -> list[dict]:
    """At most `n` of `points`, evenly spaced, the last always kept."""
    if len(points) <= n:
        return points
    picks = (
        {len(points) - 1 - round(i * (len(points) - 1) / (n - 1)) for i in range(n)}
        if n > 1
        else {len(points) - 1}
    )
    return [p for i, p in enumerate(points) if i in picks]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated: speedrun,litgpt")
    p.add_argument("--budget", type=float, default=150.0, help="the demo's time budget, s (default 150)")
    p.add_argument("--out", type=Path, required=True, help="work folder (new or empty)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--speedrun-run", type=Path, help="score this finished demo run instead of training one")
    p.add_argument("--every", type=int, default=10, help="checkpoint every N steps (both systems)")
    p.add_argument("--points", type=int, default=5, help="checkpoints scored per system (the last included)")
    p.add_argument("--litgpt-lr", type=float, default=3e-3, help="AdamW peak learning rate")
    p.add_argument("--litgpt-steps", type=int, help="skip the calibration: train litgpt this many steps")
    p.add_argument(
        "--litgpt", default=str(Path(sys.executable).with_name("litgpt")), help="the litgpt command"
    )
    args = p.parse_args(argv)
    problem = check_args(args)
    if problem:
        print(f"bench_peers: {problem}", file=sys.stderr)
        return 2
    systems = args.systems.split(",")
    try:
        result = bench(args, systems)
    except BenchError as e:
        print(f"bench_peers: {e}", file=sys.stderr)
        return 1
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def bench(args: argparse.Namespace, systems: list[str]) -> dict:
    """Train the systems one after the other, then score every checkpoint with the one evaluator."""
    from speedrun.data.meta import default_data_dir

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.speedrun_run is None:
        print(f"training speedrun (the demo) for {args.budget:g} s ...", flush=True)
        run_dir = train_speedrun(out, args.budget, args.every)
    else:
        run_dir = args.speedrun_run.resolve()
    cfg = json.loads((run_dir / "config.json").read_text())
    data = cfg["data"]  # the demo prepares its data in the folder it runs in: the run folder's parent here
    data_dir = run_dir.parent / (data["dir"] or default_data_dir(data["source"], data["tokenizer"]))
    _, train_docs, val_docs, tok = split_documents(data_dir)
    val = document_stream(val_docs, tok)
    demo = speedrun_curve(run_dir)
    dtype = json.loads((run_dir / "summary.json").read_text())["precision"]["dtype"]  # config.json: "auto"
    checkpoints = {"speedrun": (demo, speedrun_logits)}
    if "litgpt" in systems:
        for split, docs in (("train", train_docs), ("val", val_docs)):
            export_litdata(document_stream(docs, tok), out / "litdata" / split, cfg["train"]["seq_len"])
        clock = demo[-1]["seconds"]  # the demo's clock, not --budget: a busy host makes it overrun
        print(f"training litgpt for {clock:.0f} s, the demo's training time ...", flush=True)
        lit = train_litgpt(
            out,
            out / "litdata",
            cfg,
            dtype,
            clock,
            args.litgpt_lr,
            args.litgpt_steps,
            args.every,
            args.litgpt,
        )
        checkpoints["litgpt"] = (litgpt_curve(lit), litgpt_logits)
    token_bytes = np.asarray(tok.token_byte_lengths(), dtype=np.int64)
    val_bytes = sum(len(d.encode("utf-8")) for d in val_docs)
    curves = {}
    for name, (points, load) in checkpoints.items():
        points = evenly(points, args.points)
        for point in points:
            s = score_stream(load(Path(point["checkpoint"])), val, token_bytes, cfg["train"]["seq_len"])
            assert s.bytes == val_bytes, (s.bytes, val_bytes)  # every byte of every val document scored
            point.update(bpb=s.bpb, nll_nats=s.nll_nats)
            print(f"  {name} step {point['step']}: {point['seconds']:.1f} s, val bpb {s.bpb:.4f}", flush=True)
        curves[name] = points
    result = report(curves)
    result.update(
        curves=curves,
        val={"documents": len(val_docs), "tokens": len(val) - 1, "bytes": val_bytes},
        budget_s=args.budget,
        dtype=dtype,
        litgpt_lr=args.litgpt_lr,
        host=host_facts(),
    )
    return result


def host_facts() -> dict:
    """What the numbers depend on: CPU, load, versions, commit."""
    import platform

    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
        platform.processor(),
    )
    git = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
    )
    facts = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "torch": torch.__version__,
        "commit": git.stdout.strip() or None,
    }
    try:
        import importlib.metadata as md

        facts["litgpt"] = md.version("litgpt")
    except Exception:
        facts["litgpt"] = None
    return facts


if __name__ == "__main__":
    sys.exit(main())
