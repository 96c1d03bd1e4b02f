"""Group-relative advantages (GRPO) on tensors: each reward against the other samples of its
prompt.

The math is :func:`digen.core.advantages.group_advantages` (Flow-GRPO's, or DanceGRPO's with
the unbiased std; it names the peers and how its float64 sums round): this is its tensor
form, with the inputs checked. The controller and the reference loop call the plain-float
function directly (through :class:`digen.iteration.IterationBook`).

A group carries no signal when all its rewards are equal (this includes a group of one
sample): its advantages are exactly 0 and it is counted in ``zero_std_groups``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from digen.core import advantages as core
from digen.errors import AlgorithmError


@dataclass(frozen=True)
class Advantages:
    """values: [N] float32 advantages, in the order of the rewards.
    zero_std_groups: number of groups whose rewards are all equal (groups of one included).
    group_std: [N] float32, the std each advantage was divided by, before ``eps`` (the
        group's std, or the batch's when ``global_std``; 0 for groups without signal).
    """

    values: Tensor
    zero_std_groups: int
    group_std: Tensor


def group_advantages(
    rewards: Tensor | Sequence[float],
    group_ids: Tensor | Sequence[int],
    *,
    global_std: bool = False,
    eps: float = 1e-4,
    clip: float | None = 5.0,
    unbiased: bool = False,
) -> Advantages:
    """Normalise ``rewards`` within the groups given by ``group_ids``.

    rewards: [N] finite floats (drop NaN/inf rewards before calling: this raises on them).
    group_ids: [N] integers, equal for samples of the same prompt (any values, any order).
    global_std: divide by the std of the whole batch instead of the group's (mean stays
        per group). eps: added to the std. clip: clamp to [-clip, clip]; None disables.
    unbiased: std with ddof 1 (DanceGRPO) instead of ddof 0 (Flow-GRPO).
    Computed in float64 (:func:`digen.core.advantages.group_advantages`), returned as
    float32 on the rewards' device.
    """
    r, ids = _check_inputs(rewards, group_ids, eps, clip)
    a = core.group_advantages(
        r.tolist(), ids.tolist(), global_std=global_std, eps=eps, clip=clip, unbiased=unbiased
    )
    values = torch.tensor(a.values, dtype=torch.float32, device=r.device)
    return Advantages(
        values, a.zero_std_groups, torch.tensor(a.group_std, dtype=torch.float32, device=r.device)
    )


def per_reward_advantages(
    rewards: Tensor,
    group_ids: Tensor | Sequence[int],
    weights: Sequence[float],
    *,
    global_std: bool = False,
    eps: float = 1e-4,
    clip: float | None = 5.0,
    unbiased: bool = False,
) -> Advantages:
    """DanceGRPO's multi-reward advantage: one group advantage per reward, each clamped, then
    summed with the rewards' weights, ``A = sum_k w_k clamp(adv(r_k), +-clip)``.

    rewards: [N, K] finite floats, one column per reward (K >= 1). weights: [K]. The other
    arguments are :func:`group_advantages`'s, applied to each column. Peer:
    XueZeyue/DanceGRPO 15cc71d fastvideo/train_grpo_hunyuan.py l.370-392 (``vq_advantages``
    and ``mq_advantages``, each ``(r - mean) / (std + 1e-8)`` per group of ``num_generations``),
    l.449-477 (each clamped to ``adv_clip_max``, its own clipped PPO loss, the losses summed
    with ``--vq_coef`` / ``--mq_coef``; DanceGRPO issues #13, #92).

    Beside the weighted reward sum (one advantage of ``sum_k w_k r_k``, digen's default), this
    keeps a reward of small spread from being drowned by one of large spread. Training on this
    sum equals DanceGRPO's sum of per-reward losses wherever the ratio is inside the clip range
    (the first pass of every on-policy step: ratio 1 exactly); outside it the peer clips each
    reward's term on its own sign. ``zero_std_groups``: groups flat in every reward;
    ``group_std``: the first reward's. The math is
    :func:`digen.core.advantages.per_reward_advantages` (what the iteration book computes with
    ``train.multi_reward: per_reward``).
    """
    r = torch.as_tensor(rewards).detach().to(torch.float64)
    if r.ndim != 2 or r.shape[1] < 1:
        raise AlgorithmError(f"rewards must be [N, K] (one column per reward), got shape {tuple(r.shape)}")
    if len(weights) != r.shape[1]:
        raise AlgorithmError(f"{len(weights)} weights for {r.shape[1]} rewards; give one weight per reward")
    for k in range(r.shape[1]):
        _check_inputs(r[:, k], group_ids, eps, clip)
    ids = torch.as_tensor(group_ids, device=r.device).to(torch.int64)
    a = core.per_reward_advantages(
        r.tolist(), ids.tolist(), [float(w) for w in weights],
        global_std=global_std, eps=eps, clip=clip, unbiased=unbiased,
    )  # fmt: skip
    values = torch.tensor(a.values, dtype=torch.float32, device=r.device)
    return Advantages(
        values, a.zero_std_groups, torch.tensor(a.group_std, dtype=torch.float32, device=r.device)
    )


def _check_inputs(
    rewards: Tensor | Sequence[float], group_ids: Tensor | Sequence[int], eps: float, clip: float | None
) -> tuple[Tensor, Tensor]:
    """(rewards [N] float64, group_ids [N] int64) after checking shapes, dtypes and values."""
    r = torch.as_tensor(rewards).detach().to(torch.float64)
    ids = torch.as_tensor(group_ids, device=r.device)
    if r.ndim != 1 or r.numel() == 0:
        raise AlgorithmError(f"rewards must be a non-empty [N] vector, got shape {tuple(r.shape)}")
    if ids.shape != r.shape:
        raise AlgorithmError(
            f"group_ids has shape {tuple(ids.shape)}; it must match rewards {tuple(r.shape)}"
        )
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise AlgorithmError(f"group_ids must be integers (one id per prompt), got dtype {ids.dtype}")
    if not bool(torch.isfinite(r).all()):
        bad = torch.nonzero(~torch.isfinite(r)).flatten().tolist()
        raise AlgorithmError(
            f"rewards at positions {bad[:8]} are NaN or infinite; drop those samples (or their groups) "
            "before computing advantages"
        )
    if not math.isfinite(eps) or eps < 0:
        raise AlgorithmError(f"eps={eps} must be a finite number >= 0")
    if clip is not None and not clip > 0:
        raise AlgorithmError(f"clip={clip} must be > 0, or None to disable clamping")
    return r, ids.to(torch.int64)
