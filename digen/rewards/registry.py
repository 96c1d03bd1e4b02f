"""Rewards by name, and the weighted sum of several.

A config names its rewards as a list of specs::

    reward:
      - {name: jpeg_compressibility, weight: 1.0}
      - {name: http, weight: 0.5, kwargs: {url: "http://127.0.0.1:8765"}}

:func:`build_rewards` turns that list into one :class:`Reward` (a :class:`WeightedReward`
unless it is a single reward of weight 1).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from digen.errors import ConfigError, RewardError, did_you_mean
from digen.rewards.base import Metadata, Reward, call_reward

RewardFactory = Callable[..., Reward]
F = TypeVar("F", bound=RewardFactory)

_REGISTRY: dict[str, RewardFactory] = {}


def register(name: str) -> Callable[[F], F]:
    """Decorator: make a Reward class (or a factory returning one) buildable as ``name``."""

    def deco(factory: F) -> F:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ConfigError(f"reward '{name}' is registered twice; pick another name")
        _REGISTRY[name] = factory
        return factory

    return deco


def available() -> list[str]:
    """Registered reward names, sorted."""
    return sorted(_REGISTRY)


def factory(name: str) -> RewardFactory | None:
    """The class (or factory) registered as ``name``, or None."""
    return _REGISTRY.get(name)


def unknown(name: str, where: str = "") -> str:
    """The message for a reward name that does not exist: the closest name, then all of them."""
    hint = did_you_mean(name, _REGISTRY)
    if hint:
        return f"{where}reward '{name}' does not exist{hint} (available: {', '.join(available())})"
    return f"{where}reward '{name}' does not exist; available: {', '.join(available())}"


def build_reward(name: str, /, **kwargs: Any) -> Reward:
    """Build the reward registered as ``name`` with ``kwargs``.

    Raises:
        ConfigError: unknown name (the message lists the available ones) or bad kwargs.
    """
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ConfigError(unknown(name))
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        raise ConfigError(
            f"reward '{name}' got bad kwargs {sorted(kwargs)}: {exc}; it takes {_describe_params(factory)}"
        ) from None
    reward = factory(**kwargs)
    if not reward.name:
        reward.name = name
    return reward


def _describe_params(factory: RewardFactory) -> str:
    params = [p.name for p in inspect.signature(factory).parameters.values() if p.kind is not p.VAR_KEYWORD]
    return "(" + ", ".join(params) + ")" if params else "no kwargs"


class WeightedReward(Reward):
    """``sum_i weight_i * reward_i(images, prompts)``; a NaN in any part gives NaN for that sample.

    Args:
        parts: ``[(reward, weight), ...]``, at least one.
    """

    def __init__(self, parts: list[tuple[Reward, float]]):
        if not parts:
            raise ConfigError("WeightedReward needs at least one (reward, weight) pair")
        self.parts = list(parts)
        self.name = "+".join(f"{w:g}*{r.name}" for r, w in self.parts)

    def __call__(
        self, images: torch.Tensor, prompts: list[str], metadata: Metadata | None = None
    ) -> torch.Tensor:
        return self.score_parts(images, prompts, metadata)[0]

    def score_parts(
        self, images: torch.Tensor, prompts: list[str], metadata: Metadata | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Total ``[B]`` and each part's unweighted scores ``{name: [B]}`` (for logging).

        Parts with the same name are keyed ``name``, ``name#2``, ...
        """
        total = torch.zeros(images.shape[0], dtype=torch.float32)
        scores: dict[str, torch.Tensor] = {}
        for reward, weight in self.parts:
            s = call_reward(reward, images, prompts, metadata).detach().float().cpu()
            if s.shape != total.shape:
                raise RewardError(
                    f"reward '{reward.name}' returned shape {tuple(s.shape)} for {images.shape[0]} samples; "
                    "a reward must return one score per sample"
                )
            total = total + weight * s
            scores[_unique_key(reward.name, scores)] = s
        return total, scores

    def close(self) -> None:
        for reward, _ in self.parts:
            reward.close()


def score_each(
    reward: Callable[..., torch.Tensor],
    images: torch.Tensor,
    prompts: list[str],
    metadata: Metadata | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(total [B], parts [B, K])`` float32 on the CPU: the reward's score and each of its K
    rewards' unweighted scores, in the config's order (``train.multi_reward: per_reward``).
    A :class:`WeightedReward`'s total is what calling it returns; any other reward is its own
    single part (K = 1)."""
    if isinstance(reward, WeightedReward):
        total, scores = reward.score_parts(images, prompts, metadata)
        return total, torch.stack(list(scores.values()), dim=1)
    s = call_reward(reward, images, prompts, metadata).detach().float().cpu()
    return s, s.reshape(-1, 1)


def _unique_key(name: str, taken: dict[str, torch.Tensor]) -> str:
    key, n = name, 1
    while key in taken:
        n += 1
        key = f"{name}#{n}"
    return key


_SPEC_KEYS = {"name", "weight", "kwargs"}


def build_rewards(specs: list[dict[str, Any]], device: str | None = None) -> Reward:
    """Build the reward a config asks for from ``[{name, weight=1.0, kwargs={}}, ...]``.

    Every problem in the list is reported at once. A single spec with weight 1 returns that
    reward itself; anything else returns a :class:`WeightedReward`. ``device`` (the worker's)
    goes to every reward that takes a ``device`` argument and whose kwargs do not set one.
    """
    if not isinstance(specs, list) or not specs:
        raise ConfigError(f"reward specs must be a non-empty list of {{name, weight, kwargs}}, got {specs!r}")
    problems: list[str] = []
    for i, spec in enumerate(specs):
        problems += _spec_problems(i, spec)
    if problems:
        raise ConfigError(problems)
    parts: list[tuple[Reward, float]] = []
    try:
        for spec in specs:
            kwargs = _with_device(spec["name"], dict(spec.get("kwargs", {})), device)
            parts.append((build_reward(spec["name"], **kwargs), float(spec.get("weight", 1.0))))
    except Exception:
        for reward, _ in parts:
            reward.close()
        raise
    if len(parts) == 1 and parts[0][1] == 1.0:
        return parts[0][0]
    return WeightedReward(parts)


def _with_device(name: str, kwargs: dict[str, Any], device: str | None) -> dict[str, Any]:
    if device is not None and "device" not in kwargs:
        if "device" in inspect.signature(_REGISTRY[name]).parameters:
            kwargs["device"] = device
    return kwargs


def _spec_problems(i: int, spec: Any) -> list[str]:
    where = f"reward[{i}]"
    if not isinstance(spec, dict):
        return [f"{where} must be a mapping with keys name, weight, kwargs; got {spec!r}"]
    problems = []
    extra = sorted(set(spec) - _SPEC_KEYS)
    if extra:
        problems.append(f"{where} has unknown keys {extra}; allowed: name, weight, kwargs")
    name = spec.get("name")
    if not isinstance(name, str):
        problems.append(f"{where}.name must be a reward name (one of {', '.join(available())}), got {name!r}")
    elif name not in _REGISTRY:
        problems.append(unknown(name, f"{where}.name: "))
    weight = spec.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        problems.append(f"{where}.weight must be a number, got {weight!r}")
    elif not math.isfinite(weight):
        problems.append(f"{where}.weight must be a finite number, got {weight!r}")
    if not isinstance(spec.get("kwargs", {}), dict):
        problems.append(f"{where}.kwargs must be a mapping, got {spec.get('kwargs')!r}")
    return problems
