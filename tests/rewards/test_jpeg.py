import io

import pytest
import torch
from PIL import Image

from digen.rewards import build_reward
from digen.rewards.jpeg import jpeg_size_kb

PROMPTS = ["p0", "p1"]


def _flat_and_noise(size: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    flat = torch.full((3, size, size), 0.5)
    noise = torch.rand(3, size, size, generator=g)
    return torch.stack([flat, noise])


def test_flat_image_is_more_compressible_than_noise():
    scores = build_reward("jpeg_compressibility")(_flat_and_noise(), PROMPTS)
    assert scores.dtype == torch.float32 and scores.shape == (2,)
    assert scores[0] > scores[1]
    assert (scores < 0).all()


def test_compressibility_is_flow_grpo_formula():
    images = _flat_and_noise()
    pixels = (images[1] * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=95)
    expected = -(buf.tell() / 1000) / 500
    got = build_reward("jpeg_compressibility")(images, PROMPTS)[1].item()
    assert got == pytest.approx(expected, rel=1e-6)


def test_incompressibility_is_size_in_kb_and_negative_of_compressibility():
    images = _flat_and_noise()
    comp = build_reward("jpeg_compressibility")(images, PROMPTS)
    incomp = build_reward("jpeg_incompressibility")(images, PROMPTS)
    torch.testing.assert_close(incomp, jpeg_size_kb(images))
    torch.testing.assert_close(incomp, -500 * comp)
    torch.testing.assert_close(build_reward("jpeg_incompressibility", scale=1 / 500)(images, PROMPTS), -comp)
    assert incomp[1] > incomp[0]


def test_video_scores_mean_over_frames():
    frames = _flat_and_noise()  # [2, 3, H, W] used as 2 frames of one video
    video = frames.unsqueeze(0)  # [1, 2, 3, H, W]
    reward = build_reward("jpeg_incompressibility")
    per_frame = reward(frames, PROMPTS)
    torch.testing.assert_close(reward(video, ["v"]), per_frame.mean().reshape(1))


def test_non_finite_sample_scores_nan_and_others_do_not():
    images = _flat_and_noise()
    images[0, 0, 0, 0] = float("nan")
    scores = build_reward("jpeg_compressibility")(images, PROMPTS)
    assert torch.isnan(scores[0]) and torch.isfinite(scores[1])
