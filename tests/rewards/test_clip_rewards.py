"""pickscore, clipscore, aesthetic: real loaders on tiny random-weight CLIP checkpoints saved in
the on-disk layout of the real ones (transformers ``save_pretrained``; LAION's MLP state dict)."""

from __future__ import annotations

import pytest
import torch

from digen.errors import ConfigError
from digen.rewards import build_reward, build_rewards
from digen.rewards.aesthetic import AestheticMLP
from tests.rewards.conftest import save_tiny_clip

PROMPTS = ["a red cat", "a blue dog on a hill", "a photo of a tree", "an old car"]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return save_tiny_clip(tmp_path_factory.mktemp("clip"))


@pytest.fixture(scope="module")
def mlp_file(tmp_path_factory):
    """A random LAION aesthetic MLP for 16-d embeddings, saved as LAION ships it (a .pth state dict)."""
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("mlp") / "sac+logos+ava1-l14-linearMSE.pth"
    torch.save(AestheticMLP(16).state_dict(), path)
    return path


def _kwargs(name, clip_dir, mlp_file):
    if name == "pickscore":
        return {"model": str(clip_dir), "processor": str(clip_dir)}
    if name == "aesthetic":
        return {"model": str(clip_dir), "weights": str(mlp_file)}
    return {"model": str(clip_dir)}


def _images(b: int, seed: int = 0, size: tuple[int, int] = (40, 48)) -> torch.Tensor:
    """Images on the uint8 grid (k / 255), so the rewards' quantisation changes nothing."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, 3, *size), generator=g).float() / 255


def _reference_logits(clip_dir, images, prompts):
    """``logits_per_image`` of the model's own forward (exp(logit_scale) * cosine)."""
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(str(clip_dir)).eval()
    proc = CLIPProcessor.from_pretrained(str(clip_dir))
    pixels = [(x * 255).round().to(torch.uint8).permute(1, 2, 0).numpy() for x in images]
    inputs = proc(text=prompts, images=pixels, padding="max_length", max_length=77, return_tensors="pt")
    with torch.no_grad():
        return model(**inputs).logits_per_image.diagonal(), model, proc, pixels


NAMES = ["pickscore", "clipscore", "aesthetic"]


@pytest.mark.parametrize("name", NAMES)
def test_shape_determinism_and_batching(name, clip_dir, mlp_file):
    kwargs = _kwargs(name, clip_dir, mlp_file)
    images = _images(4)
    whole = build_reward(name, **kwargs)(images, PROMPTS)
    assert whole.shape == (4,) and whole.dtype == torch.float32 and torch.isfinite(whole).all()
    again = build_reward(name, **kwargs)(images, PROMPTS)  # a fresh load gives the same scores
    assert torch.equal(whole, again)
    one_by_one = build_reward(name, batch_size=1, **kwargs)(images, PROMPTS)
    torch.testing.assert_close(one_by_one, whole, rtol=0, atol=1e-5)
    assert whole.unique().numel() == 4  # different samples, different scores


@pytest.mark.parametrize("name", NAMES)
def test_nan_sample_and_video_mean_over_frames(name, clip_dir, mlp_file):
    reward = build_reward(name, **_kwargs(name, clip_dir, mlp_file))
    images = _images(3)
    images[1, 0, 5, 5] = float("nan")
    scores = reward(images, PROMPTS[:3])
    assert torch.isnan(scores[1]) and torch.isfinite(scores[[0, 2]]).all()
    clean = reward(_images(3), PROMPTS[:3])
    torch.testing.assert_close(scores[[0, 2]], clean[[0, 2]], rtol=0, atol=1e-5)
    video = torch.stack([_images(3, seed=s) for s in (0, 1)], dim=1)  # [3, 2, 3, H, W]
    frames = torch.stack([reward(video[:, f], PROMPTS[:3]) for f in range(2)], dim=1)
    torch.testing.assert_close(reward(video, PROMPTS[:3]), frames.mean(dim=1), rtol=0, atol=1e-5)


def test_pickscore_is_logit_scale_times_cosine_over_divisor(clip_dir):
    images = _images(4)
    logits, model, _, _ = _reference_logits(clip_dir, images, PROMPTS)
    scale = float(model.logit_scale.detach().exp())
    assert 10 < scale < 20  # CLIP's initial logit scale, exp(ln(1/0.07)): not 1, so it is really applied
    got = build_reward("pickscore", model=str(clip_dir), processor=str(clip_dir), divisor=26.0)(
        images, PROMPTS
    )
    torch.testing.assert_close(got, logits / 26.0, rtol=0, atol=1e-5)


def test_clipscore_is_logits_per_image_over_100(clip_dir):
    images = _images(4)
    logits, _, _, _ = _reference_logits(clip_dir, images, PROMPTS)
    got = build_reward("clipscore", model=str(clip_dir))(images, PROMPTS)
    torch.testing.assert_close(got, logits / 100, rtol=0, atol=1e-6)


def test_aesthetic_is_laion_mlp_on_normalised_image_embeddings(clip_dir, mlp_file):
    images = _images(4)
    _, model, proc, pixels = _reference_logits(clip_dir, images, PROMPTS)
    with torch.no_grad():
        vision = model.vision_model(pixel_values=proc(images=pixels, return_tensors="pt")["pixel_values"])
        e = model.visual_projection(vision.pooler_output)
    x = e / e.norm(dim=-1, keepdim=True)
    state = torch.load(mlp_file, weights_only=True)
    for i in (0, 2, 4, 6, 7):  # LAION's Linear layers (1, 3, 5 are dropouts)
        x = x @ state[f"layers.{i}.weight"].T + state[f"layers.{i}.bias"]
    got = build_reward("aesthetic", model=str(clip_dir), weights=str(mlp_file))(images, PROMPTS)
    torch.testing.assert_close(got, x.squeeze(-1), rtol=0, atol=1e-5)
    assert got.unique().numel() == 4


def test_worker_device_reaches_the_model(clip_dir):
    reward = build_rewards([{"name": "clipscore", "kwargs": {"model": str(clip_dir)}}], device="cpu")
    assert reward.device == "cpu" and next(reward.clip.parameters()).device.type == "cpu"


@pytest.mark.parametrize("name", NAMES)
def test_missing_model_is_one_line_naming_folder_and_fix(name, tmp_path, mlp_file, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    kwargs = {"model": "nobody/no-such-clip"}
    if name == "aesthetic":
        kwargs["weights"] = str(mlp_file)
    with pytest.raises(ConfigError) as err:
        build_reward(name, **kwargs)
    msg = str(err.value)
    assert "\n" not in msg and "nobody/no-such-clip" in msg and "huggingface-cli download" in msg


def test_aesthetic_missing_weights_names_the_file(clip_dir, tmp_path):
    with pytest.raises(ConfigError, match="no-mlp.pth"):
        build_reward("aesthetic", model=str(clip_dir), weights=str(tmp_path / "no-mlp.pth"))
