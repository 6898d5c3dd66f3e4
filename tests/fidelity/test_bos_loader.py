"""DocumentLoader against the record scripts' own loaders, written here from their code: #26's
`find_batch_starts` / `distributed_data_generator` (2025-07-12_BosAlign) and today's
`Shard.next_batch` with `.send()` stage changes and padded `cu_seqlens` (train_gpt.py @ f411b3d3).
The records run 8 ranks; our 1, 2 and 8 simulated processes must read the same tokens per step, and
a loader resumed from its state at any step must continue with the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speedrun.data.bos_loader import DocumentLoader, cu_seqlens, record_max_docs
from speedrun.data.shards import write_shard
from speedrun.errors import ConfigError

BOS = 50256
CHUNKS = 8  # the records' ranks


def make_shards(tmp_path, lengths, seed=0, max_doc=150):
    rng = np.random.default_rng(seed)
    files, streams = [], []
    for i, n in enumerate(lengths):
        s = rng.integers(0, 50000, n).astype(np.uint16)
        s[0] = BOS
        s[np.cumsum(rng.integers(1, max_doc, n))[:-1].clip(max=n - 1)] = BOS
        files.append(tmp_path / f"fineweb_train_{i:06d}.bin")
        write_shard(files[-1], s)
        streams.append(s)
    return files, streams


# ------------------------------------------------------------------ record #26, written from its code


def record26_find_batch_starts(tokens, pos, world_size, local_batch_size, max_batch_span):
    boundary_positions = np.flatnonzero(tokens[pos : pos + max_batch_span] == BOS) + pos
    start = int(boundary_positions[0])
    starts, batch_end = [], None
    for i in range(len(boundary_positions) - 1):
        end = int(boundary_positions[i + 1])
        if end - start >= local_batch_size:
            starts.append(start)
            if len(starts) == world_size:
                batch_end = end
                break
            start = end
    assert batch_end is not None
    return starts, batch_end - pos


def record26_generator(streams, batch_size, rank, world_size):
    local = batch_size // world_size
    it = iter(streams)
    tokens, pos = next(it), 0
    max_span = 2 * batch_size
    while True:
        if pos + max_span + 1 >= len(tokens):
            tokens, pos = next(it), 0
        starts, span = record26_find_batch_starts(tokens, pos, world_size, local, max_span)
        buf = tokens[starts[rank] :][: local + 1]
        pos += span
        yield buf[:-1].astype(np.int64), buf[1:].astype(np.int64)


# ------------------------------------------------------------------ today's record, written from its code


def head_next_batch(bos_idx, size, i, world_size, num_tokens_local, max_seq_len):
    n = len(bos_idx)
    starts, ends = [[] for _ in range(world_size)], [[] for _ in range(world_size)]
    idx = i
    for r in range(world_size):
        cur_len = 0
        while cur_len <= num_tokens_local:
            if idx >= n:
                raise StopIteration
            cur = bos_idx[idx]
            starts[r].append(cur)
            idx += 1
            end = min(
                bos_idx[idx] if idx < n else size, cur + max_seq_len, cur + num_tokens_local - cur_len + 1
            )
            ends[r].append(end)
            cur_len += end - cur
        assert cur_len == num_tokens_local + 1
    return starts, ends, idx


def head_generator(streams, num_tokens, max_seq_len, rank, world_size):
    """Yields (inputs, targets, cu_seqlens); `.send((num_tokens, max_seq_len))` changes the stage."""
    it = iter(streams)
    tokens = next(it)
    bos_idx, i = np.flatnonzero(tokens == BOS), 0
    while True:
        local = num_tokens // world_size
        max_docs = record_max_docs(local)
        try:
            s, e, i_next = head_next_batch(bos_idx, len(tokens), i, world_size, local, max_seq_len)
        except StopIteration:
            tokens = next(it)
            bos_idx, i = np.flatnonzero(tokens == BOS), 0
            continue
        i = i_next
        start_idxs, end_idxs = np.array(s[rank]), np.array(e[rank])
        buf = np.concatenate([tokens[a:b] for a, b in zip(start_idxs, end_idxs, strict=True)])
        end_idxs[-1] -= 1
        cum = np.cumsum(end_idxs - start_idxs)
        cu = np.full(max_docs, local)
        cu[0] = 0
        cu[1 : len(cum) + 1] = cum
        new = yield buf[:-1].astype(np.int64), buf[1:].astype(np.int64), cu.astype(np.int32)
        if new is not None:
            num_tokens, max_seq_len = new


# ------------------------------------------------------------------ helpers


def run_ours(files, w, steps, stage_of, rule, **kw):
    """Per step, the CHUNKS (x, y, cu) of W loaders run in lockstep, in chunk order k*W + r."""
    loaders = [DocumentLoader(files, CHUNKS, stage_of, BOS, r, w, rule=rule, **kw) for r in range(w)]
    out = [gather_step(loaders) for _ in range(steps)]
    return out, loaders


def gather_step(loaders):
    w, a = len(loaders), loaders[0].accumulation_steps
    chunks = [None] * (w * a)
    for k in range(a):
        for r, loader in enumerate(loaders):
            chunks[k * w + r] = tuple(t.numpy() for t in loader.next_packed())
    return chunks


def assert_same(a, b):
    assert len(a) == len(b)
    for step_a, step_b in zip(a, b, strict=True):
        for ca, cb in zip(step_a, step_b, strict=True):
            for ta, tb in zip(ca, cb, strict=False):  # the #26 reference has no cu_seqlens
                np.testing.assert_array_equal(ta, tb)


LOCAL = 64


def stages(step: int) -> tuple[int, int]:
    """Three stages as today's record: the batch grows and the longest document changes."""
    if step < 5:
        return CHUNKS * LOCAL, 48
    if step < 11:
        return CHUNKS * 2 * LOCAL, 96
    return CHUNKS * 3 * LOCAL, 96


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("w", [1, 2, 8])
def test_stream_rule_is_record_26_token_for_token(tmp_path, w):
    files, streams = make_shards(tmp_path, [3000, 3400, 3200], max_doc=40)
    g, steps = CHUNKS * LOCAL, 12  # crosses both shard boundaries
    record = [record26_generator(streams, g, r, CHUNKS) for r in range(CHUNKS)]
    want = [[next(gen) for gen in record] for _ in range(steps)]
    got, loaders = run_ours(files, w, steps, lambda s: (g, 0), "stream", loop=False)
    assert_same(got, want)
    assert loaders[0].state_dict()["shard"] == 2  # the record's shard switches were taken
    for step in got:  # cu_seqlens as the records compute it from the inputs' BOS positions
        for x, _, cu in step:
            want_cu = np.flatnonzero(x == BOS)
            np.testing.assert_array_equal(cu[1 : len(want_cu)], want_cu[1:])
            assert cu[0] == 0 and cu[len(want_cu)] == len(x) == LOCAL


@pytest.mark.parametrize("w", [1, 2, 8])
def test_packed_rule_with_stages_is_todays_record(tmp_path, w):
    files, streams = make_shards(tmp_path, [6000, 8100, 9000, 10100], seed=1)
    record = [head_generator(streams, *stages(0), r, CHUNKS) for r in range(CHUNKS)]
    want, steps = [], 16
    for step in range(steps):
        new = stages(step) if step and stages(step) != stages(step - 1) else None
        want.append([gen.send(new) if step else next(gen) for gen in record])
    got, loaders = run_ours(files, w, steps, stages, "packed", loop=False)
    assert_same(got, want)
    assert loaders[0].state_dict()["shard"] == 3  # three shard switches taken
    assert any(len(x) == 3 * LOCAL for x, _, _ in got[-1])


@pytest.mark.parametrize("rule", ["stream", "packed"])
def test_resume_at_every_step_on_another_world_size(tmp_path, rule):
    files, _ = make_shards(tmp_path, [2600, 1700, 3100], seed=2)
    stage_of = stages if rule == "packed" else (lambda s: (CHUNKS * LOCAL, 0))
    whole, loaders = run_ours(files, 2, 14, stage_of, rule)
    state_at = []
    fresh = [DocumentLoader(files, CHUNKS, stage_of, BOS, r, 2, rule=rule) for r in range(2)]
    for _ in range(14):
        state_at.append(fresh[0].state_dict())
        gather_step(fresh)
    for s in range(0, 14, 3):
        resumed = [DocumentLoader(files, CHUNKS, stage_of, BOS, r, 4, rule=rule) for r in range(4)]
        for loader in resumed:
            loader.load_state_dict(state_at[s])
        assert_same([gather_step(resumed) for _ in range(14 - s)], whole[s:])
    assert state_at[0]["shard"] == 0 and any(st["epoch"] == 1 for st in state_at)  # it wrapped around


def test_mid_step_resume_and_prefetch_thread(tmp_path):
    files, _ = make_shards(tmp_path, [3000, 2500], seed=3)
    plain = DocumentLoader(files, CHUNKS, stages, BOS, 0, 2)
    threaded = DocumentLoader(files, CHUNKS, stages, BOS, 0, 2, prefetch=True)
    for i in range(30):
        if i == 13:  # mid-step (accumulation 4): same world size resumes exactly
            resumed = DocumentLoader(files, CHUNKS, stages, BOS, 0, 2)
            resumed.load_state_dict(threaded.state_dict())
            threaded.close()
            threaded = resumed
        for a, b in zip(plain.next_packed(), threaded.next_packed(), strict=True):
            assert torch.equal(a, b)
    state = plain.state_dict()
    state["micro_step"] = 1
    other = DocumentLoader(files, CHUNKS, stages, BOS, 0, 4)
    with pytest.raises(ConfigError, match="mid-step"):
        other.load_state_dict(state)
    threaded.close()


def test_cu_seqlens_pads_and_merges_what_does_not_fit():
    x = np.array([BOS, 1, 2, BOS, 3, BOS, 4, 5, BOS, 6])
    cu, dropped = cu_seqlens(x, BOS, 8)
    assert cu.tolist() == [0, 3, 5, 8, 10, 10, 10, 10] and dropped == 0
    cu, dropped = cu_seqlens(x, BOS, 4)
    assert cu.tolist() == [0, 3, 5, 10] and dropped == 1


def test_world_size_must_divide_the_chunks(tmp_path):
    """run_data.micro_batch_tokens refuses it in one line (test_loop); the loader only asserts it."""
    files, _ = make_shards(tmp_path, [3000])
    with pytest.raises(AssertionError):
        DocumentLoader(files, CHUNKS, stages, BOS, 0, 3)
