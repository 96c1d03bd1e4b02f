"""digen.algos.timesteps: counts, determinism and shapes of the selections."""

from __future__ import annotations

import pytest
import torch

from digen.algos import sde_step_mask, select_timesteps


@pytest.mark.parametrize(
    "num_steps, fraction, expected",
    [(10, 0.99, 9), (10, 0.6, 6), (20, 0.4, 8), (100, 0.29, 28), (3, 0.1, 1), (10, 1.0, 10)],
)
def test_prefix_counts(num_steps: int, fraction: float, expected: int) -> None:
    assert select_timesteps(num_steps, strategy="prefix", fraction=fraction) == list(range(expected))


def test_random_never_trains_the_last_step_and_is_seeded() -> None:
    seen = set()
    for seed in range(40):
        steps = select_timesteps(
            10, strategy="random", fraction=0.6, generator=torch.Generator().manual_seed(seed)
        )
        assert len(steps) == 5 and steps == sorted(set(steps))  # int(9 * 0.6), DanceGRPO's count
        assert all(0 <= i < 9 for i in steps)
        again = select_timesteps(
            10, strategy="random", fraction=0.6, generator=torch.Generator().manual_seed(seed)
        )
        assert steps == again
        seen.add(tuple(steps))
    assert len(seen) > 10
    full = select_timesteps(10, strategy="random", fraction=1.0, generator=torch.Generator().manual_seed(0))
    assert full == list(range(9))


def test_window_is_contiguous_in_range_and_seeded() -> None:
    starts = set()
    for seed in range(40):
        steps = select_timesteps(
            6, strategy="window", fraction=1.0, window=3, window_range=(0, 6),
            generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
        assert steps == list(range(steps[0], steps[0] + 3)) and 0 <= steps[0] <= 3
        again = select_timesteps(
            6, strategy="window", fraction=1.0, window=3, window_range=(0, 6),
            generator=torch.Generator().manual_seed(seed),
        )  # fmt: skip
        assert steps == again
        starts.add(steps[0])
    assert starts == {0, 1, 2, 3}


def test_the_default_window_range_is_the_first_half() -> None:
    """(0, num_steps // 2): 10 steps, window 2 start in 0..3; 6 steps, window 3 always at 0."""
    draw = lambda n, w, seed: select_timesteps(  # noqa: E731
        n, strategy="window", fraction=1.0, window=w, generator=torch.Generator().manual_seed(seed)
    )
    assert {draw(10, 2, seed)[0] for seed in range(60)} == {0, 1, 2, 3}
    assert {draw(6, 3, seed)[0] for seed in range(20)} == {0}
    with pytest.raises(ValueError, match=r"window_range=\(0, 2\) \(the default, the first half\) is shorter"):
        draw(5, 3, 0)
    with pytest.raises(ValueError, match="0 <= lo < hi <= num_steps=10"):
        select_timesteps(10, strategy="window", fraction=1.0, window=2, window_range=(4, 12))


def test_sde_mask() -> None:
    assert sde_step_mask(5, [1, 2], "window") == [False, True, True, False, False]
    assert sde_step_mask(5, [0, 1, 2], "prefix") == [True] * 5
    assert sde_step_mask(5, [3], "random") == [True] * 5


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="num_steps=1"):
        select_timesteps(1, strategy="random", fraction=0.5)
    with pytest.raises(ValueError, match="window=4"):
        select_timesteps(3, strategy="window", fraction=1.0, window=4)
    with pytest.raises(ValueError, match="fraction"):
        select_timesteps(10, strategy="prefix", fraction=0.0)
    with pytest.raises(ValueError, match="strategy"):
        select_timesteps(10, strategy="all", fraction=0.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outside"):
        sde_step_mask(3, [3], "window")
