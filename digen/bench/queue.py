"""Micro-benchmark of the task queue: lease + ack round trips per second (for ``digen bench``)."""

from __future__ import annotations

import tempfile
import threading
import time
import uuid
from pathlib import Path

import redis

from digen.controlplane.queue import TaskQueue
from digen.controlplane.redis_conn import connect, stop_embedded


def bench_queue(
    n_tasks: int = 2000,
    n_consumers: int = 4,
    *,
    redis_client: redis.Redis | None = None,
    result_bytes: int = 64,
) -> float:
    """Queue ``n_tasks`` tiny tasks, let ``n_consumers`` threads lease and ack them until the
    queue is empty, and return round trips (lease + ack) per second. Uses a throw-away
    embedded Redis when ``redis_client`` is None; the job's keys are deleted afterwards."""
    tmp = None
    if redis_client is None:
        tmp = tempfile.TemporaryDirectory(prefix="digen-bench-")
        db_path = Path(tmp.name) / "bench.db"
        redis_client = connect(None, db_path=db_path)
    queue = TaskQueue(redis_client, f"bench-{uuid.uuid4().hex[:8]}", lease_s=60.0, task_ids=False)
    try:
        queue.put_many("q", [(f"t{i}", {"i": i}) for i in range(n_tasks)])
        result = b"x" * result_bytes

        def consume(worker: str) -> None:
            while (task := queue.lease(["q"], worker)) is not None:
                queue.ack(task.task_id, result, worker=worker)

        threads = [threading.Thread(target=consume, args=(f"w{i}",)) for i in range(n_consumers)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - start
        return n_tasks / elapsed
    finally:
        queue.clear()
        if tmp is not None:
            redis_client.close()
            stop_embedded(db_path)
            tmp.cleanup()


# --- worker processes (the real shape: each digen worker is its own process) -----------------


def _consume(url: str, job_id: str, worker: str, lease_s: float, ready, start, stop_after: int) -> None:
    """Lease and ack until the queue is empty. With ``stop_after`` > 0, die (SIGKILL) holding
    a lease after that many tasks, as a preempted worker does."""
    import os
    import signal

    queue = TaskQueue(connect(url), job_id, lease_s=lease_s, task_ids=False)
    queue.pending_count("q")  # connected
    ready.put(worker)
    start.wait()
    done = 0
    while True:
        task = queue.lease(["q"], worker, block_s=0.2)
        if task is None:
            if queue.pending_count("q") == 0 and queue.leased_count() == 0:
                return  # drained (a lease still held elsewhere may yet come back: keep polling)
            continue
        if stop_after and done >= stop_after:
            os.kill(os.getpid(), signal.SIGKILL)
        queue.ack(task.task_id, task.task_id.encode(), worker=worker)
        done += 1


def bench_queue_processes(
    n_tasks: int = 10_000,
    n_consumers: int = 4,
    *,
    redis_url: str | None = None,
    lease_s: float = 60.0,
    killed: int = 0,
    on_wait=None,
) -> tuple[float, TaskQueue]:
    """Queue ``n_tasks`` tasks, drain them with ``n_consumers`` worker *processes* and return
    (lease + ack round trips per second, the queue) once every task is acknowledged. ``killed``
    of the consumers die halfway through their share, holding a lease; ``on_wait(queue)`` is
    called every 0.2 s while waiting (a controller re-queuing expired leases, say). The caller
    clears the queue (``queue.clear()``)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    client = connect(redis_url)
    url = redis_url or _embedded_url(client)
    queue = TaskQueue(client, f"bench-{uuid.uuid4().hex[:8]}", lease_s=lease_s, task_ids=False)
    queue.put_many("q", [(f"t{i}", {"i": i}) for i in range(n_tasks)])
    ready, start = ctx.Queue(), ctx.Event()
    share = n_tasks // max(n_consumers, 1)
    procs = [
        ctx.Process(
            target=_consume,
            args=(url, queue.job_id, f"w{k}", lease_s, ready, start, share // 2 if k < killed else 0),
        )
        for k in range(n_consumers)
    ]
    for p in procs:
        p.start()
    for _ in procs:  # every consumer is up and connected: the clock measures the drain only
        ready.get(timeout=120)
    t0 = time.perf_counter()
    start.set()
    while queue.redis.llen(queue.prefix + "done") < n_tasks and any(p.is_alive() for p in procs):
        time.sleep(0.02)
        if on_wait is not None:
            on_wait(queue)
    elapsed = time.perf_counter() - t0
    for p in procs:
        p.join(timeout=60)
    return n_tasks / elapsed, queue


def _embedded_url(client: redis.Redis) -> str:
    from digen.controlplane.redis_conn import embedded_url

    return embedded_url(client)


if __name__ == "__main__":  # python -m digen.bench.queue
    rate, q = bench_queue_processes(10_000, 4)
    q.clear()
    print(f"10,000 lease+ack round trips, 4 worker processes: {rate:,.0f}/s")
    print(f"2,000 round trips, 4 threads of one process: {bench_queue(2000, 4):,.0f}/s")
