"""#92's n-gram table in the training step (optim/table_rows.py): the row-sharded path (pull per forward,
push, RowAdam on the table's cadence) against the old dense path (the whole table a parameter, dense Adam
with the same rule over every row every update); 1 and 2 gloo processes to the same losses, a 2-process save
resumed on 1; and the memory guard per process at #92's full size."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch

from speedrun.errors import SpeedrunError
from speedrun.model.families import build_model
from speedrun.optim import build
from speedrun.recipes import load_recipe
from speedrun.train.plan import memory
from speedrun.train.run import checkpoint as ckpt
from speedrun.train.step import train_step
from tests import two_processes
from tests.conftest import run_speedrun, speedrun_command
from tests.world_losses import assert_same, losses

GiB = 2**30
SMALL = [
    "model.n_embd=64", "model.n_head=2", "model.max_seq_len=256", "train.seq_len=256",
    "train.micro_batch_tokens=256", "train.global_batch_tokens=1024", "train.steps=8",
    "train.warmdown_steps=3", "train.val_every=4", "train.val_tokens=1024", "train.log_every=1",
    "train.dtype=fp32", "train.compile=off", "train.time_budget_s=0", "train.budget_min_steps=0",
    "model.ngram.rows=2048", "model.ngram.dtype=fp32",
    "model.embed.bigram_rows=0", "model.embed.bigram_sign_rows=0",
]  # fmt: skip


class DenseTable:
    """The old path, written out: the whole table one parameter, and on the table's update steps (the
    record's is_update_step: odd steps, demo-2026's adam_every = 2, then steps ≡ 3 mod 4 from `every4`, with
    β2 squared and the decay doubled) dense Adam on every row with #92's rule (β1 = 0, one second moment
    per row, cautious decay lr²·wd), the kept gradients of the skipped steps summed in."""

    def __init__(self, table, hyper, every4=0):
        self.table, self.hyper, self.steps_done, self.updates, self.every4 = table, hyper, 0, 0, every4
        self.v = torch.zeros(table.shape[0], dtype=torch.float64)
        self.kept = torch.zeros_like(table, dtype=torch.float64)
        self.param_groups = [dict(kind="adam", label="ngram", lr=hyper.lr, params=[table])]

    def zero_grad(self, set_to_none=True):
        self.table.grad = None

    @torch.no_grad()
    def step(self):
        if self.table.grad is not None:
            self.kept += self.table.grad.double()
        period4 = 0 < self.every4 <= self.steps_done
        if self.steps_done % 4 == 3 if period4 else self.steps_done % 2 == 1:
            self.updates += 1
            lr, g, (_, b2), wd = (
                self.param_groups[0]["lr"],
                self.kept,
                self.hyper.betas,
                self.hyper.weight_decay,
            )
            b2, wd = (b2 * b2, 2 * wd) if period4 else (b2, wd)
            self.v = b2 * self.v + (1 - b2) * g.square().mean(1)
            w = self.table.double()
            u = g / (self.v.sqrt() + self.hyper.eps)[:, None] * (lr * (1 - b2**self.updates) ** 0.5)
            u = u + w * ((u * w) > 0) * lr * lr * wd
            self.table.copy_(w - u)
            self.kept = torch.zeros_like(self.kept)
        self.steps_done += 1


def _batches(cfg, n):
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 500, (1, 257), generator=gen) for _ in range(n)]


ANVIL_EVERY4 = ["optim.name=anvil", "optim.value_embed_every4_from=4", "optim.anvil_engage_step=3"]


@pytest.mark.parametrize("optimizer", [[], ANVIL_EVERY4], ids=["normuon", "anvil-period4"])
def test_row_sharded_training_equals_the_dense_table_with_dense_adam(monkeypatch, optimizer):
    """Six steps of train_step (two micro-batches each, three table updates; ANVIL with the period-4 cadence
    from step 4: ten steps, updates at 1, 3 and 7) on one process: the losses and
    every table row equal the dense path's. Bounds: RowAdam computes in fp32, the reference in fp64, so each
    update of a row (values up to ≈ 5 here, at LR ×70) differs by fp32 rounding: 1e-5 absolute, a few ulps;
    the losses (Newton-Schulz in fp32, so nothing amplifies it) to 1e-6 relative (measured: equal). Host
    kernels: the dense table's backward and the pulled rows' add a row's repeated reads in another order,
    and ANVIL's ten steps carry that last bit into later gradients: 5e-5 for ANVIL (measured 2026-12-05,
    AMD AVX-512: within 1e-5; the same host as AVX2, ATEN_CPU_CAPABILITY=avx2: 2.3e-5 in 5 of 131,072)."""
    cfg = load_recipe("demo-2026", [*SMALL, "optim.muon_ns_dtype=fp32", *optimizer])
    steps = 10 if optimizer else 6  # ANVIL: updates at 1 and 3, then (period 4 from 4) at 7, β2², decay ×2
    data = _batches(cfg, 2 * steps)

    def run(dense: bool):
        torch.manual_seed(0)
        model = build_model(cfg.model)
        if dense:  # the table stays the part's parameter, trained by DenseTable

            def dense_part(model, cfg, entries):
                (e,) = [e for e in entries if e.param is model.bigram.table]
                entries.remove(e)
                r = e.rule
                hyper = build.AdamLabel(r.lr, tuple(r.betas), r.wd, r.eps)
                every4 = cfg.optim.value_embed_every4_from if optimizer else 0
                return {"ngram_rows": DenseTable(model.bigram.table, hyper, every4)}

            monkeypatch.setattr(build, "ngram_rows_part", dense_part)
        opt = build.build_optimizer(model, cfg)
        monkeypatch.undo()
        assert dense or type(opt.parts["ngram_rows"]).__name__ == "TableRows"
        it = iter(data)
        losses = [
            train_step(model, opt, lambda: (lambda b: (b[:, :-1], b[:, 1:]))(next(it)), 2, None).item()
            for _ in range(steps)
        ]
        return losses, model.bigram.table.detach().clone()

    rows_losses, rows_table = run(False)
    dense_losses, dense_table = run(True)
    assert rows_table.abs().max() > 1e-3  # the table moved (three updates)
    torch.testing.assert_close(rows_table, dense_table, rtol=0, atol=5e-5 if optimizer else 1e-5)
    torch.testing.assert_close(torch.tensor(rows_losses), torch.tensor(dense_losses), rtol=1e-6, atol=0)


def test_compiled_model_reads_rows_pulled_outside_its_graph():
    """torch.compile(fullgraph=True, dynamic=False) of a model with the row-sharded table (the loop's way:
    `RunOptimizer.feed` pulls before each compiled call): no graph break (the pull's collectives and host
    syncs stay outside), one graph for all steps though each step's tokens pull a different number of rows
    (padded to one slot per id), and the losses and table equal the eager model's (aot_eager: the same
    ops, so to fp32 rounding of a reordered graph; measured: equal)."""
    cfg = load_recipe("demo-2026", [*SMALL, "optim.muon_ns_dtype=fp32"])
    data = _batches(cfg, 8)

    def run(compiled: bool):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = build_model(cfg.model)
        opt = build.build_optimizer(model, cfg)
        net = model
        if compiled:
            net = torch.compile(model, fullgraph=True, dynamic=False, backend="aot_eager")
            opt.feed(net)
        rows, counts = opt.parts["ngram_rows"], []
        pull = rows.pull
        rows.pull = lambda idx: (pull(idx), counts.append(rows.part.pulled.n))
        it = iter(data)
        losses = [
            train_step(net, opt, lambda: (lambda b: (b[:, :-1], b[:, 1:]))(next(it)), 2, None).item()
            for _ in range(4)
        ]
        return losses, model.bigram.table.detach().clone(), counts

    eager_losses, eager_table, eager_counts = run(False)
    with torch._dynamo.config.patch(error_on_recompile=True):
        losses, table, counts = run(True)
    assert counts == eager_counts and len(set(counts)) > 1  # the steps pulled different numbers of rows
    assert table.abs().max() > 1e-3
    torch.testing.assert_close(table, eager_table, rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=1e-6, atol=0)


def test_table_cadence_is_the_records():
    """track_1_short/ngram_table.py is_update_step and adam_beta2_and_wd_mul, written out: odd steps, then
    steps ≡ 3 (mod 4) from 336 with β2 squared and the decay multiplier 5 → 10."""
    from speedrun.model.gpt2026.ngram import NgramEmbed
    from speedrun.optim.cautious_adam import AdamLabel
    from speedrun.optim.table_rows import TableRows

    part = NgramEmbed(8, 4, 1, 2, dtype=torch.float32)
    rows = TableRows(part, AdamLabel(0.1, (0.0, 0.95), 5.0, 1e-10), adam_every=2, every4_from=336)
    for step in range(0, 700):
        rows.steps_done = step
        due, beta2, wd = rows.due()
        record = step % 4 == 3 if step >= 336 else step % 2 == 1
        assert due == record and (beta2, wd) == ((0.95**2, 10.0) if step >= 336 else (0.95, 5.0)), step


FULL = [
    "train.dtype=bf16", "model.ngram.rows=84602880", "model.embed.bigram_rows=0",
    "model.embed.bigram_sign_rows=0", "model.embed.bigram_dim=0", "model.embed.bigram_in_x0=false",
]  # fmt: skip


@pytest.mark.parametrize("gib", [80, 139])  # an H100 80 GB, an H200
def test_full_table_refused_on_one_process_in_one_line_and_accepted_on_eight(monkeypatch, gib):
    cfg = load_recipe("record-2026-07", FULL)
    monkeypatch.setattr(memory, "device_memory", lambda device: (gib * GiB, (gib + 2) * GiB))
    cuda = torch.device("cuda", 0)
    with pytest.raises(SpeedrunError) as info:
        memory.check_fits(cfg, 1, True, cuda)
    message = str(info.value)
    assert "\n" not in message and message.startswith("model.ngram.rows=84,602,880: ")
    fits = int(re.search(r"model\.ngram\.rows=([\d,]+) fits", message).group(1).replace(",", ""))
    assert 0 < fits < 84_602_880 and fits % 2 == 0
    memory.check_fits(load_recipe("record-2026-07", [*FULL, f"model.ngram.rows={fits}"]), 1, True, cuda)
    shard, _ = memory._table_parts(cfg, 8)  # 15.13 GiB of bf16 rows per process, and 8 bytes of state per row
    assert shard == 84_602_880 // 8 * (768 * 2 + 8) and f"{84_602_880 // 8 * 768 * 2 / GiB:.2f}" == "15.13"
    assert shard * 8 == memory._table_parts(cfg, 1)[0]  # eight processes split it: an eighth of the rows each
    memory.check_fits(cfg, 8, True, cuda)  # one eighth each: fits


TRAIN = ("--recipe", "demo-2026")
WORLD = [*SMALL, "train.checkpoint_every=3", "train.checkpoint_keep=0"]


def data_args(data) -> list[str]:
    """The test dataset (bpe:512) in place of the recipe's vocabulary."""
    from speedrun.data.meta import load_meta

    eot = load_meta(data)["eot_id"]
    return [f"data.dir={data}", "data.tokenizer=bpe:512", "model.vocab_size=512", f"model.eot_id={eot}"]


two_processes.job("ngram-worlds", lambda data: [*TRAIN, *data_args(data), *WORLD])
SHARED = two_processes.SHARED


@pytest.fixture(scope="module")
def runs(text_data, tmp_path_factory):
    one = tmp_path_factory.mktemp("ngram") / "w1"
    proc = run_speedrun("train", *TRAIN, "--out", str(one), *data_args(text_data), *WORLD)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {1: one, 2: two_processes.run_dir("ngram-worlds", text_data, tmp_path_factory)}


@pytest.mark.slow
@SHARED
def test_one_and_two_processes_train_the_table_alike(runs):
    assert_same(losses(runs[1]), losses(runs[2]))
    log = (runs[2] / "log.txt").read_text()
    assert "n-gram table: 1,024 of 2,048 rows on each of 2 process(es)" in log


@pytest.mark.slow
@SHARED
@pytest.mark.parametrize("saved_on, resumed_on", [(2, 1), (1, 2)])
def test_table_saved_on_one_world_resumes_on_another(runs, tmp_path, saved_on, resumed_on):
    """Step 3: the table last stepped at step 1 and step 2's gradients are kept: the saved cycle is open.
    The checkpoint holds the whole table (model.safetensors) and its row state gathered (state.pt)."""
    resumed = tmp_path / "resumed"
    shutil.copytree(runs[saved_on], resumed)
    for path in ckpt.list_checkpoints(resumed):
        if ckpt.checkpoint_step(path) > 3:
            shutil.rmtree(path)
    if resumed_on == 1:
        proc = run_speedrun("train", "--resume", str(resumed))
    else:
        command = speedrun_command("train", "--resume", str(resumed), nproc=resumed_on)
        proc = subprocess.run(command, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same(losses(runs[saved_on]), losses(resumed), first=4)


def test_settings_the_row_sharded_table_cannot_honour_are_refused_in_one_line(monkeypatch):
    """Rows that do not split over the processes, and samples on rank 0 alone (a pull is a collective):
    ConfigError lines naming the key, before any step (a clip, which would see only this process's pulled
    rows, is refused too; the NorMuon/ANVIL recipes refuse it already in config checks)."""
    from speedrun.errors import ConfigError

    def refused(overrides, world):
        cfg = load_recipe("demo-2026", [*SMALL, *overrides])
        torch.manual_seed(0)
        model = build_model(cfg.model)
        monkeypatch.setattr(torch.distributed, "is_initialized", lambda: world > 1)
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: world)
        with pytest.raises(ConfigError) as info:
            build.ngram_rows_part(model, cfg, build.model_rules(model, cfg))
        monkeypatch.undo()
        assert "\n" not in str(info.value)
        return str(info.value)

    assert refused(["model.ngram.rows=2044"], 8).endswith("model.ngram.rows=2,032 does")
    assert refused(["train.sample_every=5"], 2).startswith("train.sample_every with model.ngram.rows")
