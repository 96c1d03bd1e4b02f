"""imagereward: a tiny random-weight checkpoint in ImageReward's layout (``ImageReward.pt`` with
BLIP's key names, ``med_config.json``, a bert-base-uncased-style tokenizer folder), loaded
through the real loader into transformers' BLIP modules, scores what a BLIP-style network
written here computes (timm ViT with fused qkv, med.py BERT with cross-attention in every
layer, ImageReward's MLP and normalisation)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from digen.errors import ConfigError
from digen.rewards import available, build_reward, build_rewards
from digen.rewards.imagereward import CLIP_MEAN, CLIP_STD, MAX_LENGTH, MEAN, STD, ImageRewardScore, preprocess

V_WIDTH, V_DEPTH, PATCH, SIZE = 128, 2, 8, 32  # 128 / 64 = 2 ViT heads, as the loader infers
T_WIDTH, T_HEADS, T_DEPTH, T_INNER, T_POS = 32, 2, 2, 64, 40
WORDS = ["a", "cat", "dog", "red", "car", "on", "the", "road", "two", "blue", "sky", "##s"]
VOCAB = ["[PAD]", "[unused0]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]


def linears(*names_and_shapes):
    return nn.ModuleDict({name: nn.Linear(i, o) for name, (i, o) in names_and_shapes})


class VitBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(V_WIDTH, eps=1e-6), nn.LayerNorm(V_WIDTH, eps=1e-6)
        self.attn = linears(("qkv", (V_WIDTH, 3 * V_WIDTH)), ("proj", (V_WIDTH, V_WIDTH)))
        self.mlp = linears(("fc1", (V_WIDTH, 4 * V_WIDTH)), ("fc2", (4 * V_WIDTH, V_WIDTH)))

    def forward(self, x):
        n, length, _ = x.shape
        q, k, v = (
            self.attn["qkv"](self.norm1(x)).reshape(n, length, 3, 2, V_WIDTH // 2).permute(2, 0, 3, 1, 4)
        )
        att = ((q @ k.transpose(-2, -1)) * (V_WIDTH // 2) ** -0.5).softmax(-1)
        x = x + self.attn["proj"]((att @ v).transpose(1, 2).reshape(n, length, V_WIDTH))
        return x + self.mlp["fc2"](F.gelu(self.mlp["fc1"](self.norm2(x))))


class Vit(nn.Module):
    """BLIP's ``VisionTransformer`` (timm names): returns all tokens after the final norm."""

    def __init__(self):
        super().__init__()
        self.patch_embed = nn.ModuleDict({"proj": nn.Conv2d(3, V_WIDTH, PATCH, PATCH)})
        self.cls_token = nn.Parameter(torch.randn(1, 1, V_WIDTH))
        self.pos_embed = nn.Parameter(torch.randn(1, (SIZE // PATCH) ** 2 + 1, V_WIDTH))
        self.blocks = nn.ModuleList([VitBlock() for _ in range(V_DEPTH)])
        self.norm = nn.LayerNorm(V_WIDTH, eps=1e-6)

    def forward(self, pixels):
        x = self.patch_embed["proj"](pixels).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def bert_attention(kv_width):
    return nn.ModuleDict(
        {
            "self": linears(
                ("query", (T_WIDTH, T_WIDTH)), ("key", (kv_width, T_WIDTH)), ("value", (kv_width, T_WIDTH))
            ),
            "output": nn.ModuleDict(
                {"dense": nn.Linear(T_WIDTH, T_WIDTH), "LayerNorm": nn.LayerNorm(T_WIDTH, eps=1e-12)}
            ),
        }
    )


def attend(mods, x, kv, mask_add):
    def heads(t):
        return t.reshape(len(t), -1, T_HEADS, T_WIDTH // T_HEADS).transpose(1, 2)

    q, k, v = (
        heads(mods["self"]["query"](x)),
        heads(mods["self"]["key"](kv)),
        heads(mods["self"]["value"](kv)),
    )
    att = (q @ k.transpose(-2, -1) / math.sqrt(T_WIDTH // T_HEADS) + mask_add).softmax(-1)
    ctx = (att @ v).transpose(1, 2).reshape(x.shape)
    return mods["output"]["LayerNorm"](mods["output"]["dense"](ctx) + x)


class BertLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention, self.crossattention = bert_attention(T_WIDTH), bert_attention(V_WIDTH)
        self.intermediate = nn.ModuleDict({"dense": nn.Linear(T_WIDTH, T_INNER)})
        self.output = nn.ModuleDict(
            {"dense": nn.Linear(T_INNER, T_WIDTH), "LayerNorm": nn.LayerNorm(T_WIDTH, eps=1e-12)}
        )

    def forward(self, h, mask_add, image):
        h = attend(self.crossattention, attend(self.attention, h, h, mask_add), image, 0.0)
        return self.output["LayerNorm"](self.output["dense"](F.gelu(self.intermediate["dense"](h))) + h)


class MedBert(nn.Module):
    """BLIP's ``med.py`` BertModel without pooler: word + position embeddings (no token types),
    med.py's additive padding mask ``(1 - mask) * -10000``."""

    def __init__(self, vocab: int):
        super().__init__()
        self.embeddings = nn.ModuleDict(
            {
                "word_embeddings": nn.Embedding(vocab, T_WIDTH),
                "position_embeddings": nn.Embedding(T_POS, T_WIDTH),
                "LayerNorm": nn.LayerNorm(T_WIDTH, eps=1e-12),
            }
        )
        self.embeddings.register_buffer(
            "position_ids", torch.arange(T_POS).expand(1, -1)
        )  # saved, as med.py's
        self.encoder = nn.ModuleDict({"layer": nn.ModuleList([BertLayer() for _ in range(T_DEPTH)])})

    def forward(self, ids, mask, image):
        e = self.embeddings
        h = e["LayerNorm"](e["word_embeddings"](ids) + e["position_embeddings"](torch.arange(ids.shape[1])))
        mask_add = ((1.0 - mask.float()) * -10000.0)[:, None, None, :]
        for layer in self.encoder["layer"]:
            h = layer(h, mask_add, image)
        return h


class Blip(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.visual_encoder, self.text_encoder = Vit(), MedBert(vocab)
        self.vision_proj, self.text_proj = (
            nn.Linear(V_WIDTH, 16),
            nn.Linear(T_WIDTH, 16),
        )  # unused by the score


class Reference(nn.Module):
    """ImageReward's module tree: ``blip`` + ``mlp.layers`` (Linear/Dropout as its ``MLP``)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.blip = Blip(vocab)
        dims = [T_WIDTH, 1024, 128, 64, 16, 1]
        layers: list[nn.Module] = []
        for i, (d_in, d_out) in enumerate(zip(dims, dims[1:], strict=False)):
            layers += [nn.Linear(d_in, d_out)] + ([nn.Dropout(0.1)] if i < 3 else [])
        self.mlp = nn.ModuleDict({"layers": nn.Sequential(*layers)})

    def feature(self, pixels, ids, mask):
        return self.blip.text_encoder(ids, mask, self.blip.visual_encoder(pixels))[:, 0]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(ImageReward.pt, med_config.json, tokenizer folder, reference network)."""
    root = tmp_path_factory.mktemp("imagereward")
    tok = root / "bert-base-uncased"
    tok.mkdir()
    (tok / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    (tok / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True, "model_max_length": 512}))
    med = {
        "architectures": ["BertModel"],
        "hidden_act": "gelu",
        "hidden_size": T_WIDTH,
        "intermediate_size": T_INNER,
        "layer_norm_eps": 1e-12,
        "max_position_embeddings": T_POS,
        "model_type": "bert",
        "num_attention_heads": T_HEADS,
        "num_hidden_layers": T_DEPTH,
        "pad_token_id": 0,
        "type_vocab_size": 2,
        "vocab_size": len(VOCAB) + 2,  # + [DEC], [ENC], as 30522 + 2 = 30524 in the real one
        "encoder_width": 768,  # overwritten by the ViT's width, as BLIP_Pretrain does
        "add_cross_attention": True,
    }
    (root / "med_config.json").write_text(json.dumps(med))
    torch.manual_seed(3)
    ref = Reference(len(VOCAB) + 2).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # LayerNorm weights/biases away from 1/0 too
    torch.save(ref.state_dict(), root / "ImageReward.pt")
    return root / "ImageReward.pt", root / "med_config.json", tok, ref


def kwargs(files, **extra):
    return {"checkpoint": str(files[0]), "med_config": str(files[1]), "tokenizer": str(files[2]), **extra}


def grid_images(n: int, h: int = SIZE, w: int = SIZE, seed: int = 0) -> torch.Tensor:
    """Images on the uint8 grid (k / 255), so quantisation changes nothing."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, h, w), generator=g).float() / 255


def token_ids(prompt: str) -> list[int]:
    """[CLS] word pieces [SEP] [PAD]... by hand from VOCAB ("dogs" is the pieces dog ##s)."""
    pieces = [p for word in prompt.split() for p in (["dog", "##s"] if word == "dogs" else [word])]
    ids = [VOCAB.index("[CLS]"), *(VOCAB.index(p) for p in pieces)][: MAX_LENGTH - 1]
    ids.append(VOCAB.index("[SEP]"))
    return ids + [0] * (MAX_LENGTH - len(ids))


PROMPTS = ["a cat", "a red car on the road", "two dogs"]


def test_tokens_are_bert_uncased_padded_to_35(files):
    reward = build_reward("imagereward", **kwargs(files))
    long = " ".join(["cat"] * 50)
    got = reward.tokenizer(
        ["A Cat", long], padding="max_length", truncation=True, max_length=MAX_LENGTH, return_tensors="pt"
    )
    assert got["input_ids"].tolist() == [token_ids("a cat"), token_ids(long)]
    assert got["attention_mask"][0].tolist() == [1] * 4 + [0] * (MAX_LENGTH - 4)
    assert reward.tokenizer.convert_tokens_to_ids(["[DEC]", "[ENC]"]) == [len(VOCAB), len(VOCAB) + 1]


def test_score_is_reference_blip_mlp_normalised(files):
    reward = build_reward("imagereward", **kwargs(files))
    images = grid_images(3)
    got = reward(images, PROMPTS)
    assert got.shape == (3,) and got.dtype == torch.float32

    ref = files[3]
    mean, std = torch.tensor(CLIP_MEAN).reshape(3, 1, 1), torch.tensor(CLIP_STD).reshape(3, 1, 1)
    pixels = (images - mean) / std  # 32 x 32 already: resize and crop change nothing
    ids = torch.tensor([token_ids(p) for p in PROMPTS])
    with torch.no_grad():
        f = ref.feature(pixels, ids, (ids != 0).long())
        for i in (0, 2, 4, 6, 7):  # ImageReward's MLP: linear layers, no activation
            layer = ref.mlp["layers"][i]
            f = f @ layer.weight.T + layer.bias
    torch.testing.assert_close(got, (f.squeeze(-1) - MEAN) / STD, rtol=0, atol=1e-5)
    assert got.unique().numel() == 3


def test_batches_equal_one_by_one_and_repeat_exactly(files):
    images = grid_images(3, 40, 56, seed=1)
    reward = build_reward("imagereward", **kwargs(files))
    whole = reward(images, PROMPTS)
    assert torch.equal(reward(images, PROMPTS), whole)
    assert torch.equal(build_reward("imagereward", **kwargs(files))(images, PROMPTS), whole)  # fresh load
    one_by_one = build_reward("imagereward", **kwargs(files, batch_size=1))(images, PROMPTS)
    torch.testing.assert_close(one_by_one, whole, rtol=0, atol=1e-5)
    singles = torch.cat([reward(images[i : i + 1], PROMPTS[i : i + 1]) for i in range(3)])
    torch.testing.assert_close(singles, whole, rtol=0, atol=1e-5)


def test_nan_pixel_gives_nan_and_video_is_frame_mean(files):
    reward = build_reward("imagereward", **kwargs(files))
    images = grid_images(3)
    clean = reward(images, PROMPTS)
    images[1, 2, 5, 5] = float("nan")
    scores = reward(images, PROMPTS)
    assert torch.isnan(scores[1]) and torch.equal(scores[[0, 2]], clean[[0, 2]])
    video = torch.stack([grid_images(3, seed=2), grid_images(3, seed=3)], dim=1)  # [3, 2, 3, H, W]
    frames = torch.stack([reward(video[:, f], PROMPTS) for f in range(2)], dim=1)
    torch.testing.assert_close(reward(video, PROMPTS), frames.mean(dim=1), rtol=0, atol=1e-6)


def test_preprocess_resizes_short_side_and_centre_crops_as_clip(files):
    from transformers import CLIPImageProcessorPil

    g = torch.Generator().manual_seed(4)
    pixels = torch.randint(0, 256, (2, 40, 56, 3), generator=g, dtype=torch.uint8).numpy()  # 40x56 -> 32x44
    clip = CLIPImageProcessorPil(size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE})
    expected = clip(images=list(pixels), return_tensors="pt")["pixel_values"]
    got = preprocess(pixels, SIZE)
    assert got.shape == (2, 3, SIZE, SIZE)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(
        preprocess(pixels.transpose(0, 2, 1, 3), SIZE),
        clip(images=list(pixels.transpose(0, 2, 1, 3)), return_tensors="pt")["pixel_values"],
        rtol=0,
        atol=1e-5,
    )  # landscape too


def test_config_reward_spec_builds_it(files, tmp_path):
    import yaml

    from digen.assembly import build_reward as build_configured_reward
    from digen.config import load_config
    from tests.conftest import required

    assert "imagereward" in available()
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            required({"reward": [{"name": "imagereward", "weight": 1.0, "kwargs": kwargs(files)}]})
        )
    )
    reward = build_configured_reward(load_config(path, check_paths=False), device="cpu")
    assert isinstance(reward, ImageRewardScore) and reward.device == "cpu"
    weighted = build_rewards([{"name": "imagereward", "weight": 2.0, "kwargs": kwargs(files)}])
    images = grid_images(2)
    torch.testing.assert_close(
        weighted(images, PROMPTS[:2]), 2 * reward(images, PROMPTS[:2]), rtol=0, atol=1e-6
    )


def test_missing_checkpoint_is_one_line_naming_it(files, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="ImageReward.pt") as err:
        build_reward("imagereward", med_config=str(files[1]), tokenizer=str(files[2]))
    assert "\n" not in str(err.value) and "kwargs.checkpoint" in str(err.value)
    with pytest.raises(ConfigError, match="tokenizer 'google-bert/bert-base-uncased'") as err:
        build_reward("imagereward", checkpoint=str(files[0]), med_config=str(files[1]))
    assert "\n" not in str(err.value)


def test_not_an_imagereward_checkpoint_is_refused(files, tmp_path):
    wrong = tmp_path / "other.pt"
    torch.save({"visual.conv1.weight": torch.zeros(1)}, wrong)
    with pytest.raises(ConfigError, match=r"has no blip.visual_encoder.\*, blip.text_encoder.\*, mlp.\*"):
        build_reward("imagereward", **kwargs(files, checkpoint=str(wrong)))
    no_vit = tmp_path / "no-vit.pt"
    state = {k: v for k, v in torch.load(files[0], weights_only=True).items() if "pos_embed" not in k}
    torch.save(state, no_vit)
    with pytest.raises(ConfigError, match=r"lacks \['blip.visual_encoder.pos_embed'\]"):
        build_reward("imagereward", **kwargs(files, checkpoint=str(no_vit)))
    small = tmp_path / "med_small.json"
    small.write_text(json.dumps({**json.loads(files[1].read_text()), "num_hidden_layers": 1}))
    with pytest.raises(ConfigError, match="text weights .* do not fit"):
        build_reward("imagereward", **kwargs(files, med_config=str(small)))


# The real checkpoint's architecture, as the image-reward package (1.5) builds it:
# ``blip.create_vit('large', 224)`` (ViT-L/16: width 1024, 24 blocks, 16 heads, MLP ratio 4) and
# ``med_config.json`` (BLIP's BERT-base: 768 wide, 12 layers, 12 heads, vocab 30522 + 2), ``MLP(768)``.
REAL_MED = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "max_position_embeddings": 512,
    "vocab_size": 30524,
    "layer_norm_eps": 1e-12,
    "hidden_act": "gelu",
    "pad_token_id": 0,
    "encoder_width": 768,
    "add_cross_attention": True,
}
REAL_PARAMETERS = 446_665_953 - (1024 * 256 + 256) - (768 * 256 + 256)
"""``ImageReward(med_config)``'s parameter count, measured with the package's own classes by
scripts/check_imagereward_package.py, less BLIP's ``vision_proj``/``text_proj`` (1024 -> 256,
768 -> 256), which the score never uses and digen does not build."""


def real_shapes() -> dict[str, tuple[int, ...]]:
    """Key -> shape of THUDM/ImageReward's ImageReward.pt (the parts the score reads)."""
    v, t, inner, grid = 1024, 768, 3072, (224 // 16) ** 2
    shapes: dict[str, tuple[int, ...]] = {
        "blip.visual_encoder.cls_token": (1, 1, v),
        "blip.visual_encoder.pos_embed": (1, grid + 1, v),
        "blip.visual_encoder.patch_embed.proj.weight": (v, 3, 16, 16),
        "blip.visual_encoder.patch_embed.proj.bias": (v,),
        "blip.visual_encoder.norm.weight": (v,),
        "blip.visual_encoder.norm.bias": (v,),
        "blip.text_encoder.embeddings.word_embeddings.weight": (30524, t),
        "blip.text_encoder.embeddings.position_embeddings.weight": (512, t),
        "blip.text_encoder.embeddings.LayerNorm.weight": (t,),
        "blip.text_encoder.embeddings.LayerNorm.bias": (t,),
    }
    linear = {"attn.qkv": (3 * v, v), "attn.proj": (v, v), "mlp.fc1": (4 * v, v), "mlp.fc2": (v, 4 * v)}
    for i in range(24):
        for name, (o, n) in linear.items():
            shapes |= {f"blip.visual_encoder.blocks.{i}.{name}.weight": (o, n)}
            shapes |= {f"blip.visual_encoder.blocks.{i}.{name}.bias": (o,)}
        for norm in ("norm1", "norm2"):
            shapes |= {f"blip.visual_encoder.blocks.{i}.{norm}.{k}": (v,) for k in ("weight", "bias")}
    for i in range(12):
        layer = f"blip.text_encoder.encoder.layer.{i}"
        for attention, kv in (("attention", t), ("crossattention", v)):
            for name, (o, n) in {"query": (t, t), "key": (t, kv), "value": (t, kv)}.items():
                shapes |= {f"{layer}.{attention}.self.{name}.weight": (o, n)}
                shapes |= {f"{layer}.{attention}.self.{name}.bias": (o,)}
            shapes |= {
                f"{layer}.{attention}.output.dense.weight": (t, t),
                f"{layer}.{attention}.output.dense.bias": (t,),
            }
            shapes |= {f"{layer}.{attention}.output.LayerNorm.{k}": (t,) for k in ("weight", "bias")}
        shapes |= {
            f"{layer}.intermediate.dense.weight": (inner, t),
            f"{layer}.intermediate.dense.bias": (inner,),
        }
        shapes |= {f"{layer}.output.dense.weight": (t, inner), f"{layer}.output.dense.bias": (t,)}
        shapes |= {f"{layer}.output.LayerNorm.{k}": (t,) for k in ("weight", "bias")}
    for i, (n, o) in zip(
        (0, 2, 4, 6, 7), ((t, 1024), (1024, 128), (128, 64), (64, 16), (16, 1)), strict=True
    ):
        shapes |= {f"mlp.layers.{i}.weight": (o, n), f"mlp.layers.{i}.bias": (o,)}
    return shapes


def test_real_size_checkpoint_builds_blip_large_with_the_package_parameter_count(tmp_path):
    from digen.rewards.imagereward import build_imagereward

    med = tmp_path / "med_config.json"
    med.write_text(json.dumps(REAL_MED))
    state = {k: torch.empty(s, device="meta") for k, s in real_shapes().items()}
    with torch.device("meta"):
        model = build_imagereward(state, med, "real-size shapes")
    vision, text = model.vision.config, model.text.config
    assert (vision.hidden_size, vision.num_hidden_layers, vision.num_attention_heads) == (1024, 24, 16)
    assert (vision.patch_size, vision.image_size, vision.intermediate_size) == (16, 224, 4096)
    assert (vision.layer_norm_eps, text.layer_norm_eps, text.encoder_hidden_size) == (1e-6, 1e-12, 1024)
    assert model.text.encoder.layer[11].crossattention.self.key.in_features == 1024
    assert sum(p.numel() for p in model.parameters()) == REAL_PARAMETERS == 446_206_689
    assert sum(math.prod(s) for s in real_shapes().values()) == REAL_PARAMETERS  # every weight is loaded
