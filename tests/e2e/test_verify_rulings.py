"""`speedrun verify` and the 2026 rulings: eval-side masking allowed (#350), a backward pass at evaluation
refused (#205), extension steps timed (#344), and #92's: at most 40 untimed warm-up steps, a sampled
softmax in training only with a full-softmax validation, one validation at the end enough. The loop
records the facts (summary.json's eval_writes, timed_through, extension_steps, sampled_candidates,
val_classes; the log's warm-up line); tiny real runs show it records them, copies edited to break one
rule each show verify reads them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from speedrun.cli import main
from tests.conftest import TINY
from tests.e2e import runner
from tests.e2e.runs import VERIFY
from tests.e2e.test_verify import copies, edit_json, record_validation, rules

pytestmark = runner.uses("verify-seeds")  # test_verify's worker: the runs train once for both files


@pytest.fixture
def runs(trained) -> list[Path]:
    """Two tiny demo runs that differ only in train.seed: seeds 1 and 2 of runs.py `verify-seeds`."""
    return trained("verify-seeds").folders[:2]


def judged(runs: list[Path], dst: Path, edit=None, which: int | None = None) -> list[Path]:
    """Copies stating the record validation (so only the rule under test can fail), `edit` applied to
    copy `which` (every copy when None)."""
    paths = copies(runs, dst, record_validation)
    for i, path in enumerate(paths):
        if edit is not None and which in (None, i):
            edit(path)
    return paths


def test_a_run_records_the_facts_and_passes_the_rulings(runs, tmp_path):
    for run in runs:
        s = json.loads((run / "summary.json").read_text())
        assert (s["timed_through"], s["extension_steps"], s["eval_writes"]) == (s["steps"], 0, 0)
        assert (s["sampled_candidates"], s["val_classes"]) == ([], 512)  # the full softmax; 512 head rows
    got = rules(judged(runs, tmp_path))
    assert got["validation"][0] == got["timing"][0] == "ok", got
    assert "#350" not in got["validation"][1]
    assert got["softmax"] == ("ok", "the full softmax in training and validation")
    assert got["final-val"] == ("ok", "every run validated at its last step")


def test_canonical_token_masking_at_validation_is_allowed_and_reported(runs, tmp_path):
    mask = edit_json("config.json", lambda c: c["model"].update(canonical_val_mask=True))
    got = rules(judged(runs, tmp_path, mask))
    assert got["validation"] == (
        "ok",
        "the first 10,485,760 gpt2 tokens of the fineweb10B val split, unaligned; every run masked "
        "non-canonical token pairs at validation (eval-side masking: allowed, #350)",
    )


def test_a_recorded_backward_at_validation_is_refused_and_an_unrecorded_one_is_unknown(runs, tmp_path):
    wrote = edit_json("summary.json", lambda s: s.update(eval_writes=2))
    status, detail = rules(judged(runs, tmp_path / "a", wrote, which=1))["validation"]
    assert status == "fails" and "r-seed2: 2 validation(s) wrote weights or gradients" in detail
    assert "#205" in detail
    old = edit_json("summary.json", lambda s: s.pop("eval_writes"))
    status, detail = rules(judged(runs, tmp_path / "b", old, which=0))["validation"]
    assert status == "unknown" and detail.startswith("r-seed1: summary.json does not record")


def test_extension_steps_after_the_clock_are_refused(runs, tmp_path):
    def late(s: dict) -> None:
        s.update(timed_through=s["steps"] - 2, extension_steps=2)

    status, detail = rules(judged(runs, tmp_path, edit_json("summary.json", late), which=1))["timing"]
    assert status == "fails", detail
    assert detail.startswith("r-seed2: steps 5-6 ran after the clock stopped; the last 2 are its extension")
    assert "#344" in detail


def test_the_loop_counts_a_validation_that_runs_a_backward_pass(text_data, tmp_path, monkeypatch):
    """Test-time training inside the loop's validation (a backward on the model, untimed): counted in
    summary.json, one per validation, and refused by verify."""
    from speedrun.recipes import load_recipe
    from speedrun.train import loop

    real = loop.evaluate

    def with_backward(model, *args, **kwargs):
        with torch.enable_grad():
            sum(p.float().square().sum() for p in model.parameters()).backward()
        return real(model, *args, **kwargs)

    monkeypatch.setattr(loop, "evaluate", with_backward)
    cfg = load_recipe("demo", [*TINY, *VERIFY, f"data.dir={text_data}"])
    summary = loop.train(cfg, tmp_path / "run")
    validations = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())]
    assert summary["eval_writes"] == sum("val_loss" in r for r in validations) == 3  # steps 0, 3, 6
    status, detail = rules(judged([tmp_path / "run"], tmp_path / "copy"))["validation"]
    assert status == "fails" and "run: 3 validation(s) wrote weights or gradients" in detail


def test_a_staged_run_records_its_extension_inside_the_clock(text_data, tmp_path):
    """banks-2026-01 shrunk with 2 extension steps: summary.json names them and the clock ran to the last."""
    from speedrun.recipes import load_recipe
    from speedrun.train import loop
    from tests.recipe_matrix import shrink

    eot = json.loads((text_data / "meta.json").read_text())["eot_id"]
    plan = "tokens=512 windows=1/1 frac=1/2; tokens=512 windows=1/2 frac=1/2; tokens=512 windows=1/2 ext=2"
    over = [*shrink("banks-2026-01"), f"data.dir={text_data}", "data.tokenizer=bpe:512",
            f"model.eot_id={eot}", "model.vocab_size=512", "model.embed_dtype=fp32", "model.fp8_head=false",
            "model.bigram_rows=0",
            "model.block_dtype=fp32", "model.mtp=0", "model.yarn=false", "optim.muon_ns_dtype=fp32",
            "train.seq_len=128", "train.micro_batch_tokens=128", "train.global_batch_tokens=512",
            "model.max_seq_len=512", "train.val_seq_len=512", "train.val_tokens=1024", "train.steps=6",
            f"train.stages={plan}", "optim.tie_until=0", "train.log_every=1", "data.max_docs=0",
            "train.timing_warmup_steps=0"]  # fmt: skip
    summary = loop.train(load_recipe("banks-2026-01", over), tmp_path / "run")
    assert (summary["extension_steps"], summary["timed_through"], summary["steps"]) == (2, 6, 6)
    assert math.isfinite(summary["final_val_loss"])
    assert rules([tmp_path / "run"])["timing"][0] == "ok"


def test_impossible_ruling_facts_in_summary_json_are_one_line(runs, tmp_path, capsys):
    for i, (key, value) in enumerate((("eval_writes", -1), ("timed_through", "6"), ("extension_steps", 1.5))):
        (copy,) = copies(
            runs[:1], tmp_path / str(i), edit_json("summary.json", lambda s, k=key, v=value: s.update({k: v}))
        )
        assert main(["verify", str(copy), "--target", "9"]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("speedrun: error:") and "must be integers >= 0 (edited?)" in err, err
        assert "\n" not in err


# ---- #92's rulings (tools/rulings.py) ----

WARMUP = "warm-up: {} training step(s) and one validation batch compiled, state restored\n"


def with_warmup(steps: int):
    def edit(folder: Path) -> None:
        with (folder / "log.txt").open("a") as log:
            log.write(WARMUP.format(steps))

    return edit


def test_an_untimed_warm_up_of_more_than_40_steps_fails(runs, tmp_path):
    got = rules(judged(runs, tmp_path / "a", with_warmup(37)))["warm-up"]  # the record's 37
    assert got == ("ok", "at most 37 untimed warm-up step(s) a start (#92 allows 40)")
    assert rules(judged(runs, tmp_path / "b", with_warmup(40)))["warm-up"][0] == "ok"
    status, detail = rules(judged(runs, tmp_path / "c", with_warmup(41), which=1))["warm-up"]
    assert status == "fails" and detail.startswith("r-seed2: an untimed warm-up of 41 training steps")
    assert "#92" in detail


def sampled(val_classes: int):
    def change(s: dict) -> None:
        s.update(sampled_candidates=[10240, 14336], val_classes=val_classes)

    return edit_json("summary.json", change)


def test_a_sampled_softmax_in_training_needs_a_full_softmax_validation(runs, tmp_path):
    got = rules(judged(runs, tmp_path / "a", sampled(512)))["softmax"]
    assert got == (
        "ok",
        "every run trained on a sampled softmax, validated on the full softmax (#92: allowed)",
    )
    status, detail = rules(judged(runs, tmp_path / "b", sampled(300), which=0))["softmax"]
    assert status == "fails", detail
    assert detail == (
        "r-seed1: trained on a sampled softmax (P = 10240, 14336) and validated over 300 of the head's 512 "
        "classes; validation must be the full softmax (#92)"
    )
    stride = edit_json("config.json", lambda c: c["model"].update(head={"sampled_stride": 7}))
    unrecorded = edit_json("summary.json", lambda s: s.pop("sampled_candidates"))
    paths = judged(runs, tmp_path / "c", lambda f: (stride(f), unrecorded(f)), which=1)
    status, detail = rules(paths)["softmax"]
    assert status == "unknown" and detail.startswith("r-seed2: summary.json does not record"), detail


def drop_validations(keep_last: bool):
    """metrics.jsonl without the validations before the last (`keep_last`), or without the last."""

    def edit(folder: Path) -> None:
        records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        val = [i for i, r in enumerate(records) if "val_loss" in r]
        gone = set(val[:-1]) if keep_last else {val[-1]}
        text = "".join(json.dumps(r) + "\n" for i, r in enumerate(records) if i not in gone)
        (folder / "metrics.jsonl").write_text(text)

    return edit


def test_one_validation_at_the_end_is_enough_and_none_at_the_last_step_fails(runs, tmp_path):
    got = rules(judged(runs, tmp_path / "a", drop_validations(keep_last=True)))["final-val"]
    assert got == ("ok", "every run validated once, at the end (#92: allowed; validation is untimed)")
    status, detail = rules(judged(runs, tmp_path / "b", drop_validations(keep_last=False), which=1))[
        "final-val"
    ]
    assert status == "fails" and detail.startswith(
        "r-seed2: no validation at its last step 6 (its last at step 3)"
    )
