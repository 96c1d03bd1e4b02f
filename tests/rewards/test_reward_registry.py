import pytest
import torch

from digen.errors import ConfigError, RewardError
from digen.rewards import Reward, WeightedReward, available, build_reward, build_rewards, register
from digen.rewards import registry as registry_module

PROMPTS = ["a", "b"]


def _images() -> torch.Tensor:
    """Two constant images: (0.6, 0.2, 0.4) -> brightness 0.4, red 0.3; (0, 0, 0) -> 0, 0."""
    first = torch.tensor([0.6, 0.2, 0.4]).reshape(3, 1, 1).expand(3, 4, 4)
    return torch.stack([first, torch.zeros(3, 4, 4)])


class _Const(Reward):
    def __init__(self, values: list[float], name: str = "const"):
        self.values = values
        self.name = name
        self.closed = False

    def __call__(self, images, prompts):
        return torch.tensor(self.values, dtype=torch.float32)

    def close(self):
        self.closed = True


@pytest.fixture
def temp_registry():
    saved = dict(registry_module._REGISTRY)
    yield
    registry_module._REGISTRY.clear()
    registry_module._REGISTRY.update(saved)


def test_builtins_are_registered():
    assert {"jpeg_compressibility", "jpeg_incompressibility", "brightness", "color", "http"} <= set(
        available()
    )
    assert available() == sorted(available())


def test_unknown_name_lists_available_names():
    with pytest.raises(ConfigError) as err:
        build_reward("foo")
    msg = str(err.value)
    assert msg.startswith("reward 'foo' does not exist; available: ")
    for name in available():
        assert name in msg


def test_bad_kwargs_name_the_reward_and_its_params():
    with pytest.raises(ConfigError, match=r"reward 'color' got bad kwargs \['chanel'\].*\(channel\)"):
        build_reward("color", chanel="red")


def test_register_and_build_custom_reward(temp_registry):
    @register("const_test")
    def make(value: float = 1.0) -> Reward:
        return _Const([value, value], name="")

    assert "const_test" in available()
    reward = build_reward("const_test", value=3.0)
    assert reward.name == "const_test"  # empty name filled from the registry
    assert reward(_images(), PROMPTS).tolist() == [3.0, 3.0]
    with pytest.raises(ConfigError, match="registered twice"):
        register("const_test")(lambda: _Const([0.0, 0.0]))


def test_weighted_reward_sums_weighted_scores():
    reward = WeightedReward([(build_reward("brightness"), 2.0), (build_reward("color", channel="red"), -1.0)])
    torch.testing.assert_close(reward(_images(), PROMPTS), torch.tensor([2 * 0.4 - 0.3, 0.0]))
    assert reward.name == "2*brightness+-1*color"


def test_score_parts_returns_unweighted_parts_with_unique_keys():
    reward = WeightedReward([(_Const([1.0, 2.0]), 0.5), (_Const([10.0, 20.0]), 2.0)])
    total, parts = reward.score_parts(_images(), PROMPTS)
    assert total.tolist() == [20.5, 41.0]
    assert list(parts) == ["const", "const#2"]
    assert parts["const#2"].tolist() == [10.0, 20.0]


def test_weighted_reward_propagates_nan_per_sample():
    reward = WeightedReward([(_Const([1.0, float("nan")]), 1.0), (_Const([1.0, 1.0]), 1.0)])
    scores = reward(_images(), PROMPTS)
    assert scores[0] == 2.0 and torch.isnan(scores[1])


def test_weighted_reward_rejects_wrong_shape_and_closes_parts():
    parts = [_Const([1.0, 2.0]), _Const([1.0])]
    reward = WeightedReward([(parts[0], 1.0), (parts[1], 1.0)])
    with pytest.raises(RewardError, match="returned shape"):
        reward(_images(), PROMPTS)
    reward.close()
    assert all(p.closed for p in parts)


def test_build_rewards_from_specs_matches_weighted_sum():
    reward = build_rewards(
        [{"name": "brightness", "weight": 2.0}, {"name": "color", "weight": -1, "kwargs": {"channel": "red"}}]
    )
    assert isinstance(reward, WeightedReward)
    torch.testing.assert_close(reward(_images(), PROMPTS), torch.tensor([0.5, 0.0]))


def test_build_rewards_single_unit_weight_returns_the_reward_itself():
    reward = build_rewards([{"name": "brightness"}])
    assert type(reward).__name__ == "Brightness"
    assert isinstance(build_rewards([{"name": "brightness", "weight": 0.5}]), WeightedReward)


def test_build_rewards_reports_every_problem_at_once():
    with pytest.raises(ConfigError) as err:
        build_rewards(
            [{"name": "foo"}, {"name": "brightness", "weight": "x"}, 3, {"name": "color", "kw": {}}]
        )
    problems = err.value.problems
    assert len(problems) == 4
    assert problems[0].startswith("reward[0].name: reward 'foo' does not exist; available: ")
    assert problems[1] == "reward[1].weight must be a number, got 'x'"
    assert problems[2].startswith("reward[2] must be a mapping")
    assert "reward[3] has unknown keys ['kw']" in problems[3]


@pytest.mark.parametrize("specs", [[], None, {"name": "brightness"}])
def test_build_rewards_rejects_non_list_or_empty(specs):
    with pytest.raises(ConfigError, match="non-empty list"):
        build_rewards(specs)
