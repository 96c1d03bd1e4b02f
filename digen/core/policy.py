"""Scheduling policy shared by every driver: which queue a worker pulls, and TAG's search.

Workers *pull* tasks by their role tag (:func:`pull_order`): the runtime's worker loops and
the simulator's simulated workers call the same function, so a simulated cluster behaves as
a real one does.

TAG's bubble-triggered search (:func:`tag_budgets`) balances a pipelined iteration from the
measured speeds: rollout workers need ``(G - n) / R_gen`` seconds for the groups left to them,
trainers ``G / R_train + n / R_gen_on_trainers`` for all training plus ``n`` stolen groups.
It picks the ``n`` with the smallest predicted makespan and keeps it only when that beats
``n = 0`` by more than ``margin``: TAG may shorten an iteration, never lengthen it.
"""

from __future__ import annotations

from digen.core.events import Role, TaskKind


def pull_order(role: Role, gen_budget: int) -> list[TaskKind]:
    """Queues a worker with this tag pulls from, in priority order."""
    if role is Role.ROLLOUT:
        return [TaskKind.GEN]
    if role is Role.TRAINER:
        return [TaskKind.TRAIN, TaskKind.GEN] if gen_budget > 0 else [TaskKind.TRAIN]
    return [TaskKind.GEN, TaskKind.TRAIN]


def predicted_makespan(
    groups: int, stolen: int, gen_rate_rollout: float, train_rate: float, gen_rate_trainers: float
) -> float:
    """Steady-state seconds per iteration with ``stolen`` groups generated on trainers
    (rates in groups/s, summed over the workers of each side)."""
    left = groups - stolen
    a = left / gen_rate_rollout if left > 0 else 0.0
    if left > 0 and gen_rate_rollout <= 0:
        a = float("inf")
    b = groups / train_rate if train_rate > 0 else float("inf")
    if stolen > 0:
        b += stolen / gen_rate_trainers if gen_rate_trainers > 0 else float("inf")
    return max(a, b)


def tag_budgets(
    groups: int,
    rollout_gen_s: list[float],
    trainer_train_s: dict[str, float],
    trainer_gen_s: dict[str, float],
    *,
    margin: float = 0.03,
) -> dict[str, int]:
    """Per-trainer generation budgets for the next iteration (all zero when TAG does not
    pay). Durations are seconds per group; every trainer must have both estimates."""
    trainers = sorted(trainer_train_s)
    zero = {w: 0 for w in trainers}
    if not trainers or groups <= 0:
        return zero
    r_gen = sum(1.0 / s for s in rollout_gen_s if s > 0)
    r_train = sum(1.0 / trainer_train_s[w] for w in trainers if trainer_train_s[w] > 0)
    speeds = {w: 1.0 / trainer_gen_s[w] for w in trainers if trainer_gen_s.get(w, 0) > 0}
    r_gen_t = sum(speeds.values())
    if r_gen_t <= 0:
        return zero
    base = predicted_makespan(groups, 0, r_gen, r_train, r_gen_t)
    best_n, best = 0, base
    for n in range(1, groups + 1):
        m = predicted_makespan(groups, n, r_gen, r_train, r_gen_t)
        if m < best:
            best_n, best = n, m
    if best_n == 0 or best >= base * (1 - margin):
        return zero
    return split_by_speed(best_n, speeds, trainers)


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
