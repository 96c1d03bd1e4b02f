"""ocr: Flow-GRPO's OCR reward with the real PP-OCRv4 ONNX models of rapidocr-onnxruntime, on
text rendered with PIL."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from digen.errors import ConfigError
from digen.rewards.ocr import edit_distance, ocr_score, target_text

pytest.importorskip("rapidocr_onnxruntime", reason="the ocr reward needs pip install 'digen[rewards]'")


def render(text: str, size: tuple[int, int] = (320, 128)) -> torch.Tensor:
    """Black text on white, ``[3, H, W]`` in [0, 1]."""
    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).text((16, 40), text, fill="black", font=ImageFont.load_default(size=40))
    return torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 255


@pytest.fixture(scope="module")
def reward():
    from digen.rewards import build_reward

    return build_reward("ocr")


def test_right_text_scores_high_and_wrong_text_low(reward):
    images = torch.stack([render("OPEN 24"), render("OPEN 24"), render("CLOSED")])
    prompts = ['a shop sign that says "open 24"', 'a sign reading "Garden Party"', 'a door sign, "CLOSED"']
    scores = reward(images, prompts)
    assert scores[0] >= 0.8 and scores[2] >= 0.8
    assert scores[1] <= 0.3


def test_formula_against_a_hand_computation():
    # Flow-GRPO: spaces removed, lowercased, d = min(lev, len(target)), 1 - d / len(target)
    assert edit_distance("kitten", "sitting") == 3 and edit_distance("", "abc") == 3
    assert ocr_score("Hello World", "helloworld") == 1.0
    assert ocr_score("HELL0", "hello") == pytest.approx(1 - 1 / 5)
    assert ocr_score("a much longer text", "ab") == 0.0  # distance capped at len(target)
    assert target_text('a sign "Hi there" and "other"') == "Hi there"


def test_prompt_without_quotes_is_refused(reward):
    with pytest.raises(ConfigError, match="double quotes"):
        reward(render("OPEN")[None], ["a sign with no quoted text"])


def test_nan_sample_batching_and_video(reward):
    images = torch.stack([render("OPEN"), render("STOP"), render("EXIT")])
    prompts = ['"open"', '"stop"', '"exit"']
    bad = images.clone()
    bad[1, 0, 0, 0] = float("nan")
    scores = reward(bad, prompts)
    assert torch.isnan(scores[1]) and torch.isfinite(scores[[0, 2]]).all()
    whole = reward(images, prompts)
    reward.batch_size = 1
    try:
        assert torch.equal(reward(images, prompts), whole)
    finally:
        reward.batch_size = 16
    video = torch.stack([render("OPEN"), render("ZZZZ")])[None]  # one sample, two frames
    frames = [reward(video[:, f], ['"open"']) for f in range(2)]
    assert reward(video, ['"open"']) == pytest.approx(float((frames[0] + frames[1]) / 2))


def test_digen_train_with_the_ocr_reward_runs_offline(tiny_sd3, tmp_path, monkeypatch):
    import json

    import yaml
    from typer.testing import CliRunner

    from digen.cli.main import app
    from tests.conftest import small_config_data

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = small_config_data(
        tiny_sd3,
        iterations=1,
        prompts={"items": ['a sign that says "open"', 'a poster with the word "sale"']},
        reward=[{"name": "ocr"}],
    )
    path = tmp_path / "ocr.yaml"
    path.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(
        app, ["train", str(path), "--out", str(tmp_path / "run"), "--log-format", "quiet"]
    )
    assert result.exit_code == 0, result.output
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert 0.0 <= row["reward_mean"] <= 1.0 and len(row["rewards"]) == 8
