"""A simulation study: every requested mode of one cost model, each disaggregated mode at the
rollout/trainer split the same cost model says is best, compared with colocated and the bound.

Split search. Workers are ordered by ``g_i / t_i`` (generation rate over training rate, best
generators first: the LP bound's order, :mod:`digen.sim.bounds`; ties: slowest first, see
:func:`worker_order`), and a split is a prefix of that order: the first ``r`` workers are rollouts, the rest trainers. The analytic model
picks ``r*`` (synchronous modes minimise ``S/R_gen + S/R_train``, pipelined ones
``max(S/R_gen, S/R_train)``); ``r*`` and its neighbours, plus the split chosen for the mode's
predecessor on the ablation ladder, are simulated, and the fastest is kept. Including the
predecessor's split makes each rung's comparison fair: a technique is credited with what it
does at the same split, or better.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from digen.core.events import Role
from digen.errors import ConfigError
from digen.sim.bounds import LpSolution, costmodel_bound
from digen.sim.costmodel import CostModel
from digen.sim.driver import LADDER, MODES, PEERS, Mode, simulate
from digen.sim.measure import SimResult

PREDECESSOR = {b: a for a, b in zip(LADDER, LADDER[1:], strict=False)} | {
    "disagg+tsp": "disaggregated",
    "disagg+tag": "disaggregated",
    "disagg+async": "disaggregated",
}


@dataclass(frozen=True)
class SimSettings:
    """How long a job each mode runs and which of its iterations are measured: the same
    window for every mode (:func:`digen.sim.driver.measured_window`)."""

    iterations: int = 8
    """Iterations of the simulated job: warm-up, measured and trailing ones."""
    warmup: int = 3
    """Iterations left out at the start: pipeline fill, and TAG and RAT learning speeds in
    iteration 0, budgets that settle by iteration 2 (digen on FLUX, Qwen-Image, Wan2.1)."""
    neighbours: int = 2
    """Splits simulated on each side of the analytic best (0: the analytic best only)."""
    trailing: int = 1
    """Iterations left out at the end: the job's last iteration overlaps no next generation
    (with staleness 1 one iteration runs ahead, so one is enough)."""

    def simulate(self, cost: CostModel, mode: Mode, roles: dict[str, Role] | None = None) -> SimResult:
        """:func:`~digen.sim.driver.simulate` with these settings."""
        return simulate(
            cost, mode, roles, iterations=self.iterations, warmup=self.warmup, trailing=self.trailing
        )


@dataclass
class ModeResult:
    mode: str
    sim: SimResult
    rollout_gpus: int
    trainer_gpus: int
    speedup_vs_colocated: float
    fraction_of_bound: float
    bound_samples_per_s: float
    candidates: int = 1
    speedup_vs_peers: dict[str, float] = field(default_factory=dict)
    """This mode's samples/s over each simulated peer mode's (:data:`digen.sim.driver.PEERS`)."""

    def to_json(self) -> dict:
        s = self.sim
        return {
            "mode": self.mode,
            "s_per_iteration": s.s_per_iteration,
            "samples_per_s": s.samples_per_s,
            "samples_per_s_per_gpu": s.samples_per_s_per_gpu,
            "bubble_ratio": s.bubble_ratio,
            "speedup_vs_colocated": self.speedup_vs_colocated,
            "speedup_vs_peers": dict(self.speedup_vs_peers),
            "fraction_of_bound": self.fraction_of_bound,
            "bound_samples_per_s": self.bound_samples_per_s,
            "rollout_gpus": self.rollout_gpus,
            "trainer_gpus": self.trainer_gpus,
            "gpus": s.gpus,
            "dataplane": dict(s.dataplane),
        }


@dataclass
class Study:
    label: str
    cost: CostModel
    bound: LpSolution
    results: list[ModeResult] = field(default_factory=list)
    colocated: ModeResult | None = None
    no_pipeline: dict[str, str] = field(default_factory=dict)
    """Requested peer modes left out: the peer cannot train this model (mode -> why)."""
    not_modelled: dict[str, str] = field(default_factory=dict)
    """Requested peer modes the simulator does not restate on this testbed (mode -> why)."""

    def result(self, mode: str) -> ModeResult:
        return next(r for r in self.results if r.mode == mode)


def worker_order(cost: CostModel) -> list[str]:
    """Workers by decreasing ``g / t``: rollouts are taken from the front. Among workers whose
    ratios agree within 1%, the slower trainers come first (go to generation): training
    ends at a step barrier every iteration, so its tail is one training task of its slowest
    worker, while generation flows across iterations."""

    def key(w):
        g, t = cost.rates(w, tsp=True)
        ratio = round(-math.log(g / t), 2) if g > 0 and t > 0 else (float("-inf") if t <= 0 else float("inf"))
        return (ratio, -w.cost.train_tsp_s, w.name)

    return [w.name for w in sorted(cost.workers, key=key)]


def roles_for(order: list[str], rollouts: int) -> dict[str, Role]:
    return {n: (Role.ROLLOUT if i < rollouts else Role.TRAINER) for i, n in enumerate(order)}


def analytic_split(cost: CostModel, mode: Mode, order: list[str]) -> int:
    """Rollout count minimising the analytic iteration time of ``mode``; with an FSDP trainer
    group (:attr:`CostModel.fsdp_group`) the trainers' rate is the group's
    (:meth:`CostModel.group_rate`), not the sum of its ranks'."""
    by_name = {w.name: w for w in cost.workers}
    rates = [cost.rates(by_name[n], tsp=mode.tsp) for n in order]
    s = cost.samples
    pipelined = mode.gap or mode.max_staleness > 0
    grouped = cost.fsdp_group and not mode.colocated
    best, best_r = float("inf"), 1
    r_gen, r_train = 0.0, sum(t for _, t in rates)
    for r in range(1, len(order)):
        r_gen += rates[r - 1][0]
        r_train -= rates[r - 1][1]
        if grouped:
            r_train = cost.group_rate(set(order[r:]), tsp=mode.tsp)
        if r_gen <= 0 or r_train <= 0:
            continue
        a, b = s / r_gen, s / r_train
        obj = max(a, b) if pipelined else a + b
        if obj < best:
            best, best_r = obj, r
    return best_r


def _candidates(
    cost: CostModel, mode: Mode, order: list[str], neighbours: int, previous: int | None
) -> list[int]:
    n = len(order)
    r = analytic_split(cost, mode, order)
    step = max(1, n // 64)
    out = {min(n - 1, max(1, r + k * step)) for k in range(-neighbours, neighbours + 1)}
    if previous is not None:
        out.add(previous)
    return sorted(out)


def run_mode(
    cost: CostModel,
    mode: Mode,
    settings: SimSettings,
    previous: int | None = None,
    order: list[str] | None = None,
) -> tuple[SimResult, int, int]:
    """Simulate ``mode`` (searching the split when disaggregated); returns the result, the
    rollout count and the number of splits tried."""
    if mode.colocated:
        return settings.simulate(cost, mode), 0, 1
    if len(cost.workers) < 2:
        raise ConfigError(
            f"mode {mode.name} needs at least 2 workers (one rollout, one trainer); the cluster has "
            f"{len(cost.workers)}"
        )
    order = order or worker_order(cost)
    best: tuple[SimResult, int] | None = None
    cands = _candidates(cost, mode, order, settings.neighbours, previous)
    for r in cands:
        res = settings.simulate(cost, mode, roles_for(order, r))
        if best is None or res.samples_per_s > best[0].samples_per_s * (1 + 1e-9):
            best = (res, r)
    assert best is not None
    return best[0], best[1], len(cands)


def run_study(
    cost: CostModel,
    modes: list[str],
    settings: SimSettings | None = None,
    progress: Callable[[str], None] | None = None,
) -> Study:
    """Simulate ``modes`` (colocated always, as the speedup's reference); ``progress`` is
    called with each mode's name as its simulation starts (``digen simulate``'s progress)."""
    settings = settings or SimSettings()
    bound = costmodel_bound(cost)
    study = Study(cost.label, cost, bound)
    missing = cost.paper.no_pipeline if cost.paper is not None else {}
    unmodelled = cost.paper.not_modelled if cost.paper is not None else {}
    study.no_pipeline = {m: missing[MODES[m].peer] for m in modes if MODES[m].peer in missing}
    study.not_modelled = {m: unmodelled[MODES[m].peer] for m in modes if MODES[m].peer in unmodelled}
    modes = [m for m in modes if m not in study.no_pipeline and m not in study.not_modelled]
    order = worker_order(cost)
    gpus_of = {w.name: w.gpus for w in cost.workers}
    # predecessors first, so each rung can try its predecessor's split
    wanted = list(dict.fromkeys(["colocated", *modes]))
    run_order = sorted(wanted, key=lambda m: (_rank(m), wanted.index(m)))
    splits: dict[str, int] = {}
    done: dict[str, ModeResult] = {}
    for name in run_order:
        if progress is not None:
            progress(name)
        mode = MODES[name]
        prev = splits.get(PREDECESSOR.get(name, ""))
        res, r, tried = run_mode(cost, mode, settings, prev, order)
        splits[name] = r
        roll = sum(gpus_of[n] for n, role in res.roles.items() if role is Role.ROLLOUT)
        train = sum(gpus_of[n] for n, role in res.roles.items() if role is Role.TRAINER)
        done[name] = ModeResult(
            name, res, roll, train, 0.0, res.samples_per_s / bound.x if bound.x > 0 else 0.0, bound.x, tried
        )
    base = done["colocated"].sim.samples_per_s
    peers = {p: done[p].sim.samples_per_s for p in PEERS if p in done and done[p].sim.samples_per_s > 0}
    for result in done.values():
        result.speedup_vs_colocated = result.sim.samples_per_s / base if base > 0 else 0.0
        result.speedup_vs_peers = {p: result.sim.samples_per_s / sps for p, sps in peers.items()}
    study.colocated = done["colocated"]
    study.results = [done[m] for m in modes]
    return study


def _rank(mode: str) -> int:
    if mode == "colocated":
        return 0
    if mode in LADDER:
        return 1 + LADDER.index(mode)
    return 10
