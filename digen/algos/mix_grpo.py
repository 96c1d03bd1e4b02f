"""MixGRPO: SDE only inside a sliding window of steps, ODE outside, the window moving with training.

Peer: Tencent-Hunyuan/MixGRPO @e5cdd6a fastvideo/train_grpo_flux.py (``train_one_step``,
``sample_reference_model`` with ``training_strategy part``, ``grpo_one_step``, ``main``),
fastvideo/utils/grpo_states.py ``GRPOTrainingStates`` (the window schedule) and
fastvideo/utils/sampling_utils.py ``run_sample_step`` / ``flow_grpo_step`` / ``dpm_step``
(``--flow_grpo_sampling``; the Flash variant's ``dpm_algorithm_type dpmsolver++``,
``dpm_apply_strategy post``); recipes scripts/finetune/finetune_flux_grpo_MixGRPO*.sh.

Rollout of iteration ``k`` with window ``[c, c + W)`` (``W = train.mix_grpo.window``)::

    steps 0 .. c-1      Euler (ODE)
    steps c .. c+W-1    SDE of rollout.sde.kind, log-probs kept
    steps c+W .. T-1    Euler, or (flash) DPM-Solver++(2M) on a compressed schedule

The trajectory keeps only the window: ``latents [B, W+1, *latent]`` (``x_c .. x_{c+W}``),
``log_probs [B, W]``, ``first_step`` = c, ``sigmas [T+1]``: W+1 latents travel instead of
T+1. Training: every sample trains the window's steps with Flow-GRPO's clipped loss
(:mod:`digen.algos.flow_grpo`; the peer's ``policy_loss / (gradient_accumulation_steps *
len(train_timesteps))`` is that mean per optimizer step).

The window start ``c`` follows ``GRPOTrainingStates`` as a pure function of the iteration
(:func:`window_start`; the peer updates a stateful object after each iteration, digen replays
it, so any process and a resumed run agree): ``max_t = T - 2`` (the peer's
``max_timesteps = sampling_steps - 2``), start at 0, and after each iteration

- ``progressive``: after ``iters_per_window`` iterations move by ``shift`` steps (the
  peer's ``prog_overlap_step``; None: by ``W``, no overlap);
- ``decay``: the same, the iterations per window falling linearly from ``max_iters`` to
  ``min_iters`` as the window moves (``get_dynamic_iters_per_group``);
- ``random``: a uniform start in ``[0, max_t - W]``, drawn from the iteration's seeded stream
  (the peer draws from an unseeded ``numpy.random.default_rng()``).

Past the end the window rolls back to 0 (``roll_back``) or stays at the last start. The
window is ``[c, min(c + W, max_t))``. One deviation: the peer rolls back only when ``c >
max_t``, so ``c == max_t`` gives an empty window (an iteration that trains nothing and, in
Flash, a crash); digen treats ``c >= max_t`` as past the end.

Flash (``train.mix_grpo.flash``): after the window, ``M = int(max((T - c_last) * compress,
1))`` schedule points from ``sigma_{c_last+1}`` to 0 (``c_last`` the window's last step) as
the peer's ``dpm_post_compress_ratio``, at least 2 (the peer's M = 1 never reaches 0). The
peer re-spaces them linearly in its unshifted time and shifts them again; digen takes M of
the model's own schedule points, evenly spaced in index (the same points when ``T - c_last - 1``
is a multiple of ``M - 1``).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from digen.algos.flow_grpo import GrpoFamily
from digen.algos.registry import RolloutPlan, StepKind
from digen.seeding import iteration_generator

if TYPE_CHECKING:
    from digen.config.schema import Config, MixGrpoConfig


def max_start(num_steps: int) -> int:
    """The peer's ``max_timesteps``: ``T - 2`` (the last step is never trained)."""
    return num_steps - 2


def window_start(iteration: int, num_steps: int, opts: MixGrpoConfig, seed: int) -> int:
    """The first step of iteration ``iteration``'s window."""
    if opts.schedule == "random":
        if iteration == 0:  # the peer's state starts at cur_timestep 0
            return 0
        gen = iteration_generator(seed, iteration, "mix-window")
        high = max_start(num_steps) - opts.window + 1
        return int(torch.randint(0, high, (1,), generator=gen).item())
    return _replayed_start(
        iteration,
        max_start(num_steps),
        opts.window,
        opts.schedule,
        opts.iters_per_window,
        opts.shift,
        opts.max_iters,
        opts.min_iters,
        opts.roll_back,
    )


@functools.lru_cache(maxsize=64)
def _replayed_start(
    iteration: int,
    max_t: int,
    window: int,
    schedule: str,
    iters: int,
    shift: int | None,
    max_iters: int | None,
    min_iters: int | None,
    roll_back: bool,
) -> int:
    """``GRPOTrainingStates.update_iteration`` replayed ``iteration`` times from (0, 0)."""
    hi = iters if max_iters is None else max_iters
    lo = max(1, iters // 4) if min_iters is None else min_iters
    cur = in_window = 0
    for _ in range(iteration):
        in_window += 1
        if schedule == "decay":  # linear from max_iters to min_iters as the window moves
            progress = cur / max_t
            needed = max(lo, int(hi * (1 - progress) + lo * progress))
        else:
            needed = iters
        if in_window >= needed:
            in_window = 0
            cur += window if shift is None else shift
        if cur >= max_t:  # past the end (the peer: cur > max_t, see the module docstring)
            if roll_back:
                cur = in_window = 0
            else:
                cur = max_t - 1
    return cur


def mix_window(cfg: Config, iteration: int) -> list[int]:
    """The window's steps of ``iteration``: ``[c, min(c + W, T - 2))``, never empty."""
    opts, n = cfg.train.mix_grpo, cfg.rollout.num_steps
    c = window_start(iteration, n, opts, cfg.seed)
    return list(range(c, min(c + opts.window, max_start(n))))


def flash_schedule(num_steps: int, last: int, compress: float) -> list[int]:
    """Schedule indices after the window's last step ``last``: the compressed post-window
    points (indices into the ``T+1`` sigmas), from ``last + 1`` to ``T``."""
    remaining = num_steps - (last + 1)  # steps the full schedule takes after the window
    points = max(int(max((num_steps - last) * compress, 1)), 2)
    points = min(points, remaining + 1)
    if points < 2:
        return [num_steps]
    return [round(last + 1 + k * remaining / (points - 1)) for k in range(points)]


class MixGrpo(GrpoFamily):
    name = "mix-grpo"
    title = "MixGRPO"
    order = 4
    peer = (
        "Tencent-Hunyuan/MixGRPO @e5cdd6a: fastvideo/train_grpo_flux.py train_one_step + sample_reference_model, "
        "fastvideo/utils/grpo_states.py GRPOTrainingStates, fastvideo/utils/sampling_utils.py run_sample_step"
    )
    summary = "GRPO on a sliding window of SDE steps, ODE (or DPM-Solver++ 2M, Flash) outside it"
    rollout_needs = "SDE in the window of train.mix_grpo.window steps, ODE/DPM++ elsewhere; log-probs and latents of the window only"
    trajectory = {
        "latents": "[B, W+1, *latent] x_c .. x_{c+W}: the window's latents only",
        "log_probs": "[B, W] behaviour log-probs of the window's steps",
        "first_step": "[] (int64) c, the window's first step",
        "sigmas": "[T+1] the rollout schedule",
    }

    def check(self, cfg: Config) -> list[str]:
        opts, n = cfg.train.mix_grpo, cfg.rollout.num_steps
        if opts.window > max_start(n):
            return [
                f"train.mix_grpo.window ({opts.window}) must be at most rollout.num_steps - 2 ({max_start(n)}): "
                f"MixGRPO never trains the last step (its max_timesteps = sampling_steps - 2)"
            ]
        return []

    def rollout_plan(self, cfg: Config, iteration: int) -> RolloutPlan:
        n, opts = cfg.rollout.num_steps, cfg.train.mix_grpo
        window = mix_window(cfg, iteration)
        first, last = window[0], window[-1]
        ode: list[StepKind] = ["ode"]
        kinds = ode * first + ["sde"] * len(window)
        if not opts.flash:
            kinds += ode * (n - last - 1)
            return RolloutPlan(kinds=tuple(kinds), keep=(first, len(window)))
        post = flash_schedule(n, last, opts.flash_compress)
        schedule = tuple(range(last + 1)) + tuple(post)
        dpm2: list[StepKind] = ["dpm2"]
        kinds += dpm2 * (len(post) - 1)
        return RolloutPlan(kinds=tuple(kinds), keep=(first, len(window)), schedule=schedule)

    def trained_steps(self, cfg: Config, iteration: int, sample_id: int) -> list[int]:
        return mix_window(cfg, iteration)


ALGORITHM = MixGrpo()
