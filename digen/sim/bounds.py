"""Throughput bounds: what no schedule can beat (docs/simulator.md, "What it models").

- Zero-bubble bound, identical workers: an iteration needs at least ``(G + T) / N`` seconds
  (``G``, ``T``: generation and training worker-seconds).
- Mixed GPU types, the linear program: maximise ``X`` subject to ``sum_i f_i g_i >= X``,
  ``sum_i (1 - f_i) t_i >= X``, ``0 <= f_i <= 1`` (``g_i``, ``t_i``: samples/s of worker ``i``
  when it only generates / only trains; ``f_i`` the fraction of its time spent generating).

The LP has two constraints and is solved exactly without an LP library: at the optimum both
are tight (else move time to the short side), so ``X = sum f_i g_i`` with
``sum f_i (g_i + t_i) = sum t_i``. That is a fractional knapsack: value ``g_i``, weight
``g_i + t_i``, capacity ``sum t_i``; take workers by decreasing ``g_i / t_i`` (best
generators first), the last one fractionally.

- An FSDP trainer group (a full fine-tune, ``train.fsdp``): the trainers are one sharded
  model that runs every train task on all its ranks, and neither side helps the other (the
  runtime turns TAG and RAT off), so no worker splits its time and the group's rate is not
  the sum of its ranks' (each pass gathers the whole weights whatever share a rank trains).
  The bound is ``max_r min(G_r, T_r)``: the first ``r`` workers of the LP's order generate
  (``G_r``, the sum of their rates), the rest train as one group (``T_r``,
  :meth:`~digen.sim.costmodel.CostModel.group_rate`, its collectives across nodes past one
  node), over every split ``r`` (on one GPU type, every split there is).

All bound a rate that holds over any long stretch of a job, so they are compared with a
steady-state rate: the simulator measures whole iterations between warm-up and trailing
ones (:func:`digen.sim.driver.measured_window`). A window that ends with the job's last
iteration is not one: that iteration overlaps no next generation and can beat the bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from digen.sim.costmodel import CostModel


@dataclass(frozen=True)
class LpSolution:
    x: float
    """Samples/s of the bound."""
    fractions: list[float]
    """``f_i``: share of worker ``i``'s time spent generating."""


def zero_bubble_bound(gen_worker_s: float, train_worker_s: float, workers: int) -> float:
    """Seconds per iteration of identical workers with no bubble: ``(G + T) / N``."""
    return (gen_worker_s + train_worker_s) / workers


def lp_bound(g: list[float], t: list[float]) -> LpSolution:
    """Exact solution of the 2-constraint LP above (``g``, ``t``: samples/s per worker)."""
    if len(g) != len(t):
        raise ValueError(f"g has {len(g)} workers, t has {len(t)}")
    if any(v < 0 for v in g + t):
        raise ValueError("rates must be >= 0")
    f = [0.0] * len(g)
    capacity = sum(t)
    order = sorted(range(len(g)), key=lambda i: (-(g[i] / t[i]) if t[i] > 0 else float("-inf"), i))
    x = 0.0
    for i in order:
        weight = g[i] + t[i]
        if capacity <= 0 or weight <= 0:
            continue
        share = min(1.0, capacity / weight)
        f[i] = share
        x += share * g[i]
        capacity -= share * weight
    return LpSolution(x, f)


def costmodel_bound(cost: CostModel) -> LpSolution:
    """The bound of a cost model: each worker's best generation rate (a rollout with full
    weights: denoise + decode + reward) and best training rate (TSP), no optimizer step; the
    LP, or with an FSDP trainer group (:attr:`CostModel.fsdp_group`) :func:`fsdp_group_bound`."""
    if cost.fsdp_group:
        return fsdp_group_bound(cost)
    rates = [cost.rates(w, tsp=True) for w in cost.workers]
    return lp_bound([g for g, _ in rates], [t for _, t in rates])


def fsdp_group_bound(cost: CostModel) -> LpSolution:
    """``max_r min(G_r, T_r)`` (module docstring): the first ``r`` workers by decreasing
    ``g / t`` generate, the others train as one FSDP group; ``fractions`` is 1 for the
    generators of the best split, 0 for the group."""
    rates = {w.name: cost.rates(w, tsp=True) for w in cost.workers}
    order = sorted(
        rates, key=lambda n: (-(rates[n][0] / rates[n][1]) if rates[n][1] > 0 else float("-inf"), n)
    )
    best, best_r, gen = 0.0, 0, 0.0
    for r in range(1, len(order)):
        gen += rates[order[r - 1]][0]
        x = min(gen, cost.group_rate(set(order[r:]), tsp=True))
        if x > best:
            best, best_r = x, r
    index = {w.name: i for i, w in enumerate(cost.workers)}
    fractions = [0.0] * len(cost.workers)
    for n in order[:best_r]:
        fractions[index[n]] = 1.0
    return LpSolution(best, fractions)
