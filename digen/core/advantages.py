"""Group-relative advantages (GRPO) as plain floats: each reward against the other samples of
its prompt. The controller computes them (it imports no torch), the reference loop with the
same function (both through :class:`digen.iteration.IterationBook`);
:func:`digen.algos.advantages.group_advantages` is its tensor form.

The math is Flow-GRPO's (yifan123/flow_grpo flow_grpo/stat_tracking.py
``PerPromptStatTracker.update``): ``A = (r - mean_group) / (std + eps)`` with the population
std (ddof 0) of the group, or of the whole batch when ``global_std``; then ``A`` is clamped to
``+-clip``. DanceGRPO's (XueZeyue/DanceGRPO fastvideo/train_grpo_flux.py ``train_one_step``)
is the same with the unbiased std (ddof 1) and ``eps=1e-8``.

Computed in float64 and rounded to float32 (the advantages a train task carries). A group's
sums run in sample order, as torch's ``index_add_`` sums them, so per-group advantages equal
those of the float64 torch computation this replaces bit for bit; the batch std of
``global_std`` is a two-pass sum and may differ from ``torch.std``'s by float64 round-off,
far below the float32 rounding.

A group carries no signal when all its rewards are equal (this includes a group of one
sample): its advantages are exactly 0 and it is counted in ``zero_std_groups`` (Flow-GRPO
drops such groups; the caller may, the values are already 0).
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class GroupAdvantages:
    """values: ``[N]`` advantages (float32 values), in the order of the rewards.
    zero_std_groups: number of groups whose rewards are all equal (groups of one included).
    group_std: ``[N]`` (float32 values) the std each advantage was divided by, before ``eps``
        (the group's std, or the batch's when ``global_std``; 0 for groups without signal).
    """

    values: list[float]
    zero_std_groups: int
    group_std: list[float]


def float32(values: Sequence[float]) -> list[float]:
    """``values`` rounded to float32 (to nearest, ties to even: what ``tensor.float()`` does)."""
    return array("f", values).tolist()


def group_advantages(
    rewards: Sequence[float],
    group_ids: Sequence[int],
    *,
    global_std: bool = False,
    eps: float = 1e-4,
    clip: float | None = 5.0,
    unbiased: bool = False,
) -> GroupAdvantages:
    """Normalise ``rewards`` within the groups given by ``group_ids``.

    rewards: ``[N]`` finite floats, N >= 1 (the caller drops NaN/inf rewards first).
    group_ids: ``[N]`` integers, equal for samples of the same prompt (any values, any order).
    global_std: divide by the std of the whole batch instead of the group's (the mean stays
        per group). eps: added to the std (>= 0). clip: clamp to ``[-clip, clip]``; None
        disables. unbiased: std with ddof 1 (DanceGRPO) instead of ddof 0 (Flow-GRPO).
    """
    assert len(rewards) == len(group_ids) > 0, (len(rewards), len(group_ids))
    r = [float(x) for x in rewards]
    ddof = 1 if unbiased else 0
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    for x, g in zip(r, group_ids, strict=True):
        sums[g] = sums.get(g, 0.0) + x
        counts[g] = counts.get(g, 0) + 1
    means = {g: sums[g] / counts[g] for g in sums}
    centered = [x - means[g] for x, g in zip(r, group_ids, strict=True)]
    squares: dict[int, float] = {}
    for c, g in zip(centered, group_ids, strict=True):
        squares[g] = squares.get(g, 0.0) + c * c
    # exact test for "no signal": max == min within the group (a mean of equal floats may be off by one ulp)
    flat = {g: max(own) == min(own) for g, own in _members(r, group_ids).items()}
    std_of = {g: 0.0 if flat[g] else math.sqrt(squares[g] / max(counts[g] - ddof, 1)) for g in sums}
    if global_std:
        batch = _batch_std(r, ddof)
        std = [batch] * len(r)
    else:
        std = [std_of[g] for g in group_ids]
    values = []
    for c, s, g in zip(centered, std, group_ids, strict=True):
        a = 0.0 if flat[g] else c / (s + eps)
        values.append(a if clip is None else min(max(a, -clip), clip))
    return GroupAdvantages(float32(values), sum(flat.values()), float32(std))


def _members(items: Sequence[T], group_ids: Sequence[int]) -> dict[int, list[T]]:
    """Each group's items (a reward, or a sample's row of rewards), in sample order."""
    out: dict[int, list[T]] = {}
    for x, g in zip(items, group_ids, strict=True):
        out.setdefault(g, []).append(x)
    return out


def _flat_in_every_reward(rows: list[Sequence[float]]) -> bool:
    """A group's rows of rewards carry no signal: each reward is equal over the group."""
    return all(max(own) == min(own) for own in zip(*rows, strict=True))


def _batch_std(r: list[float], ddof: int) -> float:
    """The std of all of ``r`` with ``ddof`` (two passes; 0 when ``len(r) <= ddof``)."""
    if len(r) <= ddof:
        return 0.0
    mean = sum(r) / len(r)
    return math.sqrt(sum((x - mean) * (x - mean) for x in r) / (len(r) - ddof))


def per_reward_advantages(
    parts: Sequence[Sequence[float]],
    group_ids: Sequence[int],
    weights: Sequence[float],
    *,
    global_std: bool = False,
    eps: float = 1e-4,
    clip: float | None = 5.0,
    unbiased: bool = False,
) -> GroupAdvantages:
    """DanceGRPO's multi-reward advantage (``train.multi_reward: per_reward``): one
    :func:`group_advantages` per reward, each clamped, then weighted and summed,
    ``A = sum_k w_k clamp(adv(r_k), +-clip)`` (the sum itself is not clamped again).

    parts: ``[N][K]`` finite floats, each sample's unweighted score of every reward, in the
    order of ``weights`` (``[K]``, K >= 1). The other arguments are :func:`group_advantages`'s,
    applied to each reward's column. Peer: XueZeyue/DanceGRPO 15cc71d
    fastvideo/train_grpo_hunyuan.py l.370-392 (``vq_advantages``, ``mq_advantages``) and
    l.449-477 (each clamped to ``adv_clip_max``, the losses summed with ``--vq_coef`` /
    ``--mq_coef``). The weighted sum runs in float64 over the float32 per-reward values, in
    reward order, and is rounded to float32 once.

    ``zero_std_groups``: the groups flat in every reward (their advantages are exactly 0);
    ``group_std``: the first reward's.
    """
    k = len(weights)
    assert k >= 1 and all(len(p) == k for p in parts), (k, {len(p) for p in parts})
    columns = [
        group_advantages(
            [p[j] for p in parts], group_ids, global_std=global_std, eps=eps, clip=clip, unbiased=unbiased
        )
        for j in range(k)
    ]
    total = [0.0] * len(parts)
    for w, col in zip(weights, columns, strict=True):
        for i, a in enumerate(col.values):
            total[i] += float(w) * a
    flat = sum(_flat_in_every_reward(rows) for rows in _members(parts, group_ids).values())
    return GroupAdvantages(float32(total), flat, columns[0].group_std)


GDPO_STD_FLOOR = 1e-6
"""Flow-Factory's floor on every std of GDPO (``max(std, 1e-6)``)."""


def gdpo_advantages(
    parts: Sequence[Sequence[float]],
    group_ids: Sequence[int],
    weights: Sequence[float],
    *,
    clip: float | None = 5.0,
) -> GroupAdvantages:
    """Flow-Factory's GDPO (``train.multi_reward: gdpo``; X-GenGroup/Flow-Factory a0b2bc5
    src/flow_factory/advantage/advantage_processor.py ``compute_gdpo`` and ``_global_mean_std``):
    each reward normalised in its group, ``(r_k - mean_g) / max(std_g, 1e-6)``, weighted and
    summed, then the sum normalised over the whole batch, ``(s - mean) / max(std, 1e-6)``,
    population stds (ddof 0) throughout; then clamped to ``+-clip`` (Flow-Factory clamps in
    its loss, ``adv_clip_range``: the same values).

    parts: ``[N][K]`` finite floats, the unweighted score of each reward, in the order of
    ``weights``. Needs the whole batch (the last normalisation). Every group's sum is centred,
    so the batch mean is 0 up to round-off; a group flat in every reward sums to 0 and stays
    there up to that round-off (not exactly 0, as the peer's); it counts in
    ``zero_std_groups``. ``group_std``: the batch std of the sum.
    """
    k = len(weights)
    assert k >= 1 and len(parts) == len(group_ids) > 0 and all(len(p) == k for p in parts)
    members = _members(parts, group_ids)
    combined = [0.0] * len(parts)
    for j, w in enumerate(weights):
        stats = {}
        for g, rows in members.items():
            col = [row[j] for row in rows]
            mean = sum(col) / len(col)
            std = math.sqrt(sum((x - mean) * (x - mean) for x in col) / len(col))
            stats[g] = (mean, max(std, GDPO_STD_FLOOR))
        for i, (p, g) in enumerate(zip(parts, group_ids, strict=True)):
            mean, std = stats[g]
            combined[i] += (float(p[j]) - mean) / std * float(w)
    mean = sum(combined) / len(combined)
    std = max(_batch_std(combined, 0), GDPO_STD_FLOOR)
    values = [(x - mean) / std for x in combined]
    if clip is not None:
        values = [min(max(a, -clip), clip) for a in values]
    flat = sum(_flat_in_every_reward(rows) for rows in members.values())
    return GroupAdvantages(float32(values), flat, float32([std] * len(parts)))
