"""Replica planning and the controller's view of replicas (digen.runtime.sp_group), on a real
Redis and the real scheduler; the ``--sp-group`` option and the config's checks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from digen.cluster.cluster import WorkerInfo
from digen.cluster.node import check_sp_group
from digen.controlplane.resources import worker_resources
from digen.controlplane.sp_keys import SpGroup
from digen.core.events import Release, Role, SetRole, TaskKind, WorkerJoined
from digen.core.scheduler import Scheduler, SchedulerConfig
from digen.errors import ConfigError
from digen.runtime.sp_group import Candidate, SpControl, plan_replicas


def test_replicas_group_by_gpu_type_sorted_by_name_and_leave_the_rest_at_d1():
    workers = [
        Candidate("r3", "h100"),
        Candidate("r1", "h100"),
        Candidate("r2", "h100"),
        Candidate("a0", "a10g"),  # a GPU type with fewer than d workers
        Candidate("r0", "h100"),
        Candidate("r4", "h100"),  # 5 h100: two replicas and one left over
    ]
    assert plan_replicas(workers, 2) == [["r0", "r1"], ["r2", "r3"]]
    assert plan_replicas(workers, 3) == [["r0", "r1", "r2"]]
    assert plan_replicas(workers, 1) == []


def test_named_sp_groups_form_their_own_replicas():
    workers = [
        Candidate("n1-gpu0", "h100", "node1"),
        Candidate("n2-gpu0", "h100", "node2"),
        Candidate("n1-gpu1", "h100", "node1"),
        Candidate("n2-gpu1", "h100", "node2"),
        Candidate("x", "h100"),  # no group: pooled by GPU type, alone there
    ]
    assert plan_replicas(workers, 2) == [["n1-gpu0", "n1-gpu1"], ["n2-gpu0", "n2-gpu1"]]


def controller_view(names_roles: dict[str, Role]) -> SimpleNamespace:
    """What SpControl reads from the controller: its workers and their roles."""
    workers = {n: WorkerInfo(f"tcp://{n}", n, role, "cpu") for n, role in names_roles.items()}
    return SimpleNamespace(workers=workers, role_of=lambda w: w.role)


def test_a_replica_is_one_rollout_worker_to_the_scheduler_until_it_breaks(redis_client):
    roles = {"rollout-0": Role.ROLLOUT, "rollout-1": Role.ROLLOUT, "rollout-2": Role.ROLLOUT}
    ctl = controller_view({**roles, "trainer-0": Role.TRAINER})
    sched = Scheduler(SchedulerConfig(iterations=2, groups=2))
    for n, w in ctl.workers.items():
        sched.handle(WorkerJoined(n, w.role, "cpu", 0.0))
    sp = SpControl(SpGroup(redis_client, "job"), 2)
    sp.start(ctl, sched, 0.0)
    assert SpGroup(redis_client, "job").plan() == {"degree": 2, "replicas": [["rollout-0", "rollout-1"]]}
    out = sched.start(0.0)
    tagged = {i.worker for i in out if isinstance(i, SetRole)}
    assert tagged == {"rollout-0", "rollout-2", "trainer-0"}  # the follower gets no tag
    assert sum(isinstance(i, Release) and i.task.kind is TaskKind.GEN for i in out) == 2
    assert sp.check(ctl, sched, 1.0) == []  # nothing left the replica
    SpGroup(redis_client, "job").leave("rollout-1", "RuntimeError: peer rollout-0 closed the connection")
    sp.check(ctl, sched, 2.0)
    assert "rollout-1" in sched.workers and sched.workers["rollout-1"].role is Role.ROLLOUT
    assert sp.check(ctl, sched, 3.0) == []  # announced once


def test_a_restarted_rank_does_not_join_again(redis_client):
    group = SpGroup(redis_client, "job")
    assert group.join("rollout-1") and not group.join("rollout-1")
    group.leave("rollout-1", "restarted")
    group.leave("rollout-1", "a later reason")  # the first reason stays
    assert group.solo() == {"rollout-1": "restarted"}


def test_sp_group_option_is_checked_and_becomes_a_dask_resource():
    assert worker_resources("rollout", "h100", "node3") == {"rollout": 1, "gpu-h100": 1, "sp-node3": 1}
    assert worker_resources("rollout", "h100") == {"rollout": 1, "gpu-h100": 1}
    check_sp_group(None, "trainer")
    check_sp_group("rack-a.1", "rollout")
    with pytest.raises(ConfigError, match=r"--sp-group \('a b'\) must be a short name"):
        check_sp_group("a b", "rollout")
    with pytest.raises(ConfigError, match=r"--sp-group \(node3\) is for rollout workers; .* --role trainer"):
        check_sp_group("node3", "trainer")


def test_digen_worker_refuses_an_sp_group_on_a_trainer_before_connecting():
    from digen.cli.main import app

    res = CliRunner().invoke(
        app,
        [
            "worker",
            "--scheduler",
            "tcp://127.0.0.1:9",
            "--role",
            "trainer",
            "--gpu-type",
            "cpu",
            "--sp-group",
            "n1",
        ],
    )
    assert res.exit_code != 0
    assert "--sp-group (n1) is for rollout workers" in res.output


def test_rollout_sequence_parallel_needs_a_family_with_a_ulysses_processor(small_config):
    with pytest.raises(ConfigError, match=r"rollout.sequence_parallel \(2\): the sd3 family has no Ulysses"):
        small_config(rollout__sequence_parallel=2, schedule__mode="disaggregated")


def test_rollout_sequence_parallel_needs_separate_rollout_workers(tiny_models):
    from digen.config import build_config
    from tests.conftest import small_config_data

    data = small_config_data(tiny_models("wan"), model__num_frames=5, rollout__sequence_parallel=2)
    with pytest.raises(ConfigError, match=r"needs schedule.mode disaggregated or digen .* got reference"):
        build_config(data)
    data["schedule"]["mode"] = "disaggregated"
    assert build_config(data).rollout.sequence_parallel == 2


def test_a_sequence_parallel_replica_refuses_batched_generation_asked_for_not_the_default(tiny_models):
    from digen.config import build_config
    from tests.conftest import small_config_data

    data = small_config_data(
        tiny_models("wan"),
        model__num_frames=5,
        rollout__sequence_parallel=2,
        rollout__max_batch=2,
        schedule__mode="disaggregated",
    )
    with pytest.raises(ConfigError, match=r"rollout.max_batch \(2\) with rollout.sequence_parallel \(2\)"):
        build_config(data)
    del data["rollout"]["max_batch"]  # left at its default: the replicas run one group at a time
    cfg = build_config(data)
    assert cfg.rollout.max_batch > 1 and cfg.rollout.sequence_parallel == 2
