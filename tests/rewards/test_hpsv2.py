"""hpsv2: an open_clip-layout checkpoint (as HPS ships it) loaded into transformers' CLIPModel
scores what open_clip's own forward computes: checked against an open_clip-style network
written here (fused in_proj attention, x @ proj projections, argmax-EOT text pooling)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from digen.errors import ConfigError
from digen.rewards import build_reward
from digen.rewards.hpsv2 import open_clip_to_transformers
from tests.rewards.conftest import save_tiny_clip

D, HEADS, LAYERS, INNER, OUT, PATCH, SIZE, CTX = 32, 2, 2, 64, 16, 8, 32, 77


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True)
        self.mlp = nn.Sequential(
            OrderedDict(c_fc=nn.Linear(D, INNER), gelu=nn.GELU(), c_proj=nn.Linear(INNER, D))
        )

    def forward(self, x, mask=None):
        y = self.ln_1(x)
        x = x + self.attn(y, y, y, need_weights=False, attn_mask=mask)[0]
        return x + self.mlp(self.ln_2(x))


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.resblocks = nn.ModuleList([Block() for _ in range(LAYERS)])

    def forward(self, x, mask=None):
        for block in self.resblocks:
            x = block(x, mask)
        return x


class Visual(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, D, PATCH, PATCH, bias=False)
        self.class_embedding = nn.Parameter(torch.randn(D))
        self.positional_embedding = nn.Parameter(torch.randn((SIZE // PATCH) ** 2 + 1, D))
        self.ln_pre, self.ln_post, self.transformer = nn.LayerNorm(D), nn.LayerNorm(D), Tower()
        self.proj = nn.Parameter(torch.randn(D, OUT))

    def forward(self, pixels):
        x = self.conv1(pixels).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_embedding.expand(x.shape[0], 1, D), x], dim=1) + self.positional_embedding
        x = self.ln_post(self.transformer(self.ln_pre(x)))
        return x[:, 0] @ self.proj


class OpenClipStyle(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.visual = Visual()
        self.token_embedding = nn.Embedding(vocab, D)
        self.positional_embedding = nn.Parameter(torch.randn(CTX, D))
        self.transformer, self.ln_final = Tower(), nn.LayerNorm(D)
        self.text_projection = nn.Parameter(torch.randn(D, OUT))
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def encode_text(self, ids, eot_id):
        mask = torch.full((CTX, CTX), float("-inf")).triu(1)
        x = self.ln_final(self.transformer(self.token_embedding(ids) + self.positional_embedding, mask))
        # open_clip pools at text.argmax(-1): the first EOT, CLIP's largest id
        return x[torch.arange(len(ids)), (ids == eot_id).int().argmax(-1)] @ self.text_projection


@pytest.fixture(scope="module")
def hps(tmp_path_factory):
    """(checkpoint .pt as HPS ships it, ViT folder, reference network)."""
    folder = save_tiny_clip(tmp_path_factory.mktemp("vit-h"), hidden_act="gelu")
    from transformers import CLIPTokenizer

    torch.manual_seed(5)
    ref = OpenClipStyle(len(CLIPTokenizer.from_pretrained(str(folder)))).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # LayerNorm weights/biases away from 1/0 too
    path = tmp_path_factory.mktemp("hps") / "HPS_v2.1_compressed.pt"
    torch.save({"state_dict": {f"module.{k}": v for k, v in ref.state_dict().items()}}, path)
    return path, folder, ref


def test_score_is_open_clip_cosine(hps):
    path, folder, ref = hps
    from transformers import CLIPProcessor

    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (3, 3, 40, 36), generator=g).float() / 255
    prompts = ["a cat", "a red car on a road", "two dogs"]
    reward = build_reward("hpsv2", checkpoint=str(path), processor=str(folder))
    got = reward(images, prompts)

    proc = CLIPProcessor.from_pretrained(str(folder))
    pixels = [(x * 255).round().to(torch.uint8).permute(1, 2, 0).numpy() for x in images]
    ids = proc(text=prompts, padding="max_length", max_length=CTX, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        img = ref.visual(proc(images=pixels, return_tensors="pt")["pixel_values"])
        txt = ref.encode_text(ids, proc.tokenizer.eos_token_id)
    expected = ((img / img.norm(dim=-1, keepdim=True)) * (txt / txt.norm(dim=-1, keepdim=True))).sum(-1)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert got.unique().numel() == 3
    one_by_one = build_reward("hpsv2", checkpoint=str(path), processor=str(folder), batch_size=1)(
        images, prompts
    )
    torch.testing.assert_close(one_by_one, got, rtol=0, atol=1e-5)
    images[2, 0, 0, 0] = float("nan")
    scores = reward(images, prompts)
    assert torch.isnan(scores[2]) and torch.equal(scores[:2], got[:2])


def test_not_an_open_clip_checkpoint_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="not part of an open_clip CLIP model"):
        open_clip_to_transformers({"unet.conv_in.weight": torch.zeros(1)})


def test_missing_checkpoint_names_it(hps, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="HPS_v2.1_compressed.pt") as err:
        build_reward("hpsv2", processor=str(hps[1]))
    assert "\n" not in str(err.value)
