"""HellaSwag: download the validation set and score a GPT-2-tokenized model on it.

`speedrun prepare hellaswag` fetches `Rowan/hellaswag`'s validation parquet and writes it atomically
as `hellaswag_val.jsonl` in the original format. Scoring is GPT-2's completion-style evaluation: after
the end-of-text token and the context, each of the 4 endings (with its leading space) is scored by the
model's loss on its tokens; `acc_norm` picks the lowest mean loss, `acc` the lowest sum."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from speedrun.atomic import write_atomic
from speedrun.config import Config
from speedrun.data.hub import hub_call
from speedrun.data.tokenizers import Tokenizer
from speedrun.errors import DataError
from speedrun.train.step import autocast, autocast_dtype

REPO_ID = "Rowan/hellaswag"
PARQUET_FILE = "data/validation-00000-of-00001.parquet"
JSONL_FILE = "hellaswag_val.jsonl"
DEFAULT_DIR = Path("data") / "hellaswag"
FIELDS = ("ind", "activity_label", "ctx", "endings", "source_id", "split", "split_type", "label")


def download_hellaswag(
    data_dir: Path = DEFAULT_DIR,
    repo_id: str = REPO_ID,
    endpoint: str | None = None,
    log: Callable[[str], object] = print,
) -> Path:
    """Fetch the validation parquet, check it and write `data_dir/hellaswag_val.jsonl`; returns its path."""
    from huggingface_hub import hf_hub_download

    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=data_dir, prefix=".download-"))
    try:
        log(f"hellaswag: {PARQUET_FILE} from dataset {repo_id}")
        fetch = partial(
            hf_hub_download, repo_id, PARQUET_FILE, repo_type="dataset", local_dir=tmp, endpoint=endpoint
        )
        path = hub_call(f"download {PARQUET_FILE}", repo_id, endpoint, fetch)
        rows = _read_parquet(Path(path))
        lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        out = data_dir / JSONL_FILE
        write_atomic(out, lines.encode("utf-8"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"hellaswag: {len(rows):,} examples in {out}")
    return out


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq

        table = pq.read_table(path)
    except ImportError:
        raise DataError("reading the HellaSwag parquet file needs pyarrow (pip install pyarrow)") from None
    except Exception as e:  # pyarrow raises ArrowInvalid and OSError for damaged files
        raise DataError(f"{path.name} is not a readable parquet file: {e}") from None
    rows = table.to_pylist()
    if not rows or any(k not in rows[0] for k in ("ctx", "endings", "label")):
        raise DataError(f"{path.name} does not hold HellaSwag examples (ctx, endings, label)")
    out = []
    for r in rows:
        row = {k: r[k] for k in FIELDS if k in r}
        row["label"] = int(row["label"])  # a string in the Hub's copy, an int in the original jsonl
        out.append(row)
    return out


def read_examples(path: Path, limit: int | None = None) -> list[dict]:
    """Examples of a HellaSwag jsonl file, checked: 4 endings and a label in 0..3 each."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: not found; run `speedrun prepare hellaswag` first")
    examples = []
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is reported like any other bad line
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ex = json.loads(line.decode("utf-8"))
                ok = (
                    isinstance(ex["ctx"], str)
                    and isinstance(ex["endings"], list)
                    and len(ex["endings"]) == 4
                    and all(isinstance(e, str) for e in ex["endings"])
                    and int(ex["label"]) in range(4)
                )
            except (ValueError, KeyError, TypeError):  # UnicodeDecodeError is a ValueError
                ok = False
            if not ok:
                raise DataError(f"{path}:{n}: not a HellaSwag example (ctx, 4 ending strings, label 0..3)")
            examples.append(ex)
            if limit is not None and len(examples) >= limit:
                break
    if not examples:  # else "0 examples, acc 0.0000", which reads like a score
        raise DataError(f"{path}: holds no HellaSwag examples")
    return examples


def example_batch(ex: dict, tokenizer: Tokenizer, max_len: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(tokens (4, T), ending mask (4, T), label): row i is [eot] + context + ending i, right-padded;
    the mask marks the ending's tokens. Over-long rows lose context tokens from the left."""
    ctx = [tokenizer.eot_id, *tokenizer.encode(ex["ctx"])]
    rows, masks = [], []
    for ending in ex["endings"]:
        end = tokenizer.encode(" " + ending)
        end = end[max(0, len(end) - (max_len - 1)) :]  # an over-long ending keeps one context token
        row = (ctx + end)[-max_len:]
        rows.append(row)
        masks.append([0] * (len(row) - len(end)) + [1] * len(end))
    width = max(map(len, rows))
    tokens = torch.zeros(4, width, dtype=torch.long)
    mask = torch.zeros(4, width, dtype=torch.bool)
    for i, (row, m) in enumerate(zip(rows, masks, strict=True)):
        tokens[i, : len(row)] = torch.tensor(row)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.bool)
    return tokens, mask, int(ex["label"])


@torch.no_grad()
def ending_losses(
    model: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed, mean) cross-entropy of each row's ending tokens; (4,) each."""
    logits = model(tokens)[:, :-1, : model.cfg.vocab_size].float()
    losses = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
    m = mask[:, 1:].float()
    summed = (losses * m).sum(dim=1)
    return summed, summed / m.sum(dim=1)


def evaluate_hellaswag(
    model: torch.nn.Module,
    cfg: Config,
    tokenizer: Tokenizer,
    path: Path,
    limit: int | None = None,
    device: torch.device | str = "cpu",
) -> dict:
    """{'examples', 'acc', 'acc_norm'} over the examples of `path` (GPT-2-tokenized models only)."""
    if tokenizer.name != "gpt2":
        raise DataError(
            f"HellaSwag is scored only for GPT-2-tokenized models; this run uses {tokenizer.name}"
        )
    device = torch.device(device)
    examples = read_examples(path, limit)
    model.eval()
    correct = correct_norm = 0
    for ex in examples:
        tokens, mask, label = example_batch(ex, tokenizer, cfg.model.max_seq_len)
        with autocast(device, autocast_dtype(cfg)):
            summed, mean = ending_losses(model, tokens.to(device), mask.to(device))
        correct += int(summed.argmin()) == label
        correct_norm += int(mean.argmin()) == label
    n = len(examples)
    return {"examples": n, "acc": correct / n if n else 0.0, "acc_norm": correct_norm / n if n else 0.0}
