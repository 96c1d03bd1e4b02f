"""Rewards: one per module, built by name from the registry.

Importing this package registers the built-ins: ``jpeg_compressibility``,
``jpeg_incompressibility``, ``brightness``, ``color``, ``digit_classifier`` (the digits demo)
and ``http`` (a remote reward server).
"""

from digen.rewards import brightness, digits, http, jpeg  # noqa: F401  (registers the built-ins)
from digen.rewards.base import Reward, filter_finite
from digen.rewards.http import HttpReward
from digen.rewards.registry import WeightedReward, available, build_reward, build_rewards, register

__all__ = [
    "HttpReward",
    "Reward",
    "WeightedReward",
    "available",
    "build_reward",
    "build_rewards",
    "filter_finite",
    "register",
]
