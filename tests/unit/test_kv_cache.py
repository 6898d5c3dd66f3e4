"""Cached decoding against the full forward: same logits position by position, same greedy tokens,
for shrunk `demo` and `demo-2025-01` models (windows, document masks, U-Net, value embeddings)."""

import pytest
import torch

from speedrun.config import Config
from speedrun.model.families import build_model
from speedrun.model.gpt2024.model import GPT
from speedrun.model.kv_cache import generate
from speedrun.recipes import load_recipe
from tests.decoding import cached_logits
from tests.model_refs import generate_uncached
from tests.recipe_cover import recipe_cover
from tests.recipe_matrix import shrunk

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

SHRINK = ["model.n_embd=64", "model.n_head=2", "model.vocab_size=300", "model.eot_id=299"]
CASES = {
    "demo": ["model.max_seq_len=96", "train.seq_len=64", "train.micro_batch_tokens=64"],
    "demo-window-docs": [  # token-granular sliding window + document mask on the demo block
        "model.max_seq_len=96",
        "model.window=12",
        "model.document_mask=true",
        "model.value_residual=true",
        "model.x0_shortcut=true",
        "train.seq_len=64",
        "train.micro_batch_tokens=64",
    ],
    "demo-2025-01": [  # block windows (LSSL: 256 / 128 tokens), U-Net, value embeddings, doc mask
        "model.max_seq_len=384",
        "model.window=256",
        "model.window_warmup=none",
        "train.seq_len=384",
        "train.micro_batch_tokens=384",
        "train.global_batch_tokens=384",
    ],
}


RECORD = [  # record-2025-01 as recorded: bf16 embeddings, an MLP-only layer, 128-token block windows
    "model.n_layer=4",
    "model.max_seq_len=256",
    "model.window=128",
    "model.window_pattern=LSSL",
    "model.no_attention_layers=2",
    "model.value_embed_tables=1",
    "train.seq_len=256",
    "train.micro_batch_tokens=256",
    "train.global_batch_tokens=256",
    "train.val_tokens=256",
]


def _model(case: str) -> GPT:
    if case == "record-2025-01":
        cfg = load_recipe(case, SHRINK + RECORD)
    else:
        recipe = "demo-2025-01" if case == "demo-2025-01" else "demo"
        cfg = load_recipe(recipe, SHRINK + CASES[case] + ["model.embed_dtype=fp32"])
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    with torch.no_grad():  # zero-init heads/projections would make every logit equal: randomize all
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


def _tokens(model: GPT, n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, model.cfg.vocab_size - 1, (2, n), generator=g)
    idx[:, 0] = model.cfg.eot_id
    idx[0, n // 3] = idx[1, n // 2] = idx[0, 2 * n // 3] = model.cfg.eot_id  # several documents per row
    return idx


@pytest.mark.parametrize("case", list(CASES))
def test_cached_logits_match_full_forward(case):
    model = _model(case)
    n = model.cfg.max_seq_len - 8
    idx = _tokens(model, n)
    with torch.no_grad():
        full = model(idx)
    torch.testing.assert_close(cached_logits(model, idx, 5), full, rtol=1e-4, atol=1e-4)


def test_the_window_and_document_mask_matter():
    """Guard against a vacuous pass: without the window/mask, the full forward would differ."""
    model = _model("demo-window-docs")
    idx = _tokens(model, 80)
    with torch.no_grad():
        masked = model(idx)
        model.cfg.window, model.cfg.document_mask = 0, False
        plain = model(idx)
    assert not torch.allclose(masked[:, 40:], plain[:, 40:], atol=1e-3)


@pytest.mark.parametrize("case", ["demo", "demo-2025-01", "record-2025-01"])
def test_greedy_generation_with_and_without_cache_is_identical(case):
    model = _model(case)
    prompt = _tokens(model, 150 if case == "record-2025-01" else 12)  # record: the window bites
    steps = 40 if case == "demo" else 24
    cached = torch.stack(list(generate(model, prompt, steps, temperature=0.0)), dim=1)
    plain = torch.stack(list(generate_uncached(model, prompt, steps)), dim=1)
    assert cached.shape == (2, steps)
    assert torch.equal(cached, plain)
    assert (cached < model.cfg.vocab_size).all()


def test_sampling_is_reproducible_with_a_seed_and_respects_top_k():
    model = _model("demo")
    prompt = _tokens(model, 4)[:1]

    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return torch.cat(list(generate(model, prompt, 20, temperature=1.0, top_k=3, generator=g)))

    assert torch.equal(run(3), run(3))
    with torch.no_grad():  # each sampled token is among the 3 most likely after its prefix
        seq = torch.cat([prompt[0], run(3)])
        logits = model(seq[None])[0, prompt.size(1) - 1 : -1, : model.cfg.vocab_size]
    top3 = logits.topk(3, dim=-1).indices
    assert (top3 == seq[prompt.size(1) :, None]).any(dim=-1).all()


def test_generation_stops_at_the_context_length():
    model = _model("demo")
    prompt = _tokens(model, model.cfg.max_seq_len - 3)
    assert len(list(generate(model, prompt, 50, temperature=0.0))) == 3


LONG = [  # 512 tokens under the shrunk 192-token window: block listing (12-08) hides keys from 384 on
    "model.max_seq_len=512",
    "train.seq_len=512",
    "train.micro_batch_tokens=512",
    "train.global_batch_tokens=512",  # the shrunk stages' tokens: a staged recipe refuses a batch no step has
]
#: Token-granular long/short windows with block listing: no bundled recipe has that combination.
VARIANTS = {"token-long-short": ("unet-value-embed-2024-12", "model.window_pattern=LSSL")}


def decode_config(recipe: str, *extra: str) -> Config:
    """The recipe shrunk as in the recipe matrix, at 512 tokens."""
    return shrunk(recipe, "train.dtype=fp32", *LONG, *extra)


def _shrunk_model(recipe: str, *extra: str) -> GPT:
    cfg = decode_config(recipe, *extra)
    torch.manual_seed(0)
    model = (
        build_model(cfg.model).float().eval()
    )  # bf16-model recipes in fp32: the logic, without its rounding
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model


def _long_documents(model: GPT) -> torch.Tensor:
    """(2, 512) tokens whose documents outlast every window: row 0 one document from position 100 on,
    row 1 a single document (short documents would hide what the window hides)."""
    idx = torch.randint(
        0, model.cfg.vocab_size - 1, (2, model.cfg.max_seq_len), generator=torch.Generator().manual_seed(1)
    )
    idx[:, 0] = idx[0, 100] = model.cfg.eot_id
    return idx


@pytest.mark.parametrize("recipe", [*recipe_cover(decode_config), *VARIANTS])
def test_every_recipe_decodes_with_the_cache_as_its_full_forward(recipe):
    """Every bundled recipe's switches (value residual, QK-norm order, rotary precision, bf16 model,
    windows, block listing, ...) shrunk as in the recipe matrix, at 512 tokens so that every window kind
    (long/short, token/block granularity, block listing) hides keys: cached logits equal the full
    forward's, so cached decoding cannot drift from the model when a switch is added to one only.
    The recipes are a cover (tests/recipe_cover.py): together they use every model setting value and
    every distinct attention layout (mask, windows, attending layers, value embeddings) of every recipe."""
    name, *extra = VARIANTS.get(recipe, (recipe,))
    model = _shrunk_model(name, *extra)
    idx = _long_documents(model)
    with torch.no_grad():
        full = model(idx)
    torch.testing.assert_close(cached_logits(model, idx, 400), full, rtol=1e-4, atol=1e-4)


def test_block_listing_bites_at_the_decoding_tests_length():
    """Guard against a vacuous pass above: the 12-08 block listing (2 blocks for a 192-token window)
    first hides keys from a query at position 256 on, so it changes the logits of the last blocks only."""
    model = _shrunk_model("unet-value-embed-2024-12")
    idx = _long_documents(model)
    with torch.no_grad():
        listed = model(idx)
        model.cfg.window_block_list = False
        unlisted = model(idx)
    assert torch.equal(listed[:, :256], unlisted[:, :256])
    assert not torch.allclose(listed[:, 256:], unlisted[:, 256:], atol=1e-3)


@pytest.mark.slow
def test_sample_decodes_a_staged_yarn_checkpoint_as_the_run_validated_it(text_data, tmp_path, monkeypatch):
    """`speedrun sample` built a fresh model from the checkpoint: full causal attention and no YaRN, while
    the run validated with its final stage's windows and rescaled rotary table. The first token's
    cached logits must equal the trained model's own forward at the final validation, on the prompt."""
    from speedrun.cli import main
    from speedrun.data.meta import load_meta, tokenizer_for_data
    from speedrun.data.sources import iter_documents
    from speedrun.model import kv_cache
    from speedrun.model.generate import prompt_ids
    from speedrun.tools.runs import find_checkpoint
    from speedrun.train import loop
    from speedrun.train.run.checkpoint import read_weights
    from tests.e2e.test_stages_training import staged

    tokenizer = tokenizer_for_data(text_data, load_meta(text_data))
    text = next(d for d in iter_documents("wiki-vital") if len(tokenizer.encode(d)) > 400)
    prompt = tokenizer.decode(tokenizer.encode(text)[:200])  # past the 1-block (128-token) short window
    idx = prompt_ids(tokenizer, prompt, "cpu")
    assert 150 < idx.size(1) < 250
    seen = []  # the run's own forward on the prompt at every validation; the last is the final one
    real_evaluate = loop.evaluate

    def evaluate(model, *args, **kwargs):
        with torch.no_grad():
            seen.append(model(idx)[0, -1].clone())
        return real_evaluate(model, *args, **kwargs)

    monkeypatch.setattr(loop, "evaluate", evaluate)
    out = tmp_path / "run"
    loop.train(load_recipe("demo", [*staged(text_data), "train.dtype=fp32"]), out)
    monkeypatch.undo()

    first = []  # what sample's first cached forward gives for the prompt's last position
    real_forward = kv_cache.forward_cached

    def forward_cached(model, ids, cache):
        logits = real_forward(model, ids, cache)
        if not first:
            first.append(logits[0, -1].clone())
        return logits

    monkeypatch.setattr(kv_cache, "forward_cached", forward_cached)
    assert main(["sample", str(out), "--prompt", prompt, "--max-tokens", "1", "--temperature", "0"]) == 0
    torch.testing.assert_close(first[0], seen[-1], rtol=1e-4, atol=1e-4)
    # not vacuous: the same weights in a fresh model (initial windows, no YaRN) give other logits
    fresh = build_model(load_recipe("demo", [*staged(text_data), "train.dtype=fp32"]).model).eval()
    fresh.load_state_dict(read_weights(find_checkpoint(out) / "model.safetensors")[0], strict=False)
    with torch.no_grad():
        assert not torch.allclose(fresh(idx)[0, -1], seen[-1], atol=1e-2)
