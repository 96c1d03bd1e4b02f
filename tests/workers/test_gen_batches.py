"""A worker's batched generation (rollout.max_batch) on a real Redis, without a cluster: the
loop leases the batch at once, runs it as one, acknowledges each task with its own share."""

from __future__ import annotations

from digen.controlplane.jobstate import JobState
from digen.controlplane.payloads import GenPayload
from digen.controlplane.queue import TaskQueue
from digen.core.events import Role
from digen.dataplane.blobs import BlobStore
from digen.task_records import plan_groups
from digen.workers.context import WorkerContext
from digen.workers.loop import more_gen, next_task, run_gen_tasks


def test_a_batch_is_leased_at_once_run_as_one_and_each_task_acknowledged_with_its_share(
    small_config, redis_client
):
    cfg = small_config(rollout__batch_size=12, rollout__max_batch=2)  # three groups: a batch of 2, then 1
    job, queue = JobState(redis_client, "batch"), TaskQueue(redis_client, "batch")
    job.set_status("running")
    groups = plan_groups(cfg, cfg.prompt_list(), 0, 0)
    queue.put_all([("gen", f"gen:0:{t.group}", GenPayload(t).to_json()) for t in groups])
    ctx = WorkerContext("w", "cpu", cfg, queue, job, "cpu", blobs=BlobStore())
    ctx.ensure_policy()
    ctx.version = 0

    first = next_task(ctx, Role.ROLLOUT, 0)
    assert first is not None and first.task_id == "gen:0:0"
    batch = [first, *more_gen(ctx, first, Role.ROLLOUT)]
    assert [x.task_id for x in batch] == ["gen:0:0", "gen:0:1"]  # max_batch 2: the third waits
    run_gen_tasks(ctx, batch, Role.ROLLOUT)

    results = [queue.get_result(x.task_id) for x in batch]
    assert queue.state("gen:0:2") == "pending" and all(isinstance(r, dict) for r in results)
    gens = [next(e for e in r["events"] if e["kind"] == "gen") for r in results]
    assert [e["batch"] for e in gens] == [2, 2]
    assert gens[0]["end"] == gens[1]["start"]  # the batch's sampling time, split in two
    for r in results:  # each reports its own seconds (what TAG and RAT learn a group's cost from)
        own = sum(e["end"] - e["start"] for e in r["events"])
        assert abs((r["end"] - r["start"]) - own) < 1e-9
    whole = max(r["end"] for r in results) - results[0]["start"]
    assert all(r["end"] - r["start"] < whole for r in results)
    assert len(results[0]["rewards"]) == len(results[1]["rewards"]) == cfg.rollout.group_size
