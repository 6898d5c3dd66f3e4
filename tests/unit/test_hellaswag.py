"""HellaSwag: download through huggingface_hub from a local stand-in Hub (no network), and scoring
checked against an independent per-ending computation (one sequence at a time, log-softmax by hand)."""

import json

import pytest
import torch

from speedrun.config import ModelConfig
from speedrun.data.tokenizers import gpt2_tokenizer
from speedrun.errors import DataError
from speedrun.model.families import build_model
from speedrun.recipes import load_recipe
from speedrun.tools.hellaswag import PARQUET_FILE, download_hellaswag, evaluate_hellaswag, read_examples
from tests.unit.test_fineweb import REPO, StandInHub

EXAMPLES = [
    {
        "ind": 4,
        "activity_label": "Removing ice from car",
        "ctx": "Then, the man writes over the snow covering the window of a car, and a woman smiles.",
        "endings": [
            ", the man adds wax to the windshield.",
            ", a person board a ski lift.",
            ", the man puts on a christmas coat.",
            ", the man continues removing the snow on his car.",
        ],
        "label": "3",
    },
    {
        "ind": 9,
        "activity_label": "Baking cookies",
        "ctx": "A woman mixes flour and sugar in a bowl. She",
        "endings": ["adds two eggs.", "drives to work.", "paints the fence blue.", "sings to the dog."],
        "label": "0",
    },
    {
        "ind": 12,
        "activity_label": "Playing guitar",
        "ctx": "A boy sits on a chair holding a guitar. He",
        "endings": ["tunes the strings.", "eats the guitar.", "flies away.", "starts strumming a song."],
        "label": "3",
    },
]


def _parquet_bytes(tmp_path, rows) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "v.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path.read_bytes()


@pytest.fixture
def hub():
    hub = StandInHub()
    yield hub
    hub.close()


def test_download_writes_the_original_jsonl_format(hub, tmp_path):
    hub.files[PARQUET_FILE] = _parquet_bytes(tmp_path, EXAMPLES)
    out = download_hellaswag(tmp_path / "hs", repo_id=REPO, endpoint=hub.url, log=lambda *_: None)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["ctx"] for r in rows] == [e["ctx"] for e in EXAMPLES]
    assert [r["label"] for r in rows] == [3, 0, 3]  # string labels of the Hub copy become ints
    assert rows[0]["endings"] == EXAMPLES[0]["endings"]
    assert read_examples(out) == rows
    assert sorted(p.name for p in (tmp_path / "hs").iterdir()) == ["hellaswag_val.jsonl"]  # no leftovers


def test_download_failures_are_data_errors_and_leave_nothing(hub, tmp_path):
    with pytest.raises(DataError, match="cannot download"):
        download_hellaswag(tmp_path / "hs", repo_id=REPO, endpoint=hub.url, log=lambda *_: None)
    hub.files[PARQUET_FILE] = b"not parquet at all"
    with pytest.raises(DataError, match="not a readable parquet"):
        download_hellaswag(tmp_path / "hs", repo_id=REPO, endpoint=hub.url, log=lambda *_: None)
    assert list((tmp_path / "hs").iterdir()) == []


def test_bad_example_lines_are_named(tmp_path):
    path = tmp_path / "h.jsonl"
    path.write_text(json.dumps({"ctx": "a", "endings": ["x", "y"], "label": 0}) + "\n")
    with pytest.raises(DataError, match=r"h.jsonl:1: not a HellaSwag example"):
        read_examples(path)


def _reference_scores(model, tok, ex):
    """Mean and summed loss of each ending, one unpadded sequence at a time."""
    means, sums = [], []
    ctx = [tok.eot_id, *tok.encode(ex["ctx"])]
    for ending in ex["endings"]:
        end = tok.encode(" " + ending)
        seq = torch.tensor(ctx + end)
        with torch.no_grad():
            logp = torch.log_softmax(model(seq[None])[0, :, : tok.vocab_size].double(), dim=-1)
        nll = [-logp[len(ctx) - 1 + i, t].item() for i, t in enumerate(end)]
        sums.append(sum(nll))
        means.append(sum(nll) / len(nll))
    return means, sums


def test_scores_match_an_independent_computation(tmp_path):
    cfg = load_recipe("demo", ["data.tokenizer=gpt2", "train.dtype=fp32"])
    cfg.model = ModelConfig(
        **{
            **cfg.model.__dict__,
            "vocab_size": 50257,
            "n_layer": 2,
            "n_embd": 32,
            "n_head": 2,
            "max_seq_len": 64,
        }
    )
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    tok = gpt2_tokenizer()
    path = tmp_path / "h.jsonl"
    path.write_text("".join(json.dumps({**e, "label": int(e["label"])}) + "\n" for e in EXAMPLES))
    result = evaluate_hellaswag(model, cfg, tok, path)
    acc = acc_norm = 0
    for ex in EXAMPLES:
        means, sums = _reference_scores(model, tok, ex)
        acc_norm += min(range(4), key=means.__getitem__) == int(ex["label"])
        acc += min(range(4), key=sums.__getitem__) == int(ex["label"])
    assert result == {"examples": 3, "acc": acc / 3, "acc_norm": acc_norm / 3}


def test_batched_ending_losses_equal_the_reference(tmp_path):
    from speedrun.tools.hellaswag import ending_losses, example_batch

    cfg = ModelConfig(vocab_size=50257, n_layer=2, n_embd=32, n_head=2, max_seq_len=64)
    torch.manual_seed(1)
    model = build_model(cfg).eval()
    tok = gpt2_tokenizer()
    ex = EXAMPLES[0]
    tokens, mask, _ = example_batch(ex, tok, 64)
    summed, mean = ending_losses(model, tokens, mask)
    means, sums = _reference_scores(model, tok, ex)
    torch.testing.assert_close(mean.double(), torch.tensor(means, dtype=torch.float64), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(summed.double(), torch.tensor(sums, dtype=torch.float64), rtol=1e-4, atol=1e-4)


def test_only_gpt2_tokenized_models_are_scored(tmp_path):
    from speedrun.data.tokenizers import train_bpe_tokenizer

    cfg = load_recipe("demo")
    bpe = train_bpe_tokenizer(["some text for a tiny vocabulary"] * 20, 300)
    with pytest.raises(DataError, match="only for GPT-2-tokenized"):
        evaluate_hellaswag(build_model(ModelConfig(n_layer=1, n_embd=32, n_head=2)), cfg, bpe, tmp_path / "x")


def test_eval_hellaswag_command_on_a_gpt2_checkpoint(tmp_path, capsys):
    from speedrun.cli import main
    from speedrun.train.run.checkpoint import save_checkpoint

    small = ["model.vocab_size=50257", "model.n_layer=1", "model.n_embd=32", "model.n_head=2"]
    cfg = load_recipe("demo", ["data.tokenizer=gpt2", "train.dtype=fp32", *small])
    torch.manual_seed(2)
    model = build_model(cfg.model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    ckpt = save_checkpoint(tmp_path / "run", 5, model, {"step": 5}, cfg.to_dict(), keep=0)
    path = tmp_path / "h.jsonl"
    path.write_text("".join(json.dumps({**e, "label": int(e["label"])}) + "\n" for e in EXAMPLES))
    assert main(["eval", str(ckpt), "--hellaswag", str(path), "--limit", "2", "--device", "cpu"]) == 0
    expected = evaluate_hellaswag(model.eval(), cfg, gpt2_tokenizer(), path, limit=2)
    out = capsys.readouterr().out
    assert out.startswith(
        f"hellaswag: 2 examples | acc {expected['acc']:.4f} | acc_norm {expected['acc_norm']:.4f}"
    )
