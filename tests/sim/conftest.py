"""Small synthetic cost models for the simulator tests."""

from __future__ import annotations

from digen.core.events import Role
from digen.sim.costmodel import CostModel, SimWorker, WorkerCost


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
) -> CostModel:
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
        optim_s=optim,
        sync_s=sync,
    )


def split(cost: CostModel, rollouts: int) -> dict[str, Role]:
    return {w.name: Role.ROLLOUT if i < rollouts else Role.TRAINER for i, w in enumerate(cost.workers)}
