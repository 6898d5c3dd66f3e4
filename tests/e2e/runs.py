"""Every end-to-end training run the e2e tests read, declared in one table (as torchtitan's integration
tests declare their OverrideDefinitions): a name, the recipe, the shrink that makes it seconds on a CPU,
the overrides beyond it, the processes, extra arguments of `speedrun train`, and a line saying what it is.
tests/e2e/runner.py builds each one's command line and runs it; a definition several tests read trains
once per pytest-xdist worker, and once in the suite where its tests share its `group`.

In overrides, `{data}` stands for the test dataset's folder and `{eot}` for its end-of-text id."""

from __future__ import annotations

from dataclasses import dataclass

#: the one xdist group of the suite's torchrun launch (tests/two_processes.py `SHARED`)
TWO_PROCESSES = "two_processes"


@dataclass(frozen=True)
class Run:
    name: str
    description: str
    recipe: str = "demo"
    overrides: tuple[str, ...] = ()  # after the shrink (a later value of a key wins)
    shrink: str = "tiny"  # "tiny": conftest's TINY for the recipe's optimizer; "matrix": recipe_matrix's
    processes: int = 1  # 1: this process; 2: the suite's one torchrun launch; more: a torchrun
    seeds: tuple[int, ...] = ()  # `--seeds`: sibling folders OUT-seedS
    child: bool = False  # 1 process, but in a child `python -m speedrun`, as a user runs it
    out: str = "run"  # the run folder's name (with seeds: its siblings' stem)
    group: str = ""  # the xdist group of the tests that read it; "" is `run:NAME`

    @property
    def xdist_group(self) -> str:
        return TWO_PROCESSES if self.processes == 2 else self.group or f"run:{self.name}"


# fmt: off
# test_checkpoint: fp32 on CPU, so that a resumed run reproduces the uninterrupted one bit for bit
RESUMABLE = (
    "train.dtype=fp32", "train.steps=12", "train.warmdown_steps=4", "train.val_every=4",
    "train.checkpoint_every=3", "train.checkpoint_keep=0", "train.checkpoint_at_end=true",
)

# test_normuon_worlds: every switch of the 2025-26 optimizer on; 4 sequences of 64 a step, so that
# 4 x 1, 2 x 2 or 1 x 4 micro-batches make the same step
NORMUON = (
    "train.dtype=fp32", "train.micro_batch_tokens=256", "train.global_batch_tokens=1024",
    "train.steps=12", "train.warmdown_steps=4", "train.val_every=4", "train.checkpoint_every=3",
    "train.checkpoint_keep=0", "optim.muon_momentum_warmup_steps=4", "optim.muon_momentum_cooldown_steps=3",
    "optim.tie_until=8", "optim.embed_lr=0.02", "optim.head_lr=0.02",
    "optim.muon_qk_block_heads=1",  # per-head Q/K blocks (#80 pairs; TINY has 2 heads): a second bank
    "optim.mlp_proj_lr_mul=2.0",  # HEAD's per-matrix multiplier
)

# test_anvil_recipe_worlds: record #92 with every switch (recipe_matrix's shrink), on the bpe:512 data; the
# prefix loss and the canonical mask read GPT-2 token ids, which that data has not: off
ANVIL = (
    "data.tokenizer=bpe:512", "model.vocab_size=512", "model.eot_id={eot}",
    "model.head.prefix_loss_weight=0", "model.head.canonical_val_mask=false",
    "train.log_every=1", "train.val_tokens=1024", "train.compile=off", "train.time_budget_s=0",
    "train.budget_min_steps=0", "train.checkpoint_every=4", "train.checkpoint_keep=0",
)

# the bad-input files' tiny run (tests/bad_input_runs.py FAST)
SHORT3 = ("train.steps=3", "train.warmdown_steps=1", "train.val_every=0")

# test_research: three seeds, with a final checkpoint to sample and evaluate
RESEARCH = (
    "train.steps=12", "train.warmdown_steps=4", "train.val_every=4", "train.dtype=fp32",
    "train.checkpoint_at_end=true",
)
# test_verify: three seeds, every step timed
VERIFY = ("train.steps=6", "train.warmdown_steps=2", "train.val_every=3", "train.timing_warmup_steps=0")

# test_track3_runs: 6 timed steps; track3-2026-06's Tail-EMA (and #46's EMA-Nesterov) active within them
TRACK3 = ("train.steps=6", "train.warmdown_steps=0", "train.val_every=3", "train.timing_warmup_steps=0")
TAIL = (
    "optim.tail_ema_start=2", "optim.tail_ema_end=5", "optim.tail_ema_tau=2",
    "optim.ema_nesterov_start=1", "optim.ema_nesterov_end=5", "optim.power_cool_end=30",
)

# test_recipes_run: a foundation recipe, six steps at its own learning rates
FOUNDATION = (
    "data.source=text:unused", "train.steps=6", "train.warmup_steps=0", "train.warmdown_steps=2",
    "train.val_every=6", "train.compile=off", "train.device=cpu",
)
FOUNDATION_RECIPES = ("demo", "demo-adamw", "gpt2-baseline", "muon-2024-10", "untied-2024-11")

# test_demo_2026: record-2026-07's composition at the demo's size, shrunk (its own sizes, not TINY's)
DEMO_2026 = (
    "data.tokenizer=bpe:512", "model.vocab_size=512", "model.eot_id={eot}", "model.n_embd=64",
    "model.n_head=2", "model.bigram_rows=2048", "model.bigram_sign_rows=64", "model.max_seq_len=1024",
    "model.window=256", "train.seq_len=1024", "train.micro_batch_tokens=1024",
    "train.global_batch_tokens=1024", "train.steps=8", "train.warmdown_steps=2", "train.val_every=4",
    "train.val_tokens=2048", "train.time_budget_s=0", "train.budget_min_steps=0",
    "train.timing_warmup_steps=0",
)

TABLE = [
    Run("tiny", "TINY's 30 steps with a final checkpoint, by `python -m speedrun` in a child process "
        "(test_cli's run folder, test_bench_peers' evaluator)", overrides=("train.checkpoint_at_end=true",),
        child=True),
    Run("finished", "a finished 3-step run with a checkpoint at every step (the bad-input files)",
        overrides=(*SHORT3, "train.checkpoint_every=1")),
    Run("uncheckpointed", "a finished 3-step run that saved no checkpoint, validated at every step",
        overrides=(*SHORT3, "train.val_every=1")),
    Run("six-steps", "a finished 6-step run with checkpoints at steps 3 and 6 (to be resumed from step 3)",
        overrides=(*SHORT3, "train.steps=6", "train.checkpoint_every=3", "train.checkpoint_keep=0")),
    Run("four-steps", "4 steps validated at the end only, a final checkpoint (test_loop's lost validation)",
        overrides=("train.steps=4", "train.warmdown_steps=1", "train.val_every=0",
                   "train.checkpoint_at_end=true")),
    Run("killable", "9 fp32 steps, a checkpoint every 2 (2 kept), none at the last step (test_faults' kills)",
        overrides=("train.dtype=fp32", "train.steps=9", "train.warmdown_steps=3", "train.val_every=4",
                   "train.checkpoint_every=2", "train.checkpoint_keep=2")),
    Run("resumable", "12 fp32 steps, a checkpoint every 3, on one process (2 micro-batches a step)",
        overrides=RESUMABLE, group=TWO_PROCESSES),
    Run("resumable-2", "the same on 2 gloo processes (1 micro-batch each a step)",
        overrides=RESUMABLE, processes=2),
    Run("normuon", "demo-normuon with every new switch on, 12 steps on one process", recipe="demo-normuon",
        overrides=NORMUON, group=TWO_PROCESSES),
    Run("normuon-2", "the same on 2 gloo processes (sharded optimizer state)", recipe="demo-normuon",
        overrides=NORMUON, processes=2),
    Run("anvil", "anvil-2026-08 shrunk with every switch, 10 steps on one process", recipe="anvil-2026-08",
        shrink="matrix", overrides=ANVIL, group=TWO_PROCESSES),
    Run("anvil-2", "the same on 2 gloo processes", recipe="anvil-2026-08", shrink="matrix",
        overrides=ANVIL, processes=2),
    Run("demo-2", "the demo's micro-batch (its whole global batch) split over 2 processes, 2 steps",
        overrides=("train.global_batch_tokens=1024", "train.micro_batch_tokens=1024", "train.steps=2",
                   "train.warmdown_steps=1", "train.val_every=0"), processes=2),
    Run("endless-2", "TINY's run on 2 processes for a million steps, started and killed by test_distributed"
        " (runner.launch_command): never trained to its end", processes=2,
        overrides=("train.steps=1000000", "train.warmdown_steps=4", "train.val_every=0")),
    Run("two-steps-4", "2 steps on 4 gloo processes (test_distributed's exit code under load)",
        overrides=("train.steps=2", "train.warmdown_steps=1", "train.val_every=0"), processes=4),
    Run("research-seeds", "three demo runs differing only in train.seed, 12 steps with a final checkpoint",
        overrides=RESEARCH, seeds=(1, 2, 3), out="tiny", group="seed_runs"),
    Run("verify-seeds", "three demo runs differing only in train.seed, 6 timed steps",
        overrides=VERIFY, seeds=(1, 2, 3), out="r", group="verify_runs"),
    Run("verify-resumable", "one such run with a checkpoint at steps 3 and 6 (test_verify's resumed starts)",
        overrides=(*VERIFY, "train.checkpoint_every=3")),
    Run("track3-baseline", "track3-baseline at TINY's size, 6 timed steps, seeds 1 and 2",
        recipe="track3-baseline", overrides=TRACK3, seeds=(1, 2), out="track3-baseline", group="track3_runs"),
    Run("track3-2026-06", "track3-2026-06 at TINY's size with its Tail-EMA active, seeds 1 and 2",
        recipe="track3-2026-06", overrides=(*TRACK3, *TAIL), seeds=(1, 2), out="track3-2026-06",
        group="track3_runs"),
    *(Run(f"foundation-{r}", f"{r} shrunk, 6 steps", recipe=r, overrides=FOUNDATION)
      for r in FOUNDATION_RECIPES),
    *(Run(f"demo-2026-{dtype}", f"demo-2026 shrunk, 8 steps in {dtype}", recipe="demo-2026", shrink="none",
          overrides=(*DEMO_2026, f"train.dtype={dtype}")) for dtype in ("fp32", "bf16")),
]
# fmt: on
RUNS = {run.name: run for run in TABLE}
assert len(RUNS) == len(TABLE), "run names are unique"
