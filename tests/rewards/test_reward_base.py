import logging

import pytest
import torch

from digen.errors import RewardError
from digen.rewards.base import check_batch, filter_finite, flatten_frames, mean_over_frames, to_uint8


def test_filter_finite_masks_nan_and_inf_and_warns(caplog):
    scores = torch.tensor([0.5, float("nan"), -1.0, float("inf"), float("-inf")])
    with caplog.at_level(logging.WARNING, logger="digen.rewards.base"):
        mask, dropped = filter_finite(scores)
    assert mask.tolist() == [True, False, True, False, False]
    assert dropped == 3
    assert "dropping 3 of 5" in caplog.text and "1, 3, 4" in caplog.text


def test_filter_finite_all_good_is_silent(caplog):
    with caplog.at_level(logging.WARNING, logger="digen.rewards.base"):
        mask, dropped = filter_finite(torch.tensor([0.0, 1.0]))
    assert mask.all() and dropped == 0
    assert caplog.text == ""


def test_flatten_frames_and_mean_over_frames_keep_samples_together():
    video = torch.arange(2 * 3, dtype=torch.float32).reshape(2, 3, 1, 1, 1).expand(2, 3, 3, 2, 2)
    frames, f = flatten_frames(video)
    assert f == 3 and frames.shape == (6, 3, 2, 2)
    per_frame = frames.mean(dim=(1, 2, 3))  # 0, 1, 2 | 3, 4, 5
    assert mean_over_frames(per_frame, f).tolist() == [1.0, 4.0]
    images = torch.zeros(4, 3, 2, 2)
    assert flatten_frames(images) == (images, 1)


def test_to_uint8_rounds_and_clamps_like_flow_grpo():
    x = torch.tensor([0.0, 0.5, 1.0, 1.7, -0.2, float("nan")]).reshape(1, 1, 1, 6).expand(1, 3, 1, 6)
    out = to_uint8(x)
    assert out.shape == (1, 1, 6, 3)
    assert out[0, 0, :, 0].tolist() == [0, 128, 255, 255, 0, 0]


@pytest.mark.parametrize("shape", [(2, 3, 4), (2, 1, 4, 4), (2, 2, 4, 4, 4)])
def test_check_batch_rejects_bad_shapes(shape):
    with pytest.raises(RewardError, match="must be"):
        check_batch(torch.zeros(shape), ["a", "b"])


def test_check_batch_rejects_prompt_count_mismatch():
    with pytest.raises(RewardError, match="2 images but 1 prompts"):
        check_batch(torch.zeros(2, 3, 4, 4), ["a"])
