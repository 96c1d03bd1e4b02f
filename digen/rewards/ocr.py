"""``ocr``: how well the text the prompt asks for can be read in the image.

Flow-GRPO's OCR reward (``flow_grpo/ocr.py``, ``OcrScorer.__call__``), with PaddleOCR's
PP-OCRv4 models run through ONNX Runtime (the ``rapidocr-onnxruntime`` wheel ships them, so
it works offline):

- target: the text between the first pair of double quotes of the prompt
  (``prompt.split('"')[1]``; Flow-GRPO's OCR prompts read ``A sign that says "OPEN"``);
- read: every recognised line, concatenated in detection order; Flow-GRPO keeps lines of
  confidence > 0 (RapidOCR drops those below its ``text_score``, 0.5 by default);
- both with spaces removed and lowercased; ``d = min(Levenshtein(read, target), len(target))``;
- score ``1 - d / len(target)`` in ``[0, 1]`` (1: the exact text).

A prompt without quoted text is a :class:`~digen.errors.ConfigError` (nothing to read for).
Runs on the CPU (ONNX Runtime), whatever the worker's device. Video: every frame is read and
the sample gets the mean over its frames (Flow-GRPO's ``OcrScorer_video_or_image`` samples
frames and averages the positive ones; digen's rule is the plain mean).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from digen.errors import ConfigError
from digen.rewards.base import FrameReward, Metadata
from digen.rewards.pretrained import require_package
from digen.rewards.registry import register


def target_text(prompt: str) -> str:
    """The text between the first pair of double quotes: ``'a sign "Hi there"'`` -> ``Hi there``.

    Raises:
        ConfigError: the prompt has no pair of double quotes, or nothing between them.
    """
    parts = prompt.split('"')
    if len(parts) < 3 or not parts[1].strip():
        raise ConfigError(
            f"ocr: prompt {prompt!r} has no text between double quotes; an OCR prompt names the text "
            'to render in quotes, e.g. A storefront sign that says "OPEN"'
        )
    return parts[1]


def normalise(text: str) -> str:
    """Flow-GRPO's comparison form: spaces removed, lowercase."""
    return text.replace(" ", "").lower()


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    row = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        prev, row[0] = row[0], i
        for j, cb in enumerate(b, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (ca != cb))
    return row[-1]


def ocr_score(read: str, target: str) -> float:
    """``1 - min(d, len(t)) / len(t)`` on the normalised texts (Flow-GRPO's definition)."""
    read, target = normalise(read), normalise(target)
    if not target:
        return 1.0 if not read else 0.0
    return 1.0 - min(edit_distance(read, target), len(target)) / len(target)


@register("ocr")
class OcrReward(FrameReward):
    """Flow-GRPO's OCR reward with RapidOCR's PP-OCRv4 (ONNX).

    Args:
        text_score: lines recognised with a lower confidence are ignored (RapidOCR's default).
        det_limit_side_len, det_limit_type: the detector's input size rule; ``960``/``max``
            (the longer side scaled down to 960, never up) are PaddleOCR's defaults, which
            Flow-GRPO runs; RapidOCR's own (736/min) scales small images up, 5-10x slower.
        batch_size: frames per chunk (OCR runs one image at a time inside a chunk).
        device: accepted for the registry; OCR always runs on the CPU.
    """

    name = "ocr"

    def __init__(
        self,
        text_score: float = 0.5,
        det_limit_side_len: int = 960,
        det_limit_type: Literal["max", "min"] = "max",
        batch_size: int = 16,
        device: str = "cpu",
    ):
        require_package("rapidocr_onnxruntime", self.name, "rapidocr-onnxruntime")
        from rapidocr_onnxruntime import RapidOCR

        self.engine = RapidOCR(
            text_score=float(text_score),
            use_cls=False,
            det_limit_side_len=int(det_limit_side_len),
            det_limit_type=det_limit_type,
        )
        self.batch_size = int(batch_size)

    def read(self, pixels: np.ndarray) -> str:
        """uint8 ``[H, W, 3]`` RGB -> the recognised text, lines concatenated in order."""
        bgr = np.ascontiguousarray(pixels[..., ::-1])  # RapidOCR takes arrays as OpenCV BGR
        result, _ = self.engine(bgr, use_cls=False)
        return "".join(str(line[1]) for line in result or [])

    def score_frames(self, pixels: np.ndarray, prompts: list[str], metadata: Metadata | None) -> torch.Tensor:
        targets = [target_text(p) for p in prompts]
        return torch.tensor([ocr_score(self.read(px), t) for px, t in zip(pixels, targets, strict=True)])
