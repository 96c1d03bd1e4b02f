"""MixGRPO's sliding window: GRPOTrainingStates replayed, the rollout plan, Flash's schedule."""

from __future__ import annotations

import pytest

from digen.algos.mix_grpo import ALGORITHM, flash_schedule, max_start, mix_window, window_start
from digen.config import MixGrpoConfig, build_config
from tests.conftest import required


class PeerStates:
    """Tencent-Hunyuan/MixGRPO fastvideo/utils/grpo_states.py ``GRPOTrainingStates``
    (progressive and decay, restated), with digen's one change: past the end is ``cur >=
    max_t`` (the peer's ``>`` leaves an empty window at ``cur == max_t``)."""

    def __init__(
        self, iters, group, max_t, shift, max_iters=None, min_iters=None, decay=False, roll_back=True
    ):
        self.iters, self.group, self.max_t, self.shift = iters, group, max_t, shift
        self.max_iters = iters if max_iters is None else max_iters
        self.min_iters = max(1, iters // 4) if min_iters is None else min_iters
        self.decay, self.roll_back = decay, roll_back
        self.cur = self.in_group = 0

    def current(self) -> list[int]:
        return list(range(self.cur, min(self.cur + self.group, self.max_t)))

    def update(self) -> None:
        self.in_group += 1
        if self.decay:
            progress = self.cur / self.max_t
            needed = max(self.min_iters, int(self.max_iters * (1 - progress) + self.min_iters * progress))
        else:
            needed = self.iters
        if self.in_group >= needed:
            self.in_group = 0
            self.cur += self.group if self.shift is None else self.shift
        if self.cur >= self.max_t:
            if self.roll_back:
                self.cur = self.in_group = 0
            else:
                self.cur = self.max_t - 1


def cfg(steps=25, **mix):
    return build_config(
        required({"rollout": {"num_steps": steps}, "train": {"algorithm": "mix-grpo", "mix_grpo": mix}}),
        check_paths=False,
    )


@pytest.mark.parametrize(
    "mix",
    [
        {"window": 4, "iters_per_window": 25, "shift": 1},  # finetune_flux_grpo_MixGRPO.sh
        {"window": 4, "iters_per_window": 3, "shift": None},  # no overlap
        {"window": 4, "iters_per_window": 10, "schedule": "decay", "max_iters": 10, "min_iters": 1},
        {"window": 2, "iters_per_window": 2, "shift": 1, "roll_back": False},
    ],
)
def test_window_replays_the_peer_state_machine(mix):
    c = cfg(**mix)
    opts = c.train.mix_grpo
    peer = PeerStates(
        opts.iters_per_window,
        opts.window,
        max_start(25),
        opts.shift,
        opts.max_iters,
        opts.min_iters,
        decay=opts.schedule == "decay",
        roll_back=opts.roll_back,
    )
    for k in range(700):
        assert mix_window(c, k) == peer.current(), k
        assert mix_window(c, k)  # never empty
        peer.update()


def test_progressive_window_moves_by_one_step_every_25_iterations_and_rolls_back():
    c = cfg(window=4, iters_per_window=25, shift=1)
    assert [mix_window(c, k) for k in (0, 24, 25, 49, 50)] == [[0, 1, 2, 3]] * 2 + [[1, 2, 3, 4]] * 2 + [
        [2, 3, 4, 5]
    ]
    # the last start is max_t - 1 = 22 (iterations 550..574): a window clipped to step 22; then back to 0
    assert mix_window(c, 574) == [22] and mix_window(c, 575) == [0, 1, 2, 3]


def test_random_window_is_seeded_in_range_and_full():
    c = cfg(window=4, schedule="random")
    starts = [window_start(k, 25, c.train.mix_grpo, c.seed) for k in range(200)]
    assert starts[0] == 0 and len(set(starts)) > 10
    assert all(0 <= s <= 23 - 4 for s in starts)
    assert [len(mix_window(c, k)) for k in range(200)] == [4] * 200
    assert starts == [
        window_start(k, 25, c.train.mix_grpo, c.seed) for k in range(200)
    ]  # every process agrees
    other = build_config(
        required(
            {
                "seed": 1,
                "rollout": {"num_steps": 25},
                "train": {"algorithm": "mix-grpo", "mix_grpo": {"schedule": "random"}},
            }
        ),
        check_paths=False,
    )
    assert starts[1:] != [window_start(k, 25, other.train.mix_grpo, other.seed) for k in range(1, 200)]


def test_rollout_plan_is_ode_sde_ode_and_keeps_the_window():
    c = cfg(steps=8, window=2, iters_per_window=1, shift=2)
    plan = ALGORITHM.rollout_plan(c, 1)  # window [2, 4)
    assert plan.kinds == ("ode", "ode", "sde", "sde", "ode", "ode", "ode", "ode")
    assert plan.keep == (2, 2) and plan.schedule is None
    assert ALGORITHM.trained_steps(c, 1, sample_id=5) == [2, 3]


def test_flash_compresses_the_steps_after_the_window_into_dpm_solver_steps():
    """The peer's ``num_post_steps = int(max((T - last) * ratio, 1))`` points from
    sigma_{last+1} to 0: T = 25, window [0, 4), ratio 0.4 -> int(22 * 0.4) = 8 points, 7 steps."""
    assert flash_schedule(25, 3, 0.4) == [4, 7, 10, 13, 16, 19, 22, 25]
    c = cfg(steps=25, window=4, flash=True, flash_compress=0.4)
    plan = ALGORITHM.rollout_plan(c, 0)
    assert plan.kinds == ("sde",) * 4 + ("dpm2",) * 7
    assert plan.schedule == (0, 1, 2, 3, 4, 7, 10, 13, 16, 19, 22, 25)
    assert plan.keep == (0, 4)
    # at least one step reaches sigma 0, never more points than steps left
    assert flash_schedule(8, 5, 0.01) == [6, 8] and flash_schedule(8, 5, 1.0) == [6, 7, 8]


def test_window_larger_than_the_trainable_steps_is_a_config_error():
    from digen.errors import ConfigError

    with pytest.raises(
        ConfigError, match=r"train.mix_grpo.window \(7\) must be at most rollout.num_steps - 2 \(6\)"
    ):
        cfg(steps=8, window=7)
    assert isinstance(MixGrpoConfig().window, int)
