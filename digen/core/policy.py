"""Scheduling policy shared by every driver: which queue a worker pulls, and TAG's search.

Workers *pull* tasks by their role tag (:func:`pull_order`): the runtime's worker loops and
the simulator's simulated workers call the same function, so a simulated cluster behaves as
a real one does.

Elastic roles work both ways, with one search (:func:`assist_budgets`):

- **TAG** (trainer-assisted generation, generation-bound iterations): trainers take up to
  ``n`` generation groups when no train task is ready;
- **RAT** (rollout-assisted training, training-bound iterations): rollout workers take up to
  ``n`` *half* groups of training when no generation task is ready. Iteration ``k`` trains
  version ``k``, the version a staleness-1 rollout worker already holds for generating
  ``k + 1``, so an idle rollout worker trains without loading other weights. Half groups
  because the imbalance to fill is often less than one group: the scheduler splits the last
  ``n`` groups of the iteration into halves (released last, so they are what an idle rollout
  worker finds in the queue); every other group trains whole, in one batched forward.

The search balances a pipelined iteration from the measured speeds. The *owners* of a kind
of work (rollout workers for generation, trainers for training) need ``(G - n) / R_own``
seconds for the groups left to them; the *helpers* need ``G / R_home + n / R_help`` for
their own work plus ``n`` taken groups. It picks the ``n`` with the smallest predicted
makespan and keeps it only when that beats ``n = 0`` by more than ``margin``: assistance may
shorten an iteration, never lengthen it. Both directions never pay at once (the first needs
generation to be the bottleneck, the second training).
"""

from __future__ import annotations

from digen.core.events import Role, TaskKind


def pull_order(role: Role, budget: int) -> list[TaskKind]:
    """Queues a worker with this tag pulls from, in priority order. ``budget``: the off-role
    tasks it may still take this iteration (TAG generation for a trainer, RAT training for a
    rollout worker)."""
    if role is Role.ROLLOUT:
        return [TaskKind.GEN, TaskKind.TRAIN] if budget > 0 else [TaskKind.GEN]
    if role is Role.TRAINER:
        return [TaskKind.TRAIN, TaskKind.GEN] if budget > 0 else [TaskKind.TRAIN]
    if role is Role.REWARD:
        return [TaskKind.REWARD]
    return [TaskKind.GEN, TaskKind.TRAIN]


def idle_kinds(role: Role) -> list[TaskKind]:
    """Queues a worker pulls only when those of :func:`pull_order` are empty: evaluation, on
    the workers that generate (the scheduler also releases it only when they are idle)."""
    return [TaskKind.EVAL] if role in (Role.ROLLOUT, Role.COLOCATED) else []


def predicted_makespan(
    groups: int, taken: float, owner_rate: float, helper_home_rate: float, helper_rate: float
) -> float:
    """Steady-state seconds per iteration when helpers take ``taken`` of the owners' groups
    (rates in groups/s, summed over the workers of each side; helpers also do all ``groups``
    of their own kind of work)."""
    left = groups - taken
    a = left / owner_rate if left > 0 else 0.0
    if left > 0 and owner_rate <= 0:
        a = float("inf")
    b = groups / helper_home_rate if helper_home_rate > 0 else float("inf")
    if taken > 0:
        b += taken / helper_rate if helper_rate > 0 else float("inf")
    return max(a, b)


def assist_budgets(
    groups: int,
    owner_s: list[float],
    helper_home_s: dict[str, float],
    helper_s: dict[str, float],
    *,
    margin: float = 0.03,
    parts: int = 1,
) -> dict[str, int]:
    """Per-helper budgets of the owners' tasks for the next iteration (all zero when helping
    does not pay). Durations are seconds per group: ``owner_s`` of each owner at its own
    work, ``helper_home_s`` of each helper at its own work, ``helper_s`` of each helper at
    the owners' work. TAG: owners = rollout workers (generation), helpers = trainers.
    RAT: owners = trainers (training), helpers = rollout workers. ``parts``: budgets count
    tasks of ``1 / parts`` of a group (RAT takes half groups: ``parts=2``)."""
    helpers = sorted(helper_home_s)
    zero = {w: 0 for w in helpers}
    if not helpers or groups <= 0:
        return zero
    r_own = sum(1.0 / s for s in owner_s if s > 0)
    r_home = sum(1.0 / helper_home_s[w] for w in helpers if helper_home_s[w] > 0)
    speeds = {w: 1.0 / helper_s[w] for w in helpers if helper_s.get(w, 0) > 0}
    r_help = sum(speeds.values())
    if r_help <= 0:
        return zero
    base = predicted_makespan(groups, 0, r_own, r_home, r_help)
    best_n, best = 0, base
    for n in range(1, groups * parts + 1):
        m = predicted_makespan(groups, n / parts, r_own, r_home, r_help)
        if m < best:
            best_n, best = n, m
    if best_n == 0 or best >= base * (1 - margin):
        return zero
    return split_by_speed(best_n, speeds, helpers)


def split_by_speed(total: int, speeds: dict[str, float], workers: list[str]) -> dict[str, int]:
    """``total`` items over ``workers`` proportionally to ``speeds`` (largest remainder)."""
    s = sum(speeds.get(w, 0.0) for w in workers)
    if s <= 0:
        return {w: 0 for w in workers}
    exact = {w: total * speeds.get(w, 0.0) / s for w in workers}
    out = {w: int(exact[w]) for w in workers}
    rest = total - sum(out.values())
    for w in sorted(workers, key=lambda w: (-(exact[w] - out[w]), w))[:rest]:
        out[w] += 1
    return out
