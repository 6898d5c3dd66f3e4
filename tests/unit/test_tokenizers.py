"""Tokenizers: GPT-2 against an independent pure-Python BPE over the same files, hash checks that
catch tampered files, and bpe:N against rustbpe's own encoder after a save/load round trip."""

import itertools
import json
import shutil

import numpy as np
import pytest
import regex

from speedrun.data import tokenizers
from speedrun.data.sources import iter_documents
from speedrun.data.tokenizers import (
    TOKENIZER_FILE,
    gpt2_file_paths,
    load_tokenizer,
    save_tokenizer,
    train_bpe_tokenizer,
)
from speedrun.errors import ConfigError, DataError

rustbpe = pytest.importorskip("rustbpe")  # a package dependency; absent from the GPU image

SAMPLES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's 2024; they'll've 12345678 things!",
    "  leading spaces,\ttabs\n\nand   newlines  \n",
    "naïve café, Ærøskøbing, Straße — «quotes» “curly”",
    "中文字符和日本語のテキスト、한국어도",
    "emoji 🎉🚀👩‍👩‍👧 and math ∑∫√ and <|endoftext|> as plain text",
]


# ------------------------------------------------------------------ independent GPT-2 reference
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's table, written out from its definition (printable latin-1 ranges kept as-is)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    keep += list(range(ord("®"), ord("ÿ") + 1))
    table, n = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


class ReferenceGPT2:
    """The original GPT-2 encoder algorithm: regex split, then greedy lowest-rank pair merges."""

    pattern = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")

    def __init__(self, vocab_bpe, encoder_json):
        self.encoder = json.loads(encoder_json.read_text())
        merges = [tuple(line.split()) for line in vocab_bpe.read_text().split("\n")[1:] if line]
        self.ranks = {pair: i for i, pair in enumerate(merges)}
        self.byte_table = _bytes_to_unicode()

    def bpe(self, word):
        word = list(word)
        while len(word) > 1:
            best = min(zip(word, word[1:], strict=False), key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    merged.append(word[i] + word[i + 1])
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        return word

    def encode(self, text):
        ids = []
        for piece in self.pattern.findall(text):
            chars = "".join(self.byte_table[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[t] for t in self.bpe(chars))
        return ids


@pytest.fixture(scope="module")
def gpt2():
    return load_tokenizer("gpt2")


def test_gpt2_known_ids(gpt2):
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.encode("Hello, world!") == [15496, 11, 995, 0]
    assert gpt2.encode(" the") == [262]
    assert (gpt2.name, gpt2.vocab_size, gpt2.eot_id) == ("gpt2", 50257, 50256)
    assert gpt2.decode([50256]) == "<|endoftext|>"


def test_gpt2_matches_reference_bpe(gpt2):
    ref = ReferenceGPT2(*gpt2_file_paths())
    texts = SAMPLES + list(itertools.islice(iter_documents("wiki-vital"), 0, 2000, 200))
    for text in texts:
        assert gpt2.encode(text) == ref.encode(text), text[:60]


def test_gpt2_round_trip_and_specials_are_text(gpt2):
    for text in SAMPLES:
        assert gpt2.decode(gpt2.encode(text)) == text
    ids = gpt2.encode("a <|endoftext|> b")
    assert 50256 not in ids and gpt2.decode(ids) == "a <|endoftext|> b"


def test_token_byte_lengths_sum_to_utf8_bytes(gpt2):
    lengths = gpt2.token_byte_lengths()
    assert lengths.dtype == np.int32 and lengths.shape == (50257,)
    assert lengths[50256] == 0 and lengths[15496] == len(b"Hello")
    for text in SAMPLES:
        assert int(lengths[gpt2.encode(text)].sum()) == len(text.encode("utf-8"))


def _copies(tmp_path):
    vocab, encoder = gpt2_file_paths()
    return shutil.copy(vocab, tmp_path / "vocab.bpe"), shutil.copy(encoder, tmp_path / "encoder.json")


def test_gpt2_hash_check_catches_tampering(tmp_path, monkeypatch, gpt2):
    vocab, encoder = _copies(tmp_path)
    monkeypatch.setattr(tokenizers, "gpt2_file_paths", lambda: (vocab, encoder))
    assert load_tokenizer("gpt2").hash == gpt2.hash  # untouched copies load

    text = vocab.read_text()
    vocab.write_text(text.replace("Ġ t", "Ġ x", 1))  # swap one merge
    with pytest.raises(DataError) as err:
        load_tokenizer("gpt2")
    assert str(vocab) in str(err.value) and "sha256" in str(err.value)

    vocab.write_text(text)
    encoder.unlink()
    with pytest.raises(DataError) as err:
        load_tokenizer("gpt2")
    assert str(encoder) in str(err.value)


def test_unknown_names_are_config_errors(tmp_path):
    for name in ["gpt3", "bpe", "bpe:abc", "bpe:100", "bpe:70000"]:
        with pytest.raises(ConfigError):
            load_tokenizer(name, tmp_path)
    with pytest.raises(ConfigError, match="data folder"):
        load_tokenizer("bpe:512")


# ------------------------------------------------------------------ bpe:N
@pytest.fixture(scope="module")
def corpus():
    return list(itertools.islice(iter_documents("wiki-vital"), 600))


@pytest.fixture(scope="module")
def bpe512(corpus):
    return train_bpe_tokenizer(corpus, 512)


def test_bpe_train_save_load_round_trip(tmp_path, corpus, bpe512):
    assert (bpe512.name, bpe512.vocab_size, bpe512.eot_id) == ("bpe:512", 512, 511)
    save_tokenizer(bpe512, tmp_path)
    loaded = load_tokenizer("bpe:512", tmp_path)
    assert loaded.hash == bpe512.hash
    for text in corpus[:50] + SAMPLES:
        ids = loaded.encode(text)
        assert ids == bpe512.encode(text)
        assert max(ids) < 511  # the special id never comes out of ordinary text
        assert loaded.decode(ids) == text
    lengths = loaded.token_byte_lengths()
    assert lengths[511] == 0
    for text in SAMPLES:
        assert int(lengths[loaded.encode(text)].sum()) == len(text.encode("utf-8"))


def test_bpe_matches_rustbpe_encoder(corpus, bpe512):
    """rustbpe's own encoder, trained the same way, is the independent reference."""
    ref = rustbpe.Tokenizer()
    ref.train_from_iterator(iter(corpus), 511)
    for text in corpus[::37] + SAMPLES:
        assert bpe512.encode(text) == list(ref.encode(text))


def test_bpe_file_problems(tmp_path, bpe512):
    with pytest.raises(DataError, match=TOKENIZER_FILE):
        load_tokenizer("bpe:512", tmp_path)
    path = save_tokenizer(bpe512, tmp_path)
    with pytest.raises(DataError, match="bpe:512"):
        load_tokenizer("bpe:1024", tmp_path)  # the folder holds another vocabulary
    doc = json.loads(path.read_text())
    doc["ranks"][300][1], doc["ranks"][301][1] = doc["ranks"][301][1], doc["ranks"][300][1]
    path.write_text(json.dumps(doc))
    with pytest.raises(DataError, match="hash"):
        load_tokenizer("bpe:512", tmp_path)
    path.write_text("{not json")
    with pytest.raises(DataError, match="invalid"):
        load_tokenizer("bpe:512", tmp_path)


def test_bpe_small_corpus_keeps_vocab_size():
    tok = train_bpe_tokenizer(["ab ab ab", "abc"], 1000)
    assert tok.vocab_size == 1000 and tok.eot_id == 999
    assert tok.decode(tok.encode("ab abc")) == "ab abc"
    assert len(tok.token_byte_lengths()) == 1000
