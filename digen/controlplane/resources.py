"""The Dask resource grammar of digen's workers, written and read in one place.

A worker's resources name its role (``{"trainer": 1}``), its GPU type (``{"gpu-a100": 1}``) and,
for rollout workers that form sequence-parallel replicas together, its named group
(``{"sp-node3": 1}``). The cluster writes them (:func:`worker_resources`); the controller reads
them from the scheduler and the worker loop from its own Dask worker, both through
:func:`gpu_type_of` and :func:`sp_group_of`, so both sides name a worker's type alike. A worker
whose resources name no GPU type (started by hand as a bare Dask worker) is of type
:data:`UNTYPED`: no claim about hardware it may not have."""

from __future__ import annotations

from collections.abc import Mapping

GPU = "gpu-"
SP = "sp-"
UNTYPED = "unknown"


def worker_resources(role: str, gpu_type: str, sp_group: str | None = None) -> dict[str, float]:
    """The resources of a worker of ``role`` on a GPU of ``gpu_type`` (in ``sp_group``)."""
    res: dict[str, float] = {role: 1, f"{GPU}{gpu_type}": 1}
    if sp_group:
        res[f"{SP}{sp_group}"] = 1
    return res


def gpu_type_of(resources: Mapping[str, float]) -> str:
    """The GPU type a worker's resources name, or :data:`UNTYPED`."""
    return next((k[len(GPU) :] for k in resources if k.startswith(GPU)), UNTYPED)


def sp_group_of(resources: Mapping[str, float]) -> str | None:
    """The sequence-parallel group a worker's resources name, or None."""
    return next((k[len(SP) :] for k in resources if k.startswith(SP)), None)
