"""The names digen knows, as data, for the processes that must not import torch.

The controller of a distributed run checks a config's ``train.algorithm`` and ``reward[i].name``
before anything starts (:func:`digen.config.load.name_problems`), without importing the
registries that hold the algorithms (:mod:`digen.algos.registry`) and the rewards
(:mod:`digen.rewards.registry`), which import torch; tests keep each table equal to its
registry. Nothing but data here: the schema and the loading both read it, and it imports
nothing.
"""

from __future__ import annotations

ALGORITHM_NAMES = (
    "flow-grpo",
    "flow-grpo-fast",
    "cps",
    "dance-grpo",
    "mix-grpo",
    "grpo-guard",
    "flow-dppo",
    "diffusion-nft",
    "dgpo",
    "awm",
    "online-dpo",
)
"""The algorithm registry's names (:mod:`digen.algos.registry`), in its listing order, for
the processes that must not import torch (a test keeps the two equal)."""

REWARD_NAMES = (
    "aesthetic",
    "brightness",
    "clipscore",
    "color",
    "digit_classifier",
    "geneval",
    "hpsv2",
    "http",
    "imagereward",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "ocr",
    "pickscore",
)
"""The built-in rewards' names (:mod:`digen.rewards.registry`, sorted), for the same
processes (a test keeps the two equal)."""

WHOLE_GROUP_ALGORITHMS = ("dgpo", "online-dpo")
"""Algorithms whose loss couples the samples of a prompt group (a group-level weight), so a
train task must hold whole groups: rollout-assisted training (``schedule.rat``), which splits
a group into halves, defaults to off for them, and ``train.mini_batch_split: samples`` is
refused (by each algorithm's check)."""
