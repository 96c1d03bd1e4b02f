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
