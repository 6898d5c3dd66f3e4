"""Our loader against small re-implementations of the records' own loaders, written from the record
scripts (modded-nanogpt, code at the top of each log in records/track_1_short/; line numbers count
from the first line of that code):

- `DistributedDataLoader` of 10-10 … 12-08 (2024-10-10_Muon/train_gpt2.py:279-323): rank r starts a
  shard at r·B·T, reads B·T + 1 tokens, moves by B·T·W and takes the next shard (modulo the file count)
  once `pos + (B·T·W + 1) > len` (11-19 … 12-04: `pos + B·T·W >= len`, log 8384493d:356; 12-08 log
  0069607b:376, `pos + B·T·W + 1 >= len`); 10-10 … 11-10 read the first batch (train_gpt2.py:373)
  and then reset the loader (:432), so steps 0 and 1 both train on batch 0. The seed (commit
  cd06e200, train_gpt2.py:374) does not reset.
- Sub3Min's `distributed_data_generator` (2025-01-16_Sub3Min log 1d3bd93b:437-450): one cursor for
  the global batch, a new shard when `pos + G + 1 >= len` (:444), rank r takes `pos + r·G/W` (+1 for targets).
- Validation (train_gpt2.py:450-458): the val loader is reset, each rank reads `val_steps` batches,
  the loss is the mean of the per-batch means, averaged over ranks.

For the records' own layout (8 ranks, one micro-batch each) every step's global batch must hold
exactly the tokens the record's 8 ranks read at that step, and the same on 1, 2 or 4 processes.
"""

import math

import numpy as np
import pytest
import torch

from speedrun.config import Config
from speedrun.data.loader import TokenLoader, val_batches
from speedrun.data.shards import write_shard
from speedrun.errors import ConfigError
from speedrun.recipes import load_recipe
from speedrun.train.distributed import DistContext
from speedrun.train.evaluate import evaluate
from tests.unit.test_loader import gather

T, S, W = 8, 16, 8  # seq_len; tokens per record rank (B·T, B = 2); the records' 8 ranks
G = S * W  # global batch
# Lengths chosen so that ranks leave shards at different steps (shard 0: ranks 0-2 read 3 batches,
# ranks 3-7 read 2), plus a shard that holds exactly one batch (the records assert >= G + 1 tokens).
LENGTHS = [424, 129, 700, 386, 530]


class RecordDistributedDataLoader:
    """One rank of the record's DistributedDataLoader (2024-10-10_Muon/train_gpt2.py:279-323)."""

    def __init__(self, shards, B, T, rank, world, variant="1010"):
        self.shards, self.B, self.T, self.rank, self.world, self.variant = shards, B, T, rank, world, variant
        self.reset()

    def reset(self):
        self.current_shard = 0
        self.current_position = self.rank * self.B * self.T

    def advance(self):
        self.current_shard = (self.current_shard + 1) % len(self.shards)
        self.current_position = self.rank * self.B * self.T

    def next_batch(self):
        tokens, bt = self.shards[self.current_shard], self.B * self.T
        buf = tokens[self.current_position : self.current_position + bt + 1]
        self.current_position += bt * self.world
        batch, n = bt * self.world, len(tokens)
        leave = {
            "1010": self.current_position + (batch + 1) > n,  # 10-10 … 11-10
            "1119": self.current_position + batch >= n,  # 11-19 … 12-04
            "1208": self.current_position + batch + 1 >= n,  # 12-08
        }[self.variant]
        if leave:
            self.advance()
        return buf


def record_steps(shards, steps, variant="1010", reset_after_first=False):
    """Each step's tokens (B·T + 1 per rank, rank order) as the record's 8 ranks train on them."""
    per_rank = []
    for r in range(W):
        loader = RecordDistributedDataLoader(shards, 2, T, r, W, variant)
        buf = loader.next_batch()  # train_gpt2.py:373, before the loop
        if reset_after_first:
            loader.reset()  # train_gpt2.py:432
        seen = []
        for _ in range(steps):
            seen.append(buf)  # the step trains on the batch read before it
            buf = loader.next_batch()
        per_rank.append(seen)
    return [[per_rank[r][s] for r in range(W)] for s in range(steps)]


def sub3min_steps(shards, steps):
    """distributed_data_generator of Sub3Min, rank by rank, without itertools.cycle."""
    out, files, tokens, pos, local = [], iter(shards), None, 0, G // W
    tokens = next(files)
    for _ in range(steps):
        if pos + G + 1 >= len(tokens):
            tokens, pos = next(files), 0
        out.append([tokens[pos + r * local :][: local + 1] for r in range(W)])
        pos += G
    return out


def make_shards(folder, lengths: list[int]) -> tuple[list, list[np.ndarray]]:
    """Shards holding consecutive integers (every token tells where it came from), and their streams."""
    offsets = np.cumsum([0] + lengths)
    streams = [np.arange(offsets[i], offsets[i + 1]) for i in range(len(lengths))]
    files = [folder / f"t_train_{i:06d}.bin" for i in range(len(lengths))]
    for file, stream in zip(files, streams, strict=True):
        write_shard(file, stream)
    return files, streams


@pytest.fixture
def shards(tmp_path):
    return make_shards(tmp_path, LENGTHS)


def our_steps(files, steps, w, micro=S, **kw):
    """Each step's chunks in chunk order (chunk k·w + r is rank r's k-th micro-batch), as (x, y)."""
    loaders = [TokenLoader(files, G, micro, T, rank=r, world_size=w, **kw) for r in range(w)]
    return gather(loaders, steps), loaders


def assert_same(ours, record):
    """Our chunks (any micro size) against the record's per-rank buffers of S + 1 tokens."""
    assert len(ours) == len(record)
    for s, (chunks, bufs) in enumerate(zip(ours, record, strict=True)):
        x = np.concatenate([c[0].flatten().numpy() for c in chunks])
        y = np.concatenate([c[1].flatten().numpy() for c in chunks])
        np.testing.assert_array_equal(x, np.concatenate([b[:-1] for b in bufs]), err_msg=f"step {s}")
        np.testing.assert_array_equal(y, np.concatenate([b[1:] for b in bufs]), err_msg=f"step {s}")


@pytest.mark.parametrize("variant, margin", [("1010", 0), ("1119", 0), ("1208", 1)])
@pytest.mark.parametrize("w", [1, 2, 8])
def test_rank_cursors_match_the_records_distributed_data_loader(shards, variant, margin, w):
    files, streams = shards
    steps = 40  # several passes over the shards: ranks drift apart by a step per shard and wrap
    record = record_steps(streams, steps, variant)
    ours, loaders = our_steps(files, steps, w, rank_cursors=W, end_margin=margin)
    assert_same(ours, record)
    assert loaders[0].epoch >= 1
    # the drift is real: in some steps the ranks' slices are not one contiguous span
    assert any(any(b[0] != bufs[0][0] + r * S for r, b in enumerate(bufs)) for bufs in record)
    plain, _ = our_steps(files, steps, w, end_margin=margin)
    with pytest.raises(AssertionError):
        assert_same(plain, record)


def test_rank_cursors_with_smaller_micro_batches(shards):
    """Micro-batches of half a rank's slice (accumulation): the same tokens per step."""
    files, streams = shards
    ours, _ = our_steps(files, 25, 2, micro=S // 2, rank_cursors=W)
    assert_same(ours, record_steps(streams, 25))


@pytest.mark.parametrize("w", [1, 8])
def test_first_batch_twice_as_10_10_to_11_10(shards, w):
    files, streams = shards
    ours, _ = our_steps(files, 12, w, rank_cursors=W, repeat_first_batch=True)
    assert_same(ours, record_steps(streams, 12, reset_after_first=True))
    seed, _ = our_steps(files, 12, w, rank_cursors=W)  # the seed does not reset: batch s at step s
    assert_same(seed, record_steps(streams, 12))


@pytest.mark.parametrize("w", [1, 2, 8])
def test_global_cursor_matches_sub3min_generator(tmp_path, w):
    # shard 0 ends exactly G + 1 after a batch start
    files, streams = make_shards(tmp_path, [5 * G + 1, 3 * G + 2, 4 * G + 50])
    steps = 4 + 3 + 3  # the generator's last batch; it has no next epoch
    ours, _ = our_steps(files, steps, w, end_margin=1, repeat_first_batch=False)
    assert_same(ours, sub3min_steps(streams, steps))
    plain, _ = our_steps(files, steps, w)  # without the margin shard 0 yields one batch more
    with pytest.raises(AssertionError):
        assert_same(plain, sub3min_steps(streams, steps))
    twice, _ = our_steps(files, steps, w, end_margin=1, repeat_first_batch=True)  # one cursor, batch 0 twice
    assert_same(twice, sub3min_steps(streams, steps)[:1] + sub3min_steps(streams, steps - 1))


@pytest.mark.parametrize("w", [1, 2, 8])
@pytest.mark.parametrize("first", [G + 1, 2 * G + 1])
def test_sub3min_reads_a_shard_of_exactly_one_batch_it_moves_to(tmp_path, w, first):
    """The generator loads the next shard and reads at 0 without testing `pos + G + 1 >= len` again,
    so a later shard of exactly G + 1 tokens yields one batch; the first shard's start is tested."""
    files, streams = make_shards(tmp_path, [first, G + 1, 2 * G + 7, G + 1, G + 1])
    record = sub3min_steps(streams, 5 if first == G + 1 else 6)
    assert record[-1][0][0] == streams[4][0]  # the record read the last shard of G + 1 tokens
    ours, _ = our_steps(files, len(record), w, end_margin=1)
    assert_same(ours, record)
    # mid-step state on the shard of G + 1 tokens: the next micro-step plans from (shard, 0) again
    loader = TokenLoader(files, G, S // 2, T, rank=0, world_size=1, end_margin=1)
    for _ in range(16 * len(record) - 1):  # 16 micro-steps of 8 tokens a step, the last one left
        loader.next_batch()
    again = TokenLoader(files, G, S // 2, T, rank=0, world_size=1, end_margin=1)
    again.load_state_dict(loader.state_dict())
    last = np.concatenate([b[:-1] for b in record[-1]])
    assert again.next_batch()[0].flatten().tolist() == last[8 * 15 :].tolist()
    loader.close(), again.close()


@pytest.mark.parametrize("repeat", [False, True])
def test_resume_on_another_world_size_is_exact(shards, repeat):
    files, _ = shards
    kw = dict(rank_cursors=W, repeat_first_batch=repeat)
    whole, _ = our_steps(files, 30, 8, **kw)
    for cut in (0, 1, 7, 19):
        first, loaders = our_steps(files, cut, 8, **kw)
        state = loaders[0].state_dict()
        assert all(ld.state_dict()["batch"] == state["batch"] for ld in loaders)
        resumed = [TokenLoader(files, G, S, T, rank=r, world_size=2, **kw) for r in range(2)]
        for ld in resumed:
            ld.load_state_dict(state)
        rest = []
        for _ in range(30 - cut):
            chunks = [None] * W
            for k in range(4):
                for r in range(2):
                    chunks[k * 2 + r] = resumed[r].next_batch()
            rest.append(chunks)
        for a, b in zip(whole, first + rest, strict=True):
            for (xa, ya), (xb, yb) in zip(a, b, strict=True):
                assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_state_of_another_data_order_is_refused(shards):
    files, _ = shards
    state = TokenLoader(files, G, S, T).state_dict()
    with pytest.raises(ConfigError, match="rank_cursors"):
        TokenLoader(files, G, S, T, rank_cursors=W).load_state_dict(state)


@pytest.mark.parametrize("chunks", [1, 2, 8])
def test_val_tokens_and_loss_as_the_records(tmp_path, chunks):
    """Val tokens per rank and step as the record's reset val loader; the loss as its mean of
    per-batch means over ranks (equal batch sizes make it the token mean evaluate() takes)."""
    rng = np.random.default_rng(0)
    val = rng.integers(0, 64, 20 * G + 7)
    write_shard(tmp_path / "v_val_000000.bin", val)
    files, val_tokens = [tmp_path / "v_val_000000.bin"], 6 * G
    loaders = [RecordDistributedDataLoader([val], 2, T, r, W) for r in range(W)]
    val_steps = val_tokens // G
    record = [[ld.next_batch() for _ in range(val_steps)] for ld in loaders]
    ours = [list(val_batches(files, val_tokens, G // W, T, r, W)) for r in range(W)]
    for r in range(W):
        for k in range(val_steps):
            np.testing.assert_array_equal(ours[r][k][0].flatten().numpy(), record[r][k][:-1])
            np.testing.assert_array_equal(ours[r][k][1].flatten().numpy(), record[r][k][1:])

    class Bigram(torch.nn.Module):
        """A fixed per-token loss that depends on inputs and targets."""

        def forward(self, x, y, reduction="mean"):
            loss = ((x * 31 + y * 7) % 97).float() / 13.0
            return loss if reduction == "none" else loss.mean()

    model = Bigram()
    per_rank = [
        sum(float(model(torch.from_numpy(b[:-1]), torch.from_numpy(b[1:]))) for b in bufs) for bufs in record
    ]
    record_loss = sum(per_rank) / W / val_steps  # all_reduce(AVG), then / val_steps
    cfg = Config()
    cfg.train.seq_len, cfg.train.val_tokens, cfg.train.dtype = T, val_tokens, "fp32"
    cfg.model.vocab_size = 64
    ctx = DistContext(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"))
    loss, _ = evaluate(model, cfg, files, G // chunks, None, ctx)
    assert math.isclose(loss, record_loss, rel_tol=1e-6)


RECORD_DATA = {  # recipe: (rank_cursors, end_margin, repeat_first_batch) read from the record scripts
    "seed-2024-10": (8, 0, False),  # cd06e200 train_gpt2.py:305-316, no reset before the loop
    "muon-2024-10": (8, 0, True),  # 2024-10-10 train_gpt2.py:311-322, :373, :432
    "modern-2024-10": (8, 0, True),  # log dabaaddd: :301-312, :363, :423
    "distributed-muon-2024-10": (8, 0, True),  # log 22d24867: :321-332, :383, :444
    "untied-2024-11": (8, 0, True),  # log d6b50d71: :318-329, :379, :446
    "shortcuts-2024-11": (8, 0, True),  # log dd7304a6: :329-340, :390, :461
    "unet-2024-11": (8, 0, True),  # log c87bb826: :340-351, :401, :475
    "flex-2024-11-19": (8, 0, False),  # log 8384493d: :348-358 (pos + batch >= len), no reset
    "flex-2024-11": (8, 0, False),  # 11-24 log 3151f69a: as 11-19
    "value-embed-2024-12": (8, 0, False),  # 12-04 train_gpt2.py: as 11-19 with B = 1 dropped
    "unet-value-embed-2024-12": (8, 1, False),  # log 0069607b: pos + batch + 1 >= len
    "record-2025-01": (0, 1, False),  # log 1d3bd93b: distributed_data_generator
}


@pytest.mark.parametrize("name", sorted(RECORD_DATA))
def test_recipes_use_their_records_data_order_and_batch(name):
    cfg = load_recipe(name)
    d, t = cfg.data, cfg.train
    assert (d.rank_cursors, d.end_margin, d.repeat_first_batch) == RECORD_DATA[name]
    assert not d.align_to_bos  # BOS alignment arrives with 2025-07-12_BosAlign
    # 8 ranks x 64 x 1024 (10-10 … 11-10, seed) or 8 x one 65,536-token sequence (11-19 on)
    assert t.global_batch_tokens == 8 * 64 * 1024 and t.micro_batch_tokens == 64 * 1024
    short = {"seed-2024-10", "muon-2024-10", "modern-2024-10", "distributed-muon-2024-10"}
    short |= {"untied-2024-11", "shortcuts-2024-11", "unet-2024-11"}
    assert t.seq_len == (1024 if name in short else 65536)
    assert t.val_tokens == 10485760 and t.val_every == (128 if name == "seed-2024-10" else 125)
