"""Rewards: one per module, built by name from the registry.

Importing this package registers the built-ins: ``jpeg_compressibility``,
``jpeg_incompressibility``, ``brightness``, ``color``, ``digit_classifier`` (the digits demo),
``http`` (a remote reward server), the model rewards ``pickscore``, ``clipscore``,
``hpsv2``, ``imagereward``, ``aesthetic``, ``ocr`` (their packages and weights load only when
one is built) and ``geneval`` (a GenEval reward server).
"""

from digen.rewards import (  # noqa: F401  (registers the built-ins)
    aesthetic,
    brightness,
    clipscore,
    digits,
    geneval,
    hpsv2,
    http,
    imagereward,
    jpeg,
    ocr,
    pickscore,
)
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
