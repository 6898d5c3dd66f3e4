"""Bad inputs of the research tools (sample, bench, compare, eval --hellaswag) beyond the first
catalogue (docs/bad-inputs.md, second table): one stderr line and exit 1 or 2, never a traceback."""

import json
import shutil
import warnings
from pathlib import Path

import pytest

from speedrun.errors import ConfigError
from speedrun.tools.stats import below_target_test
from tests.bad_input_runs import FAST, one_line
from tests.conftest import TINY, run_speedrun

# ------------------------------------------------------------------------------------ sample / bench


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--temperature", "nan"], "--temperature must be a finite number"),
        (["--seed", str(2**70)], "--seed must be between"),
        (["--device", "meta"], "--device 'meta' is not a device this command runs on"),
    ],
)
def test_sample_refuses_numbers_and_devices_it_cannot_use(finished, extra, fragment):
    one_line(run_speedrun("sample", str(finished), "--max-tokens", "3", *extra), 2, fragment)


def test_bench_refuses_a_device_it_cannot_run_on():
    proc = run_speedrun("bench", "--device", "meta", "--steps", "1", "--warmup", "0", *TINY)
    one_line(proc, 2, "--device 'meta'")


def test_a_checkpoint_whose_config_is_not_an_object(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text("[]")
    one_line(run_speedrun("sample", str(tmp_path)), 1, "config.json", "expected a JSON object")


# ------------------------------------------------------------------------------------------ compare


def _damage(run: Path, name: str, how: bytes | str) -> None:
    """Prepend a bad line to metrics.jsonl, or set `key=json` in a JSON file (plus a key this version
    does not know in config.json, so that compare reads it as written rather than through the types)."""
    path = run / name
    if isinstance(how, bytes):
        path.write_bytes(how + b"\n" + path.read_bytes())
        return
    data = json.loads(path.read_text())
    key, value = how.split("=", 1)
    section, _, field = key.rpartition(".")
    (data[section] if section else data)[field] = json.loads(value)
    if name == "config.json":
        data["from_a_newer_version"] = 1
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    ("name", "how", "fragment"),
    [
        ("metrics.jsonl", b"[1]", "line 1 is not a metrics record"),
        ("metrics.jsonl", b'{"step": 0, "val_loss": "low"}', "val_loss must be a number"),
        ("metrics.jsonl", b'{"step": 0, "tokens": "many", "val_loss": 1}', "tokens must be an integer"),
        ("metrics.jsonl", b"\xff\xfe", "line 1 is not a metrics record"),  # not UTF-8
        ("summary.json", 'final_val_loss="3.2"', "final_val_loss must be a number"),
        ("summary.json", 'steps="3"', "steps must be an integer"),
        ("config.json", 'train.global_batch_tokens="x"', "train.global_batch_tokens must be an integer"),
    ],
)
def test_compare_of_a_run_with_damaged_files(finished, tmp_path, name, how, fragment):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    _damage(run, name, how)
    one_line(run_speedrun("compare", str(run), str(finished)), 1, str(run / name), fragment)


def test_compare_skips_a_torn_last_line_like_resume(finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 3, "val_lo')  # a kill mid-write
    proc = run_speedrun("compare", str(run))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_compare_target_and_plot_mistakes(finished, tmp_path):
    one_line(run_speedrun("compare", str(finished), "--target", "nan"), 2, "--target must be a finite")
    line = one_line(
        run_speedrun("compare", str(finished), "--plot", str(tmp_path)), 1, str(tmp_path), "folder"
    )
    assert ".tmp" not in line  # names the user's path, not our temporary file
    assert list(tmp_path.iterdir()) == []


def test_t_test_of_equal_losses_prints_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # scipy's precision-loss RuntimeWarning went to stderr
        t, p = below_target_test([3.0, 3.0], 3.28)
    assert t < 0 and p <= 0.01  # equal losses below the target: a sure (degenerate) yes


# ------------------------------------------------------------------------------------------ hellaswag

GOOD_EXAMPLE = {"ctx": "A man", "endings": ["runs.", "sits.", "eats.", "sleeps."], "label": 1}


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b"\xff\xfe not utf-8\n", "h.jsonl:1: not a HellaSwag example"),  # a traceback before
        (
            json.dumps({**GOOD_EXAMPLE, "endings": [1, 2, 3, 4]}).encode() + b"\n",
            "h.jsonl:1: not a HellaSwag",
        ),
        (b"\n\n", "h.jsonl: holds no HellaSwag examples"),  # "0 examples | acc 0.0000" before
    ],
)
def test_hellaswag_files_that_are_not_examples(tmp_path, content, fragment):
    from speedrun.errors import DataError
    from speedrun.tools.hellaswag import read_examples

    path = tmp_path / "h.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError, match=fragment):
        read_examples(path)


def test_hellaswag_ending_longer_than_the_model_context():
    """A small model (max_seq_len 8) and a long ending: a tensor shape error before; now the ending
    keeps its last tokens after one context token, and the mask covers exactly them."""
    from speedrun.data.tokenizers import gpt2_tokenizer
    from speedrun.tools.hellaswag import example_batch

    tok = gpt2_tokenizer()
    long_ending = "and then " * 10
    tokens, mask, label = example_batch({**GOOD_EXAMPLE, "endings": [long_ending] * 4}, tok, max_len=8)
    end = tok.encode(" " + long_ending)[-7:]
    assert tokens.shape == (4, 8) and label == 1
    assert tokens[0, 1:].tolist() == end and mask[0].tolist() == [False] + [True] * 7


def test_a_gpu_index_beyond_the_machine(monkeypatch):
    """`--device cuda:7` on a 2-GPU machine failed inside the first tensor move."""
    import torch

    from speedrun.tools.runs import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ConfigError, match="--device cuda:7: this machine has 2 GPU"):
        resolve_device("cuda:7")


def test_sample_and_eval_refuse_a_data_folder_prepared_again_with_another_vocabulary(tmp_path, data_copy):
    """The run's data folder is prepared again from other text under the same tokenizer name and size:
    the checkpoint's recorded vocabulary hash tells the new vocabulary from the one it learned."""
    from speedrun.data.prepare import prepare
    from speedrun.data.sources import iter_documents
    from speedrun.tools.runs import find_checkpoint, load_model, run_tokenizer

    run = tmp_path / "run"
    proc = run_speedrun(
        "train", "--out", str(run), f"data.dir={data_copy}", *FAST, "train.checkpoint_at_end=true"
    )
    assert proc.returncode == 0, proc.stderr
    _, cfg, ckpt = load_model(run)
    assert (
        run_tokenizer(cfg, checkpoint=ckpt).hash
        == json.loads((data_copy / "meta.json").read_text())["tokenizer_hash"]
    )  # the vocabulary it trained with is accepted
    docs = [d for _, d in zip(range(1200), iter_documents("wiki-vital"), strict=False)][600:]  # other text
    src = tmp_path / "other.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare(f"text:{src}", "bpe:512", data_copy, log=lambda *_: None)
    assert find_checkpoint(run) == ckpt
    one_line(run_speedrun("sample", str(run), "--max-tokens", "3"), 1, "prepared again")
    one_line(run_speedrun("eval", str(run)), 1, "prepared again")


def test_race_s_budget_refusal_gives_a_remedy_that_trains_a_fixed_short_count(tmp_path, capsys):
    """issue 46: the remedy (`--set train.time_budget_s=0 --set train.budget_min_steps=0`) left demo's cap,
    1,000 steps a leg, hours on a CPU. It now asks for the step count too, and not when it was given."""
    import re

    from speedrun.cli import main
    from speedrun.recipes import load_recipe

    argv = ["race", "--recipe", "demo", "--out", str(tmp_path / "r"), "model.unet=true"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "--set train.steps=N" in err and "train.steps=1000" in err and "\n" not in err, err
    remedy = re.findall(r"--set ([^\s;]+)", err)
    cfg = load_recipe("demo", [*(f.replace("=N", "=6") for f in remedy)])
    assert (cfg.train.time_budget_s, cfg.train.steps) == (0, 6)
    assert main([*argv[:-1], "--set", "train.steps=6", "model.unet=true"]) == 2
    assert "train.steps=N" not in capsys.readouterr().err
