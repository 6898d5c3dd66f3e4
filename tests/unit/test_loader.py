"""TokenLoader / val_batches against plain numpy references: the union of all ranks' micro-batches
for a step, in chunk order, is the single-process sequence for every world size, including shard
boundaries, wrap-around, BOS alignment and resumption from a state_dict."""

import numpy as np
import pytest
import torch

from speedrun.data.loader import TokenLoader, val_batches
from speedrun.data.shards import write_shard
from speedrun.errors import ConfigError, DataError

T, M, G = 8, 16, 128  # seq_len, micro-batch tokens, global batch tokens: 8 chunks per step
LENGTHS = [300, 100, 520, 129, 257]  # shard 1 is too small for a global batch; shard 3 fits exactly one
BOS = 0


def write(tmp_path, streams, split="train"):
    files = []
    for i, s in enumerate(streams):
        files.append(tmp_path / f"t_{split}_{i:06d}.bin")
        write_shard(files[-1], np.asarray(s))
    return files


@pytest.fixture
def unique(tmp_path):
    """Every token id is unique (= its position in the concatenated stream), so ids reveal positions."""
    offsets = np.cumsum([0] + LENGTHS)
    streams = [np.arange(offsets[i], offsets[i + 1]) for i in range(len(LENGTHS))]
    return write(tmp_path, streams), streams


@pytest.fixture
def documents(tmp_path):
    """Random documents, each starting with BOS, lengths 1..40 tokens."""
    rng = np.random.default_rng(1)
    streams = []
    for length in [700, 90, 1100, 400]:
        s = rng.integers(1, 50, length)
        s[np.cumsum(rng.integers(1, 40, length))[:-1].clip(max=length - 1)] = BOS
        streams.append(s)
    return write(tmp_path, streams), streams


def reference_steps(streams, n_steps):
    """Shard s holds floor((len - 1) / G) global batches; shards are visited cyclically."""
    steps, s = [], 0
    while len(steps) < n_steps:
        for b in range((len(streams[s]) - 1) // G):
            base = b * G
            steps.append([streams[s][base + j * M : base + j * M + M + 1] for j in range(G // M)])
        s = (s + 1) % len(streams)
    return steps[:n_steps]


def reference_aligned_steps(streams, n_steps):
    """Each chunk starts at the first BOS at or after the previous chunk's input end, scanned token by
    token; a global batch that does not fit moves to the start of the next shard."""
    steps, s, pos = [], 0, 0
    while len(steps) < n_steps:
        t, c, starts = streams[s], pos, []
        for _ in range(G // M):
            while c < len(t) and t[c] != BOS:
                c += 1
            if c + M + 1 > len(t):
                break
            starts.append(c)
            c += M
        if len(starts) == G // M:
            steps.append([t[a : a + M + 1] for a in starts])
            pos = c
        else:
            s, pos = (s + 1) % len(streams), 0
    return steps


def gather(loaders, n_steps):
    """Run W loaders in lockstep; chunk k*W + r of a step is rank r's k-th micro-batch."""
    w, a = len(loaders), loaders[0].accumulation_steps
    steps = []
    for _ in range(n_steps):
        chunks = [None] * (a * w)
        for k in range(a):
            for r, loader in enumerate(loaders):
                chunks[k * w + r] = loader.next_batch()
        steps.append(chunks)
    return steps


def assert_steps_equal(got, want):
    assert len(got) == len(want)
    for chunks, ref in zip(got, want, strict=True):
        assert len(chunks) == len(ref)
        for (x, y), r in zip(chunks, ref, strict=True):
            assert x.dtype == torch.int64 and x.shape == (M // T, T) and y.shape == (M // T, T)
            np.testing.assert_array_equal(x.flatten().numpy(), r[:-1])
            np.testing.assert_array_equal(y.flatten().numpy(), r[1:])


def make(files, w, **kw):
    return [TokenLoader(files, G, M, T, rank=r, world_size=w, **kw) for r in range(w)]


@pytest.mark.parametrize("w", [1, 2, 4, 8])
def test_world_size_invariance_boundaries_and_wrap(unique, w):
    files, streams = unique
    n_steps = 20  # 9 global batches per pass over the shards: wraps around twice
    loaders = make(files, w)
    assert loaders[0].accumulation_steps == G // (w * M)
    got = gather(loaders, n_steps)
    assert_steps_equal(got, reference_steps(streams, n_steps))
    assert loaders[0].epoch == 2
    for chunks in got:  # inputs of a step are disjoint, contiguous slices
        ids = np.concatenate([x.flatten().numpy() for x, _ in chunks])
        assert len(set(ids.tolist())) == G
        for x, _ in chunks:
            assert np.all(np.diff(x.flatten().numpy()) == 1)


@pytest.mark.parametrize("w", [1, 2, 4, 8])
def test_bos_alignment(documents, w):
    files, streams = documents
    n_steps = 14
    got = gather(make(files, w, align_to_bos=True, bos_id=BOS, vocab_size=50), n_steps)
    want = reference_aligned_steps(streams, n_steps)
    assert_steps_equal(got, want)
    assert all(x[0, 0].item() == BOS for chunks in got for x, _ in chunks)


def test_loop_false_exhausts(unique):
    files, streams = unique
    (loader,) = make(files, 1, loop=False)
    got = gather([loader], 9)
    assert_steps_equal(got, reference_steps(streams, 9))
    with pytest.raises(DataError, match="exhausted"):
        loader.next_batch()


def test_too_little_data(tmp_path):
    files = write(tmp_path, [np.arange(100), np.arange(128)])
    with pytest.raises(DataError) as err:
        TokenLoader(files, G, M, T)
    assert str(tmp_path) in str(err.value) and "128" in str(err.value)
    no_bos = write(tmp_path, [np.ones(1000, dtype=np.int64)])
    with pytest.raises(DataError, match="no document start in 1 shard.*end-of-text id 0"):
        TokenLoader(no_bos, G, M, T, align_to_bos=True, bos_id=0)
    with pytest.raises(AssertionError):  # load_meta refuses a split without shards, once
        TokenLoader([], G, M, T)


def test_batch_rule_violations_are_programmer_errors(unique):
    """The batch rule is validated once, by run_data.micro_batch_tokens (test_loop); a loader given
    values that break it is a programmer error."""
    files, _ = unique
    with pytest.raises(AssertionError):
        TokenLoader(files, 96, M, T, world_size=4)  # 96 is not a multiple of 4 x 16
    with pytest.raises(AssertionError):
        TokenLoader(files, G, 12, T)
    with pytest.raises(AssertionError):
        TokenLoader(files, G, M, T, rank=2, world_size=2)
    with pytest.raises(AssertionError):
        TokenLoader(files, G, M, T, align_to_bos=True)


def test_out_of_vocab_token(tmp_path):
    s = np.arange(300) % 50
    s[200] = 999
    files = write(tmp_path, [s])
    loader = TokenLoader(files, G, M, T, vocab_size=50)
    for _ in range(8):
        loader.next_batch()  # the first global batch (tokens 0..128) is clean
    with pytest.raises(DataError) as err:
        for _ in range(8):
            loader.next_batch()
    assert str(files[0]) in str(err.value) and "999" in str(err.value)


def test_state_dict_resume(unique):
    files, streams = unique
    want = reference_steps(streams, 12)
    first = make(files, 2)
    gather(first, 5)
    state = first[0].state_dict()
    assert state == first[1].state_dict()  # at a step boundary the state does not depend on the rank
    resumed = make(files, 4)  # ... nor on the world size
    for loader in resumed:
        loader.load_state_dict(state)
    assert_steps_equal(gather(resumed, 7), want[5:])

    (single,) = make(files, 1)
    for _ in range(8 * 6 + 3):  # mid-step: 3 micro-batches into step 6
        single.next_batch()
    mid = single.state_dict()
    (again,) = make(files, 1, prefetch=True)
    again.load_state_dict(mid)
    rest = [again.next_batch() for _ in range(5)]
    assert_steps_equal([rest], [want[6][3:]])
    with pytest.raises(ConfigError, match="mid-step"):
        make(files, 2)[0].load_state_dict(mid)
    with pytest.raises(DataError, match="shards"):
        TokenLoader(files[:3], G, M, T).load_state_dict(state)
    again.close()


def test_prefetch_thread_gives_identical_batches_and_state(documents):
    files, _ = documents
    plain = TokenLoader(files, G, M, T, align_to_bos=True, bos_id=BOS)
    fetched = TokenLoader(files, G, M, T, align_to_bos=True, bos_id=BOS, prefetch=True)
    for i in range(60):
        (x1, y1), (x2, y2) = plain.next_batch(), fetched.next_batch()
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
        assert isinstance(fetched.last_wait_s, float) and fetched.last_wait_s >= 0
        if i % 13 == 0:
            assert plain.state_dict() == fetched.state_dict()
    state = plain.state_dict()
    fetched.load_state_dict(state)  # discards the prefetched batch
    plain2 = TokenLoader(files, G, M, T, align_to_bos=True, bos_id=BOS)
    plain2.load_state_dict(state)
    assert torch.equal(fetched.next_batch()[0], plain2.next_batch()[0])
    fetched.close()


@pytest.mark.parametrize("w", [1, 2, 4])
def test_val_batches(tmp_path, w):
    rng = np.random.default_rng(3)
    streams = [rng.integers(0, 1000, 50), rng.integers(0, 1000, 70)]  # chunk 3 straddles the two shards
    files = write(tmp_path, streams, "val")
    stream = np.concatenate(streams)
    val_tokens = 64
    per_rank = [list(val_batches(files, val_tokens, M, T, rank=r, world_size=w)) for r in range(w)]
    assert all(len(b) == val_tokens // (w * M) for b in per_rank)
    for k in range(val_tokens // (w * M)):
        for r in range(w):
            j = k * w + r
            x, y = per_rank[r][k]
            np.testing.assert_array_equal(x.flatten().numpy(), stream[j * M : (j + 1) * M])
            np.testing.assert_array_equal(y.flatten().numpy(), stream[j * M + 1 : (j + 1) * M + 1])
    with pytest.raises(AssertionError):  # the batch rule is run_data's (test_loop)
        val_batches(files, 48, M, T, world_size=4)
    with pytest.raises(DataError, match="120 tokens"):
        val_batches(files, 128, M, T)
    with pytest.raises(DataError, match="out of range"):
        list(val_batches(files, 64, M, T, vocab_size=10))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pinned_prefetch_matches_cpu(documents):
    files, _ = documents
    cpu = TokenLoader(files, G, M, T, align_to_bos=True, bos_id=BOS)
    gpu = TokenLoader(files, G, M, T, align_to_bos=True, bos_id=BOS, device="cuda")
    for _ in range(100):
        (x1, y1), (x2, y2) = cpu.next_batch(), gpu.next_batch()
        assert x2.is_cuda and torch.equal(x1, x2.cpu()) and torch.equal(y1, y2.cpu())
    assert cpu.state_dict() == gpu.state_dict()
    gpu.close()
    ref = list(val_batches(files, 64, M, T))
    for (x1, y1), (x2, y2) in zip(ref, val_batches(files, 64, M, T, device="cuda"), strict=True):
        assert torch.equal(x1, x2.cpu()) and torch.equal(y1, y2.cpu())
