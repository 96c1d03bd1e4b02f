"""The planner: the rollout/trainer split, ``train.groups_per_task`` and ``rollout.max_batch``
that the simulator's cost model says run a workload fastest on a cluster
(``digen simulate CONFIG --optimize [--gpus 64xh100]``).

What it searches, and how:

- ``rollout.max_batch``: :data:`MAX_BATCHES`, those whose batch fits a rollout GPU (the
  weights, the VAE and ``max_batch x samples_per_task`` samples' activations within its usable
  memory, :func:`batch_fits`);
- ``train.groups_per_task``: :data:`GROUPS_PER_TASK` (at most the iteration's micro-batches);
- the split: how many GPUs generate and how many train. In digen's runtime a sharded trainer
  group (``train.fsdp``) is every trainer, so the split is also the FSDP degree; past one node
  its gathers cross the network (:func:`digen.sim.driver.simulate`).

A full grid of simulations is too slow at 64 GPUs, so the search is coordinate-wise: every
(``max_batch``, ``groups_per_task``) at the configured plan's split and at the analytic split of
its own cost model, then the split of the best of them over a coarse grid of the cluster's
workers and the neighbours of the best point. Each candidate is a full simulation of the mode
(the Scheduler, the data plane), measured on the config's window.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from digen.errors import ConfigError
from digen.sim.catalog import SimSetup
from digen.sim.costmodel import USABLE_MEMORY, CostModel, paper_costmodel
from digen.sim.driver import MODES
from digen.sim.measure import SimResult
from digen.sim.study import SimSettings, analytic_split, roles_for, run_mode, worker_order

MAX_BATCHES = (1, 2, 4, 8, 16, 32)
GROUPS_PER_TASK = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
"""Up to 512: one train task per iteration for 512 one-sample micro-batches (the full
fine-tune's 512 images per step). An FSDP group runs one task at a time on every rank, each
pass gathering the whole weights, so it wants its ranks' shares of one task to fill their
passes (``rows_per_forward``), which on 28 ranks takes hundreds of micro-batches per task."""


@dataclass(frozen=True)
class Plan:
    max_batch: int
    groups_per_task: int
    rollout_gpus: int
    trainer_gpus: int
    s_per_iteration: float
    samples_per_s: float

    def settings(self) -> str:
        """The config keys that give this plan (``--set`` form)."""
        return (
            f"--set rollout.max_batch={self.max_batch} --set train.groups_per_task={self.groups_per_task} "
            f"({self.rollout_gpus} rollout GPUs, {self.trainer_gpus} trainer GPUs)"
        )


@dataclass(frozen=True)
class PlanSearch:
    configured: Plan
    best: Plan
    tried: list[Plan]
    mode: str

    @property
    def speedup(self) -> float:
        return (
            self.best.samples_per_s / self.configured.samples_per_s if self.configured.samples_per_s else 0.0
        )


def batch_fits(cost: CostModel, max_batch: int) -> bool:
    """A rollout worker holds ``max_batch`` tasks' activations beside its weights on every GPU
    type of the cluster (as :func:`digen.sim.costmodel.sample_memory_gb`, for a batch)."""
    paper = cost.paper
    assert paper is not None
    mdl = paper.workload.model
    for choice in cost.sp:
        gpu = next(g for g, _ in paper.testbed.gpus if g.name == choice.gpu_type)
        acts = max_batch * cost.samples_per_task * mdl.activation_gb / choice.degree
        if max(mdl.text_encoder_gb, mdl.weights_gb + acts) + mdl.vae_gb > USABLE_MEMORY * gpu.memory_gb:
            return False
    return True


def _cost(setup: SimSetup, max_batch: int, groups_per_task: int) -> CostModel:
    paper = setup.cost.paper
    assert paper is not None
    w = replace(setup.workload, max_batch=max_batch, groups_per_task=groups_per_task)
    tsp_gain = setup.cost.workers[0].cost.passes.tsp_gain if setup.cost.workers[0].cost.passes else 1.0
    model = getattr(setup.cost.dataplane, "model", None)
    return paper_costmodel(
        w, setup.testbed, tsp_batch_gain=tsp_gain, dataplane=model, paper=replace(paper, workload=w)
    )


def _plan(cost: CostModel, res: SimResult, max_batch: int, groups: int) -> Plan:
    gpus = {w.name: w.gpus for w in cost.workers}
    roll = sum(gpus[n] for n, r in res.roles.items() if r.value == "rollout")
    return Plan(max_batch, groups, roll, cost.gpu_count - roll, res.s_per_iteration, res.samples_per_s)


def optimize(setup: SimSetup, mode: str = "digen", settings: SimSettings | None = None) -> PlanSearch:
    """The fastest plan of ``mode`` for ``setup``, beside the configured one."""
    if setup.cost.paper is None:
        raise ConfigError("--optimize needs a paper-scale cost model (a configs/sim run config)")
    m = MODES[mode]
    if m.colocated or m.peer is not None:
        raise ConfigError(f"--optimize plans a disaggregated mode (digen, disaggregated, ...), not {mode}")
    settings = settings or setup.settings
    coarse = replace(settings, neighbours=0)
    cost0 = setup.cost
    res0, r0, _ = run_mode(cost0, m, settings)
    configured = _plan(cost0, res0, cost0.max_batch, cost0.groups_per_task)
    tried = [configured]
    order = worker_order(cost0)
    n = len(order)

    def at(cost: CostModel, rollouts: int, mb: int, gpt: int) -> Plan:
        r = min(n - 1, max(1, rollouts))
        res = coarse.simulate(cost, m, roles_for(worker_order(cost), r))
        plan = _plan(cost, res, mb, gpt)
        tried.append(plan)
        return plan

    best = configured
    best_cost = cost0
    for mb in MAX_BATCHES:
        for gpt in GROUPS_PER_TASK:
            if gpt > max(1, cost0.tasks):  # one task holds every micro-batch already
                continue
            cost = _cost(setup, mb, gpt)
            if not batch_fits(cost, mb):
                continue
            for r in {r0, analytic_split(cost, m, worker_order(cost))}:
                p = at(cost, r, mb, gpt)
                if p.samples_per_s > best.samples_per_s * (1 + 1e-9):
                    best, best_cost = p, cost
    # the split of the best (max_batch, groups_per_task): a coarse grid, then its neighbours
    workers_of = {w.name: w.gpus for w in best_cost.workers}
    per_worker = max(1, best_cost.gpu_count // len(workers_of))
    grid = sorted({max(1, (n * k) // 8) for k in range(1, 8)} | {best.rollout_gpus // per_worker})
    for r in grid:
        p = at(best_cost, r, best.max_batch, best.groups_per_task)
        if p.samples_per_s > best.samples_per_s * (1 + 1e-9):
            best = p
    step = max(1, n // 32)
    centre = best.rollout_gpus // per_worker
    for r in (centre - 2 * step, centre - step, centre + step, centre + 2 * step):
        p = at(best_cost, r, best.max_batch, best.groups_per_task)
        if p.samples_per_s > best.samples_per_s * (1 + 1e-9):
            best = p
    return PlanSearch(configured, best, tried, mode)


def plan_table(search: PlanSearch) -> str:
    """The configured plan and the best one, as Markdown."""
    rows = [("configured", search.configured), ("best", search.best)]
    lines = [
        f"| {search.mode} | rollout GPUs | trainer GPUs | max_batch | groups_per_task | s/iteration | samples/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, p in rows:
        lines.append(
            f"| {name} | {p.rollout_gpus} | {p.trainer_gpus} | {p.max_batch} | {p.groups_per_task} | "
            f"{p.s_per_iteration:.1f} | {p.samples_per_s:.3g} |"
        )
    return "\n".join(lines)
