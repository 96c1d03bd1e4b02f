"""``train.zero_advantage``: which samples a train task trains, and the row count the
optimizer step divides by (the gradient itself against Flow-GRPO's filtered mean:
tests/trainer/test_gradient_oracle.py ``test_zero_advantage_samples_as_the_peers``)."""

from __future__ import annotations

import pytest
import torch

from digen.errors import RewardError
from digen.iteration import IterationBook
from digen.rollout import GroupTask
from digen.training import TrainStats

REWARDS = [
    [0.0, 0.5, 0.5, 1.0],  # samples 1 and 2 sit at the group mean: advantage exactly 0
    [0.25, 0.25, 0.25, 0.25],  # a flat group
    [0.1, float("nan"), 0.7, 0.3],  # a non-finite reward: dropped in either mode
]


def book_of(cfg, rewards: list[list[float]]) -> IterationBook:
    g = cfg.rollout.group_size
    groups = [
        GroupTask(0, i, "a red square", tuple(range(i * g, (i + 1) * g)), 0) for i in range(len(rewards))
    ]
    book = IterationBook(cfg, 0, groups)
    for i, r in enumerate(rewards):
        book.add_rewards(i, torch.tensor(r))
    return book


@pytest.mark.parametrize("global_std", [False, True])
def test_drop_leaves_out_exactly_the_zero_advantage_samples(small_config, global_std: bool) -> None:
    """Flow-GRPO's mask is per sample (``advantages.abs().sum(dim=1) != 0``): a flat group's
    samples and a sample at its group's mean alike."""
    keep = book_of(small_config(train__global_std=global_std, rollout__batch_size=12), REWARDS)
    drop = book_of(
        small_config(train__global_std=global_std, train__zero_advantage="drop", rollout__batch_size=12),
        REWARDS,
    )
    assert [keep.train_spec(g).samples for g in range(3)] == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 2, 3]]
    assert [drop.train_spec(g).samples for g in range(3)] == [[0, 3], [], [0, 2, 3]]
    assert all(a != 0 for g in range(3) for a in drop.train_spec(g).advantages)
    assert keep.train_spec(1).advantages == [0.0] * 4
    assert (keep.zero_advantage_dropped, drop.zero_advantage_dropped) == (0, 2 + 4)
    # the released rows are what the step divides by
    for book in (keep, drop):
        for g in range(3):
            spec = book.train_spec(g)
            book.add_gradient(g, {"w": torch.ones(1) * spec.rows}, TrainStats(rows=spec.rows))
    assert keep.gradient()[1] == 2 * (4 + 4 + 3)  # prefix 0.5 of 4 steps: 2 rows per sample
    assert drop.gradient()[1] == 2 * (2 + 0 + 3)
    assert drop.metrics()["zero_advantage_dropped"] == 6


def test_drop_with_every_group_flat_fails_naming_the_setting(small_config) -> None:
    book = book_of(small_config(train__zero_advantage="drop"), [[0.5] * 4, [0.25] * 4])
    for g in range(2):
        assert book.train_spec(g).samples == []
        book.add_gradient(g, {"w": torch.zeros(1)}, TrainStats())
    with pytest.raises(RewardError, match="zero_advantage"):
        book.gradient()
