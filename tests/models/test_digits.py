"""The digits demo: the committed SD3 folder, the digit_classifier reward, the builder."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from digen.errors import ConfigError  # noqa: E402
from digen.models.digits import (  # noqa: E402
    IMAGE_SIZE,
    TEXT_LENGTH,
    DigitsRecipe,
    build_digits_assets,
    digit_prompts,
    load_digits,
    split,
    to_pixels,
)
from digen.rewards import build_reward  # noqa: E402
from digen.rewards.digits import DigitClassifierReward, parse_digit, to_classifier_input  # noqa: E402

ASSETS = Path(__file__).resolve().parents[2] / "assets"
MODEL = ASSETS / "digits-sd3"


@pytest.fixture(scope="module")
def reward() -> DigitClassifierReward:
    return DigitClassifierReward()


@pytest.fixture(scope="module")
def pipe():
    from diffusers import StableDiffusion3Pipeline

    p = StableDiffusion3Pipeline.from_pretrained(str(MODEL), local_files_only=True)
    p.set_progress_bar_config(disable=True)
    return p


def held_out_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """The classifier's test split as demo images ``[N, 3, 16, 16]`` in [0, 1], labels ``[N]``."""
    images8, labels = load_digits()
    _, test = split(len(labels), DigitsRecipe().test_fraction, DigitsRecipe().seed)
    return (to_pixels(images8[test]) + 1) / 2, labels[test]


def generate(pipe, digits: list[int], guidance: float, steps: int = 8) -> torch.Tensor:
    out = pipe(
        prompt=[f"a handwritten {d}" for d in digits],
        num_inference_steps=steps,
        guidance_scale=guidance,
        height=IMAGE_SIZE,
        width=IMAGE_SIZE,
        max_sequence_length=TEXT_LENGTH,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    )
    return out.images


# --- the committed pipeline ------------------------------------------------------------------
def test_committed_folder_is_a_small_safetensors_sd3_pipeline():
    index = json.loads((MODEL / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    files = [f for f in MODEL.rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) < 5_000_000
    weights = [f.suffix for f in files if f.suffix in {".safetensors", ".bin", ".pt", ".pth", ".ckpt"}]
    assert weights and set(weights) == {".safetensors"}


def test_pipeline_generates_digit_images(pipe):
    images = generate(pipe, [3, 7], guidance=1.0, steps=4)
    assert images.shape == (2, 3, IMAGE_SIZE, IMAGE_SIZE)
    assert torch.isfinite(images).all() and images.min() >= 0 and images.max() <= 1
    assert not torch.equal(images[0], images[1])


def test_base_model_is_mediocre_without_cfg_and_good_with_it(pipe, reward):
    """Room for RL: guidance 1 follows the prompt about half the time; CFG shows the model
    knows the digits (so RL has a direction to find)."""
    digits = [d for d in range(10) for _ in range(6)]
    prompts = [f"a handwritten {d}" for d in digits]
    plain = float(reward(generate(pipe, digits, guidance=1.0), prompts).mean())
    guided = float(reward(generate(pipe, digits, guidance=4.5), prompts).mean())
    assert 0.25 < plain < 0.75
    assert guided > plain + 0.2


def test_digen_policy_loads_the_folder():
    from digen.models import load_policy

    policy = load_policy(MODEL, height=IMAGE_SIZE, width=IMAGE_SIZE, max_sequence_length=TEXT_LENGTH)
    assert policy.latent_shape() == (1, 8, 8)
    embeds = policy.encode_prompts(digit_prompts()[:2], with_uncond=False)
    assert embeds.tensors["encoder_hidden_states"].shape == (2, 2 * TEXT_LENGTH, 64)


# --- the reward ------------------------------------------------------------------------------
def test_classifier_is_accurate_on_held_out_digits(reward):
    images, labels = held_out_digits()
    assert (reward.probabilities(images).argmax(-1) == labels).float().mean() > 0.95
    right = reward(images, [f"a handwritten {int(d)}" for d in labels])
    wrong = reward(images, [f"a handwritten {(int(d) + 1) % 10}" for d in labels])
    assert right.mean() > 0.9 and wrong.mean() < 0.1
    assert right.dtype == torch.float32 and right.shape == labels.shape


def test_classifier_input_inverts_the_upscaling():
    images8, _ = load_digits()
    assert torch.allclose(to_classifier_input((to_pixels(images8[:20]) + 1) / 2), images8[:20])


@pytest.mark.parametrize(
    "prompt, digit",
    [("a handwritten 7", 7), ("0", 0), ("a handwritten 4.", 4), ("9, handwritten, 9", 9)],
)
def test_parse_digit(prompt, digit):
    assert parse_digit(prompt) == digit


@pytest.mark.parametrize("prompt", ["a handwritten seven", "a handwritten 10", "a 3 next to a 4", ""])
def test_prompt_without_exactly_one_digit_is_a_config_error(prompt, reward):
    with pytest.raises(ConfigError, match="must name exactly one digit"):
        parse_digit(prompt)
    with pytest.raises(ConfigError, match=repr(prompt)):
        reward(torch.zeros(1, 3, IMAGE_SIZE, IMAGE_SIZE), [prompt])


def test_reward_by_name_frames_and_nan(reward):
    built = build_reward("digit_classifier")
    images, labels = held_out_digits()
    prompts = [f"a handwritten {int(d)}" for d in labels[:4]]
    assert torch.equal(built(images[:4], prompts), reward(images[:4], prompts))
    video = torch.stack([images[:4], torch.zeros_like(images[:4])], dim=1)  # [4, 2, 3, H, W]
    expected = (reward(images[:4], prompts) + reward(torch.zeros_like(images[:4]), prompts)) / 2
    assert torch.allclose(reward(video, prompts), expected)
    broken = images[:2].clone()
    broken[1, 0, 0, 0] = float("nan")
    scores = reward(broken, prompts[:2])
    assert torch.isfinite(scores[0]) and torch.isnan(scores[1])


def test_missing_weights_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="make_digits_model.py"):
        build_reward("digit_classifier", weights=str(tmp_path / "none.safetensors"))


# --- the builder -----------------------------------------------------------------------------
@pytest.mark.slow
def test_builder_writes_every_asset(tmp_path):
    recipe = DigitsRecipe(
        classifier_steps=3,
        vae_steps=2,
        transformer_steps=2,
        transformer_layers=1,
        eval_steps=2,
        eval_per_digit=1,
    )
    report = build_digits_assets(tmp_path, recipe, log=lambda _: None)
    for name in (
        "digits-classifier.safetensors",
        "digits-base-grid.png",
        "digits-build.json",
        "digits-sd3/model_index.json",
        "digits-sd3/transformer/diffusion_pytorch_model.safetensors",
    ):
        assert (tmp_path / name).is_file(), name
    assert json.loads((tmp_path / "digits-build.json").read_text()) == report
    assert 0.0 <= report["base_reward_ode"] <= 1.0
    assert report["recipe"]["transformer_steps"] == 2
