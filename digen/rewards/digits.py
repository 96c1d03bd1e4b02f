"""``digit_classifier``: the probability a small CNN gives to the digit the prompt names.

The reward of the digits demo (``assets/digits-sd3``). The classifier is trained by
``scripts/make_digits_model.py`` on scikit-learn's 8x8 handwritten digits and stored as
safetensors in ``assets/digits-classifier.safetensors``. Images are white ink on black, like
the training data: a sample is turned to grayscale (channel mean) and area-downsampled to
8x8, the exact inverse of how the demo's 16x16 training images were made from the 8x8 ones.

Prompts name one digit as a numeral ("a handwritten 7"); a prompt with no digit, or with
two different ones, is a :class:`~digen.errors.ConfigError` (the reward cannot guess).
Video ``[B, F, 3, H, W]`` scores the mean over frames.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from digen.errors import ConfigError
from digen.rewards.base import Metadata, Reward, check_batch, flatten_frames, mean_over_frames
from digen.rewards.registry import register

CLASSIFIER_SIZE = 8
"""Side of the classifier's grayscale input, in pixels (scikit-learn's digits are 8x8)."""

DEFAULT_WEIGHTS = Path(__file__).resolve().parents[2] / "assets" / "digits-classifier.safetensors"
"""Where ``scripts/make_digits_model.py`` writes the classifier (repository checkout)."""

_DIGIT = re.compile(r"(?<![0-9])[0-9](?![0-9])")


class DigitClassifier(nn.Module):
    """A small CNN over 8x8 grayscale digits (about 40k parameters).

    ``forward``: ``[B, 1, 8, 8]`` in ``[0, 1]`` -> logits ``[B, 10]``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def to_classifier_input(images: torch.Tensor) -> torch.Tensor:
    """Samples -> the classifier's input.

    Args:
        images: ``[B, C, H, W]`` float in ``[0, 1]`` (C = 1 or 3; any H, W >= 8).

    Returns:
        ``[B, 1, 8, 8]`` float32: channel mean, area-downsampled (2x2 block means for 16x16),
        clamped to ``[0, 1]``.
    """
    gray = images.detach().float().cpu().mean(dim=1, keepdim=True)
    if gray.shape[-2:] != (CLASSIFIER_SIZE, CLASSIFIER_SIZE):
        gray = F.adaptive_avg_pool2d(gray, CLASSIFIER_SIZE)
    return gray.clamp(0.0, 1.0)


def parse_digit(prompt: str) -> int:
    """The one digit a prompt names: ``"a handwritten 7"`` -> 7.

    Raises:
        ConfigError: no standalone numeral 0-9 in the prompt, or two different ones.
    """
    found = {int(m) for m in _DIGIT.findall(prompt)}
    if len(found) != 1:
        what = "names no digit" if not found else f"names several digits {sorted(found)}"
        raise ConfigError(
            f"digit_classifier: prompt {prompt!r} {what}; each prompt must name exactly one digit "
            "as a numeral, e.g. 'a handwritten 7' (see configs/prompts/digits.txt)"
        )
    return found.pop()


def load_classifier(path: str | Path = DEFAULT_WEIGHTS) -> DigitClassifier:
    """The classifier with the weights stored at ``path`` (safetensors), in eval mode.

    Raises:
        ConfigError: ``path`` does not exist (names the script that makes it).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"digit_classifier: weights {str(path)!r} do not exist; build them with "
            "python scripts/make_digits_model.py, or pass kwargs.weights"
        )
    model = DigitClassifier()
    model.load_state_dict(load_file(str(path)))
    return model.eval()


@register("digit_classifier")
class DigitClassifierReward(Reward):
    """Softmax probability, in ``[0, 1]``, of the digit each prompt names.

    Args:
        weights: path to the classifier's safetensors (default: the committed one).
    """

    name = "digit_classifier"

    def __init__(self, weights: str | Path = DEFAULT_WEIGHTS):
        self.model = load_classifier(weights)

    @staticmethod
    def prompt_problems(prompts: list[str], **kwargs: object) -> list[str]:
        """Before a run starts (:mod:`digen.checks`): the prompts this reward cannot score (no
        digit, or several), the first few named, and a missing weights file."""
        bad = []
        for prompt in dict.fromkeys(prompts):
            try:
                parse_digit(prompt)
            except ConfigError:
                bad.append(prompt)
        problems = []
        if bad:
            shown = ", ".join(repr(p) for p in bad[:3]) + (
                f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            )
            problems.append(
                f"{len(bad)} prompt(s) name no digit or several: {shown}; each prompt must name exactly "
                "one digit as a numeral, e.g. 'a handwritten 7' (see configs/prompts/digits.txt)"
            )
        weights = Path(str(kwargs.get("weights", DEFAULT_WEIGHTS)))
        if not weights.is_file():
            problems.append(
                f"weights {str(weights)!r} do not exist; build them with python scripts/make_digits_model.py"
            )
        return problems

    @torch.no_grad()
    def probabilities(self, images: torch.Tensor) -> torch.Tensor:
        """``[B, C, H, W]`` in ``[0, 1]`` -> class probabilities ``[B, 10]`` float32."""
        return self.model(to_classifier_input(images)).softmax(dim=-1)

    def __call__(
        self, images: torch.Tensor, prompts: list[str], metadata: Metadata | None = None
    ) -> torch.Tensor:
        check_batch(images, prompts)
        digits = torch.tensor([parse_digit(p) for p in prompts], dtype=torch.long)
        frames, n = flatten_frames(images)
        probs = self.probabilities(frames)  # [B*F, 10]
        scores = probs.gather(1, digits.repeat_interleave(n)[:, None]).squeeze(1)
        bad = ~torch.isfinite(frames.reshape(frames.shape[0], -1)).all(dim=1)
        scores[bad] = float("nan")
        return mean_over_frames(scores, n)
