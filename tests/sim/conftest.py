"""Small synthetic cost models for the simulator tests."""

from __future__ import annotations

from digen.core.events import Role
from digen.sim.costmodel import CostModel, SimWorker, WorkerCost
from digen.sim.dataplane import DataPlaneSeconds


def uniform_model(
    workers: int = 4,
    tasks: int = 8,
    gen: float = 1.0,
    train: float = 2.0,
    *,
    tsp: float | None = None,
    per_group: int = 1,
    optim: float = 0.1,
    sync: float = 0.1,
    load: float = 0.0,
    trajectory: float = 0.0,
) -> CostModel:
    """``optim``: the step (all-reduce); ``sync``: a rollout worker's fetch of a new version;
    ``trajectory``: a train task's fetch of a group another worker generated."""
    wc = WorkerCost(
        gen_s=gen,
        decode_s=0.0,
        reward_s=0.0,
        train_s=train,
        train_tsp_s=train if tsp is None else tsp,
        gen_on_trainer_s=gen,
        load_s=load,
    )
    return CostModel(
        [SimWorker(f"w{i}", "x", 1, wc) for i in range(workers)],
        tasks=tasks,
        samples_per_task=1,
        tasks_per_group=per_group,
        dataplane=DataPlaneSeconds(reduce_s=optim, distribute_s=sync, trajectory_s=trajectory),
    )


def split(cost: CostModel, rollouts: int) -> dict[str, Role]:
    return {w.name: Role.ROLLOUT if i < rollouts else Role.TRAINER for i, w in enumerate(cost.workers)}
