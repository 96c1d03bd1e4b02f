"""Micro-benchmark of the task queue: lease + ack round trips per second (for ``digen bench``)."""

from __future__ import annotations

import tempfile
import threading
import time
import uuid
from pathlib import Path

import redis

from digen.runtime.queue import TaskQueue
from digen.runtime.redis_conn import connect, stop_embedded


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
    queue = TaskQueue(redis_client, f"bench-{uuid.uuid4().hex[:8]}", lease_s=60.0)
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
