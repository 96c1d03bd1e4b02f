"""Which denoising steps of a trajectory are trained, and which steps sample with noise.

Strategies (indices i refer to the step s[i] -> s[i+1] of an ``num_steps``-step schedule):

- ``"prefix"`` (Flow-GRPO): the first ``int(num_steps * fraction)`` steps, in order;
  fraction 0.99 drops only the last step. The count is Python's ``int`` of the float
  product, as yifan123/flow_grpo scripts/train_sd3.py ``main`` computes
  ``num_train_timesteps`` (so 100 * 0.29 = 28.999... trains 28 steps, as there).
- ``"random"`` (DanceGRPO): ``int((num_steps - 1) * fraction)`` steps, the first of a
  ``randperm(num_steps - 1)`` (the last step is never trained), one draw per call, as
  XueZeyue/DanceGRPO fastvideo/train_grpo_flux.py ``train_one_step`` drops the last
  timestep, permutes the rest per sample and trains ``int(len(timesteps) * fraction)``.
- ``"window"`` (Flow-GRPO-Fast): a random contiguous window of ``window`` steps whose start
  is drawn uniformly in ``[lo, hi - window]`` of ``window_range = (lo, hi)``; only those steps
  use SDE noise, every other step is a deterministic Euler (ODE) step. The range defaults to
  ``(0, num_steps // 2)``, the first half of the trajectory, as every windowed recipe of
  Flow-GRPO sets ``sde_window_range`` (config/grpo.py at 9745241) and VeRL-Omni's windowed
  examples pass it (``[0,5]`` of 10 steps): flow_grpo/diffusers_patch/*_with_logprob_fast.py
  draw ``start = random.randint(lo, hi - window)``, VeRL-Omni's
  verl_omni/pipelines/request_batch.py ``torch.randint(lo, hi - window + 1)``: the same
  support. FLUX's fast recipes (6 steps, window 3) therefore always start at step 0.

Random choices come only from the given ``torch.Generator`` (the global RNG when None), so the
same seed gives the same steps on every machine.
"""

from __future__ import annotations

from typing import Literal

import torch

from digen.errors import AlgorithmError

TimestepStrategy = Literal["prefix", "random", "window"]
TIMESTEP_STRATEGIES: tuple[str, ...] = ("prefix", "random", "window")


def select_timesteps(
    num_steps: int,
    *,
    strategy: TimestepStrategy,
    fraction: float,
    window: int = 2,
    window_range: tuple[int, int] | list[int] | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Sorted indices in ``[0, num_steps)`` of the steps to train.

    fraction: in (0, 1], used by "prefix" (of ``num_steps``) and "random" (of the
        ``num_steps - 1`` steps before the last); at least one step is kept;
    ignored by "window". window: the window length for "window", 1 <= window <= num_steps.
    window_range: ``(lo, hi)``, the steps a window may cover (None: :func:`default_window_range`).
    generator: the source of randomness for "random" and "window".
    """
    if strategy not in TIMESTEP_STRATEGIES:
        raise AlgorithmError(
            f"strategy={strategy!r} is not a timestep strategy; use one of {', '.join(TIMESTEP_STRATEGIES)}"
        )
    if num_steps < 1:
        raise AlgorithmError(f"num_steps={num_steps} must be >= 1")
    if strategy == "window":
        return _window(num_steps, window, window_range, generator)
    if not 0 < fraction <= 1:
        raise AlgorithmError(f"fraction={fraction} must be in (0, 1] (Flow-GRPO uses 0.99)")
    if strategy == "prefix":
        return list(range(max(1, int(num_steps * fraction))))
    return _random_subset(num_steps, max(1, int((num_steps - 1) * fraction)), generator)


def sde_step_mask(num_steps: int, trained: list[int], strategy: TimestepStrategy) -> list[bool]:
    """[num_steps] flags: True where the step samples with SDE noise, False for an Euler step.

    "window": only the trained window is stochastic. "prefix"/"random": every step is
    (the untrained steps still follow the SDE, as in Flow-GRPO and DanceGRPO).
    """
    if strategy not in TIMESTEP_STRATEGIES:
        raise AlgorithmError(
            f"strategy={strategy!r} is not a timestep strategy; use one of {', '.join(TIMESTEP_STRATEGIES)}"
        )
    outside = [i for i in trained if not 0 <= i < num_steps]
    if outside:
        raise AlgorithmError(f"trained steps {outside} are outside [0, {num_steps})")
    if strategy != "window":
        return [True] * num_steps
    chosen = set(trained)
    return [i in chosen for i in range(num_steps)]


def _random_subset(num_steps: int, count: int, generator: torch.Generator | None) -> list[int]:
    """``count`` distinct steps from ``[0, num_steps - 1)``, sorted (capped at num_steps - 1)."""
    pool = num_steps - 1
    if pool < 1:
        raise AlgorithmError(
            f"strategy='random' drops the last step, so num_steps={num_steps} leaves nothing to train; "
            "use at least 2 steps or strategy='prefix'"
        )
    order = torch.randperm(pool, generator=generator, device="cpu" if generator is None else generator.device)
    return sorted(order[: min(count, pool)].tolist())


def default_window_range(num_steps: int) -> tuple[int, int]:
    """``(0, num_steps // 2)``: Flow-GRPO's recipes' ``sde_window_range``, the first half."""
    return (0, num_steps // 2)


def window_range_problem(
    num_steps: int, window: int, window_range: tuple[int, int] | list[int] | None
) -> str | None:
    """Why a window of ``window`` steps cannot be drawn in ``window_range`` of ``num_steps``
    steps (None: it can)."""
    if not 1 <= window <= num_steps:
        return f"window={window} must be between 1 and num_steps={num_steps}"
    lo, hi = default_window_range(num_steps) if window_range is None else window_range
    which = f"window_range=({lo}, {hi})" + (" (the default, the first half)" if window_range is None else "")
    if not 0 <= lo < hi <= num_steps:
        return f"{which} must satisfy 0 <= lo < hi <= num_steps={num_steps}"
    if hi - lo < window:
        return f"{which} is shorter than window={window}: a window needs hi - lo >= window"
    return None


def _window(
    num_steps: int,
    window: int,
    window_range: tuple[int, int] | list[int] | None,
    generator: torch.Generator | None,
) -> list[int]:
    """A run of ``window`` consecutive steps starting uniformly in ``[lo, hi - window]``."""
    problem = window_range_problem(num_steps, window, window_range)
    if problem:
        raise AlgorithmError(problem)
    lo, hi = default_window_range(num_steps) if window_range is None else window_range
    device = "cpu" if generator is None else generator.device
    start = int(torch.randint(lo, hi - window + 1, (1,), generator=generator, device=device).item())
    return list(range(start, start + window))
