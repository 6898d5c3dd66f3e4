"""The 2024-11 … 2025-01 architecture switches: what each adds, how layers are wired, that the
backends agree inside the model, and that every new recipe trains end to end at a shrunken size."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from speedrun.config import ModelConfig, OptimConfig
from speedrun.config.labels import label_table
from speedrun.errors import ConfigError
from speedrun.model.families import build_model
from speedrun.model.gpt2024.layout import value_embed_layout
from speedrun.model.gpt2024.model import GPT
from speedrun.model.labels import labelled
from speedrun.model.layers import Rotary, rotary_frequencies, softcap
from speedrun.optim.rules import MUON_GROUPS, param_rules
from speedrun.recipes import load_recipe

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

BASE = dict(
    vocab_size=256,
    n_layer=6,
    n_head=2,
    n_embd=64,
    max_seq_len=512,
    positional="rotary",
    norm="rmsnorm",
    activation="relu2",
    bias=False,
    fused_qkv=False,
    qk_norm=True,
    embed_norm=True,
    tie_embeddings=False,
    init="torch",
    eot_id=0,
)
NEW_RECIPES = [
    "shortcuts-2024-11",
    "unet-2024-11",
    "flex-2024-11",
    "value-embed-2024-12",
    "unet-value-embed-2024-12",
    "record-2025-01",
    "demo-2025-01",
]


def tiny(**switches) -> ModelConfig:
    return ModelConfig(**{**BASE, **switches})


def n_params(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(cfg).parameters())


def randomize(model: GPT, seed: int = 0) -> GPT:
    """Replace zero inits and unit lambdas with random values so every path shows in the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(
                torch.randn(p.shape, generator=g) * (0.1 if p.dim() >= 2 else 0.5)
                + (0 if p.dim() >= 2 else 1)
            )
    return model


def docs_batch(T: int = 512, batch: int = 1) -> torch.Tensor:
    x = torch.randint(1, 256, (batch, T), generator=torch.Generator().manual_seed(1))
    x[:, [s for s in (0, 77, 128, 129, 300, 301, 450) if s < T]] = 0
    return x


L, D, V = BASE["n_layer"], BASE["n_embd"], BASE["vocab_size"]


@pytest.mark.parametrize(
    "switches, added",
    [
        (dict(value_residual=True), L),  # one λ per layer
        (dict(value_residual=True, value_mix="lambdas"), 2 * L),
        (dict(x0_shortcut=True), 2 * L),
        (dict(unet=True), L // 2),
        (dict(value_embeds="per-layer"), L * V * D + L),
        (dict(value_embeds="unet", value_mix="lambdas"), L // 2 * V * D + 2 * L),
        (dict(value_embeds="ends", value_embed_tables=2, value_mix="lambdas"), 2 * V * D + 2 * L),
        (dict(no_attention_layers="1,4"), -2 * 4 * D * D),
        (dict(vocab_size=250, pad_embeddings=False), -6 * D),  # embedding 250 rows, head still 256
        (
            dict(
                window=128,
                document_mask=True,
                attn_scale=0.12,
                rope_half_truncated=True,
                softcap_form="sigmoid",
                logit_softcap=15.0,
                embed_dtype="bf16",
                init="scaled-uniform",
                window_pattern="LSSLSS",
            ),
            0,
        ),
    ],
)
def test_each_switch_adds_exactly_its_parameters(switches, added):
    assert n_params(tiny(**switches)) - n_params(tiny()) == added


def test_value_embedding_layouts_follow_the_records():
    cfg12 = dict(n_layer=12)
    assert value_embed_layout(tiny(**cfg12, value_embeds="per-layer")) == list(range(12))
    assert value_embed_layout(tiny(**cfg12, value_embeds="unet")) == [0, 1, 2, 3, 4, 5, 5, 4, 3, 2, 1, 0]
    ends = [0, 1, 2] + [None] * 6 + [0, 1, 2]
    assert value_embed_layout(tiny(**cfg12, value_embeds="ends", value_embed_tables=3)) == ends
    assert value_embed_layout(tiny(**cfg12)) == [None] * 12


def capture_blocks(model: GPT):
    """Forward hooks recording each block's input residual and output residual."""
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, block in enumerate(model.blocks):
        block.register_forward_hook(lambda mod, args, out, i=i: seen.__setitem__(i, (args[0], out[0])))
    return seen


@pytest.mark.parametrize("n_layer", [6, 5])
def test_unet_skip_adds_encoder_layer_i_to_decoder_layer_L_minus_1_minus_i(n_layer):
    model = randomize(build_model(tiny(n_layer=n_layer, unet=True)))
    seen = capture_blocks(model)
    with torch.no_grad():
        model(docs_batch(64))
    n_skip = n_layer // 2
    for i in range(n_skip):
        d = n_layer - 1 - i
        weight = model.skip_weights[d - (n_layer - n_skip)]
        expected = seen[d - 1][1] + weight * seen[i][1]
        torch.testing.assert_close(seen[d][0], expected)
    if n_layer % 2:  # the middle layer takes the previous output unchanged
        torch.testing.assert_close(seen[n_skip][0], seen[n_skip - 1][1])


def test_x0_shortcut_starts_as_identity_and_mixes_the_embedding():
    torch.manual_seed(0)
    plain = build_model(tiny())
    torch.manual_seed(0)
    shortcut = build_model(tiny(x0_shortcut=True))
    x = docs_batch(64)
    with torch.no_grad():
        torch.testing.assert_close(shortcut(x), plain(x))  # λ = (1, 0): same function at init
        shortcut.blocks[2].lambdas.copy_(torch.tensor([0.5, 2.0]))
        seen = capture_blocks(shortcut)
        shortcut(x)
        x0 = F.rms_norm(shortcut.wte(x), (D,))
    block = shortcut.blocks[2]
    mixed = 0.5 * seen[2][0] + 2.0 * x0
    with torch.no_grad():
        expected = mixed + block.attn(block.norm1(mixed))[0]
        expected = expected + block.mlp(block.norm2(expected))
    torch.testing.assert_close(seen[2][1], expected)


def record_mixing(model: GPT) -> list:
    """Wrap every attention's mix_values to record (raw v, other) per layer."""
    calls: list = [None] * len(model.blocks)
    for i, block in enumerate(model.blocks):
        if block.attn is None:
            continue
        original = block.attn.mix_values

        def spy(v, other, i=i, original=original):
            calls[i] = (v, other)
            return original(v, other)

        block.attn.mix_values = spy
    return calls


def test_value_residual_feeds_the_first_layers_v_to_every_layer():
    model = randomize(build_model(tiny(value_residual=True)))
    calls = record_mixing(model)
    with torch.no_grad():
        model(docs_batch(64))
    v_first = calls[0][0]
    # layer 0 mixes its v with itself, as the record does (so its λ gets a gradient under DDP)
    assert all(calls[i][1] is v_first for i in range(L))
    v, other = calls[3]
    lam = model.blocks[3].attn.lamb
    torch.testing.assert_close(model.blocks[3].attn.mix_values(v, other), (1 - lam) * v + lam * v_first)


@pytest.mark.parametrize("layout, tables", [("per-layer", L), ("unet", L // 2), ("ends", 2)])
def test_value_embeddings_reach_the_layers_of_their_layout(layout, tables):
    cfg = tiny(value_embeds=layout, value_embed_tables=2, value_mix="lambdas")
    model = randomize(build_model(cfg))
    assert len(model.value_embeds) == tables
    calls = record_mixing(model)
    x = docs_batch(64)
    with torch.no_grad():
        model(x)
        for i, j in enumerate(value_embed_layout(cfg)):
            v, other = calls[i]
            lam = model.blocks[i].attn.lambdas
            if j is None:
                assert other is None
                torch.testing.assert_close(model.blocks[i].attn.mix_values(v, None), lam[0] * v)
            else:
                torch.testing.assert_close(other, model.value_embeds[j](x))
                expected = lam[0] * v + lam[1] * other.view_as(v)
                torch.testing.assert_close(model.blocks[i].attn.mix_values(v, other), expected)


def test_labels_route_new_parameters():
    """The Muon optimizer's groups, from the labels the model parts declare."""
    model = build_model(
        tiny(value_embeds="unet", value_mix="lambdas", unet=True, x0_shortcut=True, fused_qkv=True)
    )
    roles = {group: [] for group in MUON_GROUPS}
    for e in param_rules(model, label_table(OptimConfig(name="muon"), 16)):
        roles[e.rule.group].append(e.name)
    assert set(roles["embed"]) == {"wte.weight"} | {f"value_embeds.{j}.weight" for j in range(L // 2)}
    assert "skip_weights" in roles["scalar"]
    assert all(
        f"blocks.{i}.lambdas" in roles["scalar"] and f"blocks.{i}.attn.lambdas" in roles["scalar"]
        for i in range(L)
    )
    assert all(name.startswith("blocks.") for name in roles["matrix"])
    ids = [id(p) for _, p, _ in labelled(model)]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))
    assert sum(map(len, roles.values())) == len(ids)


def test_sigmoid_softcap_is_the_tanh_softcap_shifted():
    z = torch.randn(4, 50) * 40
    torch.testing.assert_close(
        softcap(z, 15.0, "sigmoid"), 15 * torch.tanh(z / 15) + 15, atol=1e-4, rtol=1e-5
    )
    torch.testing.assert_close(softcap(z, 15.0, "sigmoid"), 30 * torch.sigmoid(z / 7.5))  # Sub3Min's form
    targets = torch.randint(0, 50, (4,))
    torch.testing.assert_close(
        F.cross_entropy(softcap(z, 15.0, "sigmoid"), targets),
        F.cross_entropy(softcap(z, 15.0, "tanh"), targets),
    )


def test_half_truncated_rotary_against_complex_rotation():
    head_dim, T = 16, 40
    freqs = rotary_frequencies(head_dim, 10000.0, half_truncated=True)
    expected = torch.cat([(1 / 1024) ** torch.linspace(0, 1, head_dim // 4), torch.zeros(head_dim // 4)])
    torch.testing.assert_close(freqs, expected)
    x = torch.randn(2, 3, T, head_dim)
    out = Rotary(head_dim, T, 10000.0, half_truncated=True)(x)
    pairs = torch.complex(*x.chunk(2, dim=-1))  # (x1 + i·x2) · e^{-iθ}
    angle = torch.outer(torch.arange(T, dtype=torch.float32), freqs)
    ref = pairs * torch.polar(torch.ones_like(angle), -angle)
    torch.testing.assert_close(out, torch.cat([ref.real, ref.imag], dim=-1), atol=1e-5, rtol=1e-5)
    half = head_dim // 4
    torch.testing.assert_close(out[..., half : head_dim // 2], x[..., half : head_dim // 2])  # zero frequency


def test_attention_scale_and_dropped_attention_layers():
    model = build_model(tiny(attn_scale=0.12, no_attention_layers="2"))
    assert model.blocks[2].attn is None and model.blocks[2].norm1 is None
    assert model.blocks[0].attn.scale == 0.12 and build_model(tiny()).blocks[0].attn.scale is None
    assert torch.isfinite(model(docs_batch(64), docs_batch(64))).all()


def test_bf16_embeddings_keep_fp32_master_weights_elsewhere():
    model = randomize(build_model(tiny(embed_dtype="bf16", value_embeds="unet", value_mix="lambdas")))
    assert model.wte.weight.dtype == torch.bfloat16 and model.value_embeds[0].weight.dtype == torch.bfloat16
    assert (
        model.lm_head.weight.dtype == torch.float32 and model.blocks[0].attn.c_q.weight.dtype == torch.float32
    )
    # no autocast: CastedLinear casts the fp32 weights to the bf16 activations
    loss = model(docs_batch(64), docs_batch(64))
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert model.blocks[0].attn.c_q.weight.grad.dtype == torch.float32


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("model.window_pattern=LSL", "one L or S per layer"),
        ("model.no_attention_layers=12", "layers are 0..11"),
        ("model.no_attention_layers=a", "comma-separated layer numbers"),
        ("model.value_residual=true", "choose one"),
        ("model.attention=cudnn", "not one of auto, sdpa, flex"),
        # the user turns the window off and states a pattern for it (the recipe's own pattern stays quiet)
        ("model.window=0 model.window_pattern=LSSSLSSLSSSL", "has no effect while model.window=0"),
    ],
)
def test_bad_switches_name_the_key(override, fragment):
    with pytest.raises(ConfigError) as info:
        load_recipe("record-2025-01", override.split())
    assert fragment in str(info.value)


# ------------------------------------------------------------------------------------------------
# every new recipe trains a few steps end to end, shrunk (text_data: the session dataset of conftest.py)

SHRINK = [
    "model.n_layer=4",
    "model.n_head=2",
    "model.n_embd=64",
    "model.vocab_size=512",
    "model.max_seq_len=512",
    "data.tokenizer=bpe:512",
    "train.seq_len=256",
    "train.micro_batch_tokens=256",
    "train.global_batch_tokens=512",
    "train.steps=3",
    "train.warmdown_steps=1",
    "train.val_every=0",
    "train.log_every=1",  # record recipes log every 10th step by default
    "train.val_tokens=512",
    "train.timing_warmup_steps=1",
    "train.compile=off",
    "train.device=cpu",
]
PER_RECIPE = {  # layer-count-dependent switches, resized for 4 layers
    "record-2025-01": [
        "model.window_pattern=LSSL",
        "model.no_attention_layers=2",
        "model.value_embed_tables=1",
    ],
    "demo-2025-01": ["model.window_pattern=LSSL"],
}


@pytest.mark.parametrize("recipe", NEW_RECIPES)
def test_new_recipe_trains_end_to_end(recipe, text_data, tmp_path):
    from speedrun.data.meta import load_meta
    from speedrun.train.loop import train

    eot = load_meta(text_data)["eot_id"]
    cfg = load_recipe(
        recipe, SHRINK + PER_RECIPE.get(recipe, []) + [f"data.dir={text_data}", f"model.eot_id={eot}"]
    )
    summary = train(cfg, tmp_path / "run")
    assert math.isfinite(summary["final_val_loss"]) and summary["final_val_loss"] < math.log(512) + 0.5
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train_loss" in r] == [1, 2, 3]


# ------------------------------------------------------------------------------------------------
# GPU checks (skipped without CUDA)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_cuda_record_recipe_runs_20_full_size_steps(tmp_path):
    from speedrun.tools.bench import run_bench

    result = run_bench(load_recipe("record-2025-01"), torch.device("cuda"), steps=20, warmup=2)
    assert math.isfinite(result["loss_last"]) and result["loss_last"] < result["loss_first"] - 1.0
    print(json.dumps(result))
