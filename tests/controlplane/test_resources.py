"""The worker resource grammar: what the cluster writes, the controller and the worker loop read
alike (digen/controlplane/resources.py)."""

from __future__ import annotations

from digen.controlplane.resources import UNTYPED, gpu_type_of, sp_group_of, worker_resources


def test_what_is_written_reads_back():
    res = worker_resources("rollout", "h100", "node3")
    assert res == {"rollout": 1, "gpu-h100": 1, "sp-node3": 1}
    assert (gpu_type_of(res), sp_group_of(res)) == ("h100", "node3")
    assert sp_group_of(worker_resources("trainer", "a100")) is None


def test_a_bare_dask_worker_is_of_no_claimed_type():
    assert gpu_type_of({"trainer": 1}) == UNTYPED == "unknown"
