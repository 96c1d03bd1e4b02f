import pytest
import torch

from digen.errors import ConfigError
from digen.rewards import build_reward


def _rgb(r: float, g: float, b: float, n: int = 1, size: int = 4) -> torch.Tensor:
    """n constant images [n, 3, size, size] of colour (r, g, b)."""
    return torch.tensor([r, g, b]).reshape(1, 3, 1, 1).expand(n, 3, size, size).clone()


def test_brightness_exact_on_constant_images():
    images = torch.cat([_rgb(0, 0, 0), _rgb(1, 1, 1), _rgb(0.25, 0.25, 0.25), _rgb(0.6, 0.2, 0.4)])
    scores = build_reward("brightness")(images, ["a"] * 4)
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, torch.tensor([0.0, 1.0, 0.25, 0.4]))


def test_brightness_video_is_mean_over_frames():
    video = torch.stack([torch.cat([_rgb(0.2, 0.2, 0.2), _rgb(0.6, 0.6, 0.6)])])  # [1, 2, 3, 4, 4]
    torch.testing.assert_close(build_reward("brightness")(video, ["v"]), torch.tensor([0.4]))


@pytest.mark.parametrize(
    ("channel", "expected"),
    [("red", 0.6 - 0.3), ("green", 0.2 - 0.5), ("blue", 0.4 - 0.4)],
)
def test_color_is_channel_minus_mean_of_others(channel, expected):
    scores = build_reward("color", channel=channel)(_rgb(0.6, 0.2, 0.4), ["a"])
    torch.testing.assert_close(scores, torch.tensor([expected]))


def test_color_default_red_extremes():
    scores = build_reward("color")(torch.cat([_rgb(1, 0, 0), _rgb(0, 1, 1), _rgb(0.5, 0.5, 0.5)]), ["a"] * 3)
    torch.testing.assert_close(scores, torch.tensor([1.0, -1.0, 0.0]))


def test_color_rejects_unknown_channel():
    with pytest.raises(ConfigError, match="'purple' is not one of red, green, blue"):
        build_reward("color", channel="purple")


def test_nan_pixel_gives_nan_score():
    images = _rgb(0.5, 0.5, 0.5, n=2)
    images[1, 2, 1, 1] = float("nan")
    scores = build_reward("brightness")(images, ["a", "b"])
    assert scores[0] == 0.5 and torch.isnan(scores[1])
