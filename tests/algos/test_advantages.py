"""digen.algos.advantages on small examples worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from digen.algos import group_advantages


def test_two_groups_population_std() -> None:
    # groups {1, 2} and {3, 4}: means 1.5 and 3.5, population std 0.5 each
    adv = group_advantages(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0, 0, 1, 1]))
    a = 0.5 / (0.5 + 1e-4)  # 0.99980004
    torch.testing.assert_close(adv.values, torch.tensor([-a, a, -a, a]))
    torch.testing.assert_close(adv.group_std, torch.full((4,), 0.5))
    assert adv.zero_std_groups == 0
    assert adv.values.dtype == torch.float32


def test_interleaved_and_arbitrary_group_ids() -> None:
    adv = group_advantages([1.0, 3.0, 2.0, 4.0], [70, 3, 70, 3])
    a = 0.5 / (0.5 + 1e-4)
    torch.testing.assert_close(adv.values, torch.tensor([-a, -a, a, a]))


def test_global_std_divides_by_the_batch_std() -> None:
    adv = group_advantages(torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0, 0, 1, 1]), global_std=True)
    # batch population std of 1..4 = sqrt(1.25) = 1.1180340; the mean stays per group
    a = 0.5 / (math.sqrt(1.25) + 1e-4)  # 0.44717...
    torch.testing.assert_close(adv.values, torch.tensor([-a, a, -a, a]))
    torch.testing.assert_close(adv.group_std, torch.full((4,), math.sqrt(1.25)))


def test_unbiased_std_danceGRPO() -> None:
    adv = group_advantages(
        torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0, 0, 1, 1]), unbiased=True, eps=1e-8
    )
    a = 0.5 / (math.sqrt(0.5) + 1e-8)  # std of {1, 2} with ddof 1 = 0.70710678
    torch.testing.assert_close(adv.values, torch.tensor([-a, a, -a, a]))


def test_clamp_to_plus_minus_clip() -> None:
    # one 1 among 50: mean 0.02, std sqrt(0.02 * 0.98) = 0.14, A(1) = 0.98 / 0.1401 = 6.995
    rewards = torch.zeros(50)
    rewards[7] = 1.0
    ids = torch.zeros(50, dtype=torch.long)
    raw = group_advantages(rewards, ids, clip=None)
    assert raw.values[7].item() == pytest.approx(0.98 / (0.14 + 1e-4), rel=1e-5)
    clamped = group_advantages(rewards, ids)
    assert clamped.values[7].item() == 5.0
    assert clamped.values[0].item() == pytest.approx(-0.02 / (0.14 + 1e-4), rel=1e-5)
    assert group_advantages(rewards, ids, clip=2.0).values[7].item() == 2.0


def test_zero_std_and_single_sample_groups_are_zero_and_counted() -> None:
    # group 7: {1, 1} flat; group 3: {2, 3}; group 9: a single sample
    adv = group_advantages([1.0, 1.0, 2.0, 3.0, 5.0], [7, 7, 3, 3, 9])
    a = 0.5 / (0.5 + 1e-4)
    torch.testing.assert_close(adv.values, torch.tensor([0.0, 0.0, -a, a, 0.0]))
    assert adv.zero_std_groups == 2
    torch.testing.assert_close(adv.group_std, torch.tensor([0.0, 0.0, 0.5, 0.5, 0.0]))


def test_equal_rewards_whose_mean_rounds_give_exact_zeros() -> None:
    adv = group_advantages([0.1, 0.1, 0.1], [0, 0, 0], eps=0.0, clip=None)
    assert torch.equal(adv.values, torch.zeros(3))
    assert adv.zero_std_groups == 1


def test_unbiased_single_sample_group_is_not_nan() -> None:
    adv = group_advantages([4.0, 1.0, 3.0], [0, 1, 1], unbiased=True)
    assert torch.isfinite(adv.values).all() and adv.values[0].item() == 0.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_rewards_raise(bad: float) -> None:
    with pytest.raises(ValueError, match="NaN or infinite"):
        group_advantages([1.0, bad], [0, 0])


def test_bad_shapes_and_ids_raise() -> None:
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages([1.0, 2.0], [0])
    with pytest.raises(ValueError, match="integers"):
        group_advantages([1.0, 2.0], torch.tensor([0.0, 1.0]))
