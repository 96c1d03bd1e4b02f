"""digen.controlplane.queue.TaskQueue on a real Redis: leases, acks, re-delivery, dead letters."""

from __future__ import annotations

import collections
import subprocess
import sys
import threading
import time

import pytest
import redis

from digen.bench.queue import bench_queue
from digen.controlplane.queue import LeasedTask, TaskQueue
from digen.controlplane.redis_conn import embedded_url


@pytest.fixture()
def q(redis_client: redis.Redis) -> TaskQueue:
    return TaskQueue(redis_client, "job1", lease_s=30.0, task_ids=False)


def lease_deadline(queue: TaskQueue, task_id: str) -> float:
    """When ``task_id``'s lease expires (Redis server clock), as the lease record says: tests
    pass it to ``requeue_expired(now=...)`` instead of sleeping past it."""
    deadline = queue.redis.zscore(queue.prefix + "leases", task_id)
    assert deadline is not None, f"{task_id} is not leased"
    return deadline


def blocked_clients(r: redis.Redis, command: str) -> int:
    """Clients of ``r``'s server blocked in ``command`` right now (CLIENT LIST)."""
    return sum(1 for c in r.client_list() if c.get("cmd") == command and "b" in c.get("flags", ""))


def wait_until(cond, what: str, timeout_s: float = 60) -> None:
    """Poll ``cond``; the timeout only guards against a hang."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def calls(r: redis.Redis, command: str) -> int:
    return r.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)


def _drain(queue: TaskQueue, names: list[str], worker: str = "w") -> list[str]:
    out = []
    while (task := queue.lease(names, worker)) is not None:
        out.append(task.task_id)
    return out


def test_lease_returns_payload_queue_and_first_attempt(q: TaskQueue):
    assert q.put("gen", "t1", {"prompt": "a cat", "seed": 3})
    task = q.lease(["gen"], "w1")
    assert task == LeasedTask(queue="gen", task_id="t1", payload={"prompt": "a cat", "seed": 3}, attempt=1)
    assert q.state("t1") == "leased" and q.leased_count() == 1 and q.pending_count("gen") == 0
    assert q.lease(["gen"], "w1") is None


def test_lease_is_fifo_within_a_queue_and_follows_priority_across_queues(q: TaskQueue):
    for i in range(3):
        q.put("gen", f"g{i}", {})
        q.put("train", f"t{i}", {})
    assert _drain(q, ["train", "gen"]) == ["t0", "t1", "t2", "g0", "g1", "g2"]


def test_put_is_idempotent_for_pending_leased_and_done_tasks(q: TaskQueue):
    assert q.put("gen", "t1", {"v": 1})
    assert not q.put("gen", "t1", {"v": 2})
    assert q.pending_count("gen") == 1
    task = q.lease(["gen"], "w")
    assert task is not None and task.payload == {"v": 1}
    assert not q.put("gen", "t1", {"v": 3})  # leased
    q.ack("t1", b"r", worker="w")
    assert not q.put("gen", "t1", {"v": 4})  # done
    assert q.pending_count("gen") == 0 and q.lease(["gen"], "w") is None
    assert q.put_many("gen", [("t1", {}), ("t2", {}), ("t3", {})]) == 2


def test_ack_is_idempotent_first_result_wins(q: TaskQueue):
    q.put("gen", "t1", {})
    q.lease(["gen"], "w1")
    assert q.ack("t1", b"first", worker="w1") is True
    assert q.ack("t1", b"second", worker="w2") is False
    assert q.get_result("t1") == b"first"
    assert q.pop_done() == ["t1"]  # pushed once
    assert q.leased_count() == 0 and q.state("t1") == "done"


def test_ack_stores_bytes_raw_and_dicts_as_msgpack(q: TaskQueue, redis_client: redis.Redis):
    q.put("gen", "a", {})
    q.put("gen", "b", {})
    q.ack("a", b"\x00raw\xff", worker="w")
    q.ack("b", {"reward": 0.5, "ids": [1, 2]}, worker="w")
    assert redis_client.get("digen:job1:result:a") == b"\x00raw\xff"
    assert q.get_result("a") == b"\x00raw\xff"
    assert q.get_result("b") == {"reward": 0.5, "ids": [1, 2]}
    assert q.get_result("missing") is None
    assert q.results() == {"a": b"\x00raw\xff", "b": {"reward": 0.5, "ids": [1, 2]}}


def test_ack_of_unknown_task_stores_nothing(q: TaskQueue, redis_client: redis.Redis):
    assert q.ack("ghost", b"x", worker="w") is False
    assert redis_client.exists("digen:job1:result:ghost") == 0 and q.pop_done() == []


def test_results_filters_by_prefix(q: TaskQueue):
    for tid in ["it1/gen/0", "it1/gen/1", "it2/gen/0", "it1*odd"]:
        q.put("gen", tid, {})
        q.ack(tid, tid.encode(), worker="w")
    assert set(q.results("it1/")) == {"it1/gen/0", "it1/gen/1"}
    assert set(q.results("it1*")) == {"it1*odd"}  # glob characters are literal
    assert len(q.results()) == 4


def test_expired_lease_is_redelivered_at_the_front(q: TaskQueue):
    for tid in ["t1", "t2", "t3"]:
        q.put("gen", tid, {"x": tid})
    assert q.lease(["gen"], "slow").task_id == "t1"
    deadline = lease_deadline(q, "t1")
    assert q.requeue_expired() == []  # 30 s leases: not yet
    assert q.requeue_expired(now=deadline - 0.001) == []
    assert q.requeue_expired(now=deadline) == ["t1"]
    again = q.lease(["gen"], "fast")
    assert again == LeasedTask("gen", "t1", {"x": "t1"}, attempt=2)
    # the slow worker finishes late: its result still counts, once; the queue stays consistent
    assert q.ack("t1", b"slow", worker="slow") is True
    assert q.ack("t1", b"fast", worker="fast") is False
    assert q.get_result("t1") == b"slow"
    assert not q.extend("t1", worker="fast")
    assert _drain(q, ["gen"]) == ["t2", "t3"]


def test_requeue_expired_with_explicit_now_and_earliest_first(q: TaskQueue):
    for tid in ["a", "b", "c"]:
        q.put("gen", tid, {})
    for _ in range(3):
        q.lease(["gen"], "w")
    q.put("gen", "d", {})
    now = time.time()
    assert q.requeue_expired(now=now) == []  # 30 s leases
    assert q.requeue_expired(now=now + 60) == ["a", "b", "c"]
    assert _drain(q, ["gen"]) == ["a", "b", "c", "d"]


def test_requeued_task_acked_late_is_not_delivered_again(q: TaskQueue):
    q.put("gen", "t1", {})
    q.lease(["gen"], "w1")
    assert q.requeue_expired(now=lease_deadline(q, "t1")) == ["t1"] and q.pending_count("gen") == 1
    assert q.ack("t1", b"late", worker="w1")
    assert q.pending_count("gen") == 0 and q.lease(["gen"], "w2") is None


def test_extend_keeps_a_long_task_leased(q: TaskQueue):
    q.put("train", "t1", {})
    q.lease(["train"], "w1")
    first = deadline = lease_deadline(q, "t1")
    for _ in range(3):
        assert q.extend("t1", worker="w1")
        renewed = lease_deadline(q, "t1")
        assert renewed > deadline  # lease_s from the server's now
        assert q.requeue_expired(now=renewed - 0.001) == []
        deadline = renewed
    assert q.requeue_expired(now=first) == []  # the first deadline passed: still leased
    assert not q.extend("t1", worker="other")
    assert lease_deadline(q, "t1") == deadline
    assert q.requeue_expired(now=deadline) == ["t1"]
    assert not q.extend("t1", worker="w1")  # lease lost


def test_requeue_worker_returns_only_that_workers_tasks(q: TaskQueue):
    for i in range(4):
        q.put("gen", f"t{i}", {})
    q.lease(["gen"], "dead")
    q.lease(["gen"], "alive")
    q.lease(["gen"], "dead")
    assert q.requeue_worker("dead") == ["t0", "t2"]
    assert q.leased_count() == 1 and q.state("t1") == "leased"
    assert _drain(q, ["gen"]) == ["t0", "t2", "t3"]


def test_nack_requeues_then_dead_letters_after_max_attempts(q: TaskQueue):
    q.put("gen", "bad", {"n": 1})
    q.put("gen", "good", {})
    outcomes = []
    for _ in range(3):
        task = q.lease(["gen"], "w")
        assert task is not None
        if task.task_id == "good":
            q.ack("good", b"ok", worker="w")
            task = q.lease(["gen"], "w")
        outcomes.append(q.nack("bad", f"boom {task.attempt}", max_attempts=3, worker="w"))
    assert outcomes == ["requeued", "requeued", "dead"]
    assert q.state("bad") == "dead" and q.pending_count("gen") == 0 and q.leased_count() == 0
    (dead,) = q.dead_letters()
    assert (dead.task_id, dead.queue, dead.error, dead.attempts) == ("bad", "gen", "boom 3", 3)
    assert q.ack("bad", b"too late", worker="w") is False and q.get_result("bad") is None
    assert q.nack("bad", "again", max_attempts=3) == "ignored"


def test_nack_by_a_worker_that_lost_the_lease_is_ignored(q: TaskQueue):
    q.put("gen", "t", {})
    q.lease(["gen"], "w2")
    assert q.nack("t", "x", max_attempts=5, worker="w1") == "ignored"
    assert q.state("t") == "leased"


def test_requeue_expired_dead_letters_after_max_attempts(q: TaskQueue):
    q.put("gen", "oom", {})
    for _ in range(2):
        q.lease(["gen"], "w")
        assert q.requeue_expired(now=lease_deadline(q, "oom"), max_attempts=3) == ["oom"]
    q.lease(["gen"], "w")
    assert q.requeue_expired(now=lease_deadline(q, "oom"), max_attempts=3) == []
    assert [d.task_id for d in q.dead_letters()] == ["oom"]
    assert "lease lost 3 times" in q.dead_letters()[0].error


def test_blocking_lease_wakes_on_put_without_spinning(q: TaskQueue, redis_client: redis.Redis):
    def put_once_blocked() -> None:
        wait_until(lambda: blocked_clients(redis_client, "blpop") == 1, "lease never blocked")
        q.put("train", "late", {"k": 1})

    q._block_slice = 600.0  # no 1 s re-check (for tokens lost in a restart): only a put wakes it
    putter = threading.Thread(target=put_once_blocked)
    scripts, blpops = calls(redis_client, "evalsha"), calls(redis_client, "blpop")
    putter.start()
    task = q.lease(["gen", "train"], "w", block_s=600.0)
    putter.join()
    assert task is not None and task.task_id == "late"
    # one look, one BLPOP woken by the put's token, one look that leases: no polling
    assert calls(redis_client, "blpop") - blpops == 1
    assert calls(redis_client, "evalsha") - scripts == 3  # the 2 lease looks + the put


def test_blocking_lease_on_a_drained_queue_does_not_spin(q: TaskQueue, redis_client: redis.Redis):
    q.put_many("gen", [(f"t{i}", {}) for i in range(300)])
    assert len(_drain(q, ["gen"])) == 300  # leaves 300 wake-up tokens behind
    scripts_before = redis_client.info("commandstats")["cmdstat_evalsha"]["calls"]
    assert q.lease(["gen"], "w", block_s=0.3) is None
    scripts = redis_client.info("commandstats")["cmdstat_evalsha"]["calls"] - scripts_before
    assert scripts <= 3, f"{scripts} lease attempts in 0.3 s"


def test_blocking_lease_times_out(q: TaskQueue, redis_client: redis.Redis):
    start, blpops = time.monotonic(), calls(redis_client, "blpop")
    assert q.lease(["gen"], "w", block_s=0.3) is None
    assert time.monotonic() - start >= 0.3
    assert calls(redis_client, "blpop") - blpops >= 1  # it waited in BLPOP, not in a loop


def test_pop_done_blocks_for_the_first_and_drains_the_rest(q: TaskQueue, redis_client: redis.Redis):
    assert q.pop_done(timeout_s=0.2) == []
    for tid in ["a", "b", "c", "d"]:
        q.put("gen", tid, {})
    for tid in ["a", "b", "c"]:
        q.ack(tid, b"", worker="w")
    assert q.pop_done(timeout_s=1.0) == ["a", "b", "c"]  # all in one call

    def ack_once_blocked() -> None:
        wait_until(lambda: blocked_clients(redis_client, "blpop") == 1, "pop_done never blocked")
        q.ack("d", b"", worker="w")

    q._block_slice = 600.0  # no 1 s re-check: only the ack wakes it
    acker = threading.Thread(target=ack_once_blocked)
    blpops = calls(redis_client, "blpop")
    acker.start()
    assert q.pop_done(timeout_s=600.0) == ["d"]  # woken by the ack (else: 600 s)
    acker.join()
    assert calls(redis_client, "blpop") - blpops == 1


def test_jobs_are_isolated_and_clear_removes_only_its_keys(redis_client: redis.Redis):
    a, b = TaskQueue(redis_client, "jobA", task_ids=False), TaskQueue(redis_client, "jobB", task_ids=False)
    a.put("gen", "t", {})
    b.put("gen", "t", {})
    a.lease(["gen"], "w")
    a.ack("t", b"x", worker="w")
    assert b.pending_count("gen") == 1 and b.get_result("t") is None
    assert a.clear() > 0
    assert redis_client.keys("digen:jobA:*") == []
    assert b.pending_count("gen") == 1


def test_concurrent_consumers_run_every_task_exactly_once(q: TaskQueue):
    n_tasks, n_workers = 2000, 4
    q.put_many("gen", [(f"t{i}", {"i": i}) for i in range(n_tasks)])
    stored: list[list[str]] = [[] for _ in range(n_workers)]
    all_leased = threading.Barrier(n_workers)

    def consume(k: int) -> None:
        first = q.lease(["gen"], f"w{k}")  # every consumer holds a task at once: concurrent
        all_leased.wait(timeout=120)
        if first is not None and q.ack(first.task_id, first.task_id.encode(), worker=f"w{k}"):
            stored[k].append(first.task_id)
        while (task := q.lease(["gen"], f"w{k}", block_s=0.05)) is not None:
            assert task.payload == {"i": int(task.task_id[1:])}
            if q.ack(task.task_id, task.task_id.encode(), worker=f"w{k}"):
                stored[k].append(task.task_id)

    threads = [threading.Thread(target=consume, args=(k,)) for k in range(n_workers)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    print(f"\n{n_tasks} lease+ack round trips, {n_workers} threads: {n_tasks / elapsed:.0f}/s")
    counts = collections.Counter(tid for ids in stored for tid in ids)
    assert len(counts) == n_tasks and set(counts.values()) == {1}
    assert all(stored), "every consumer got work"
    assert sorted(q.pop_done(), key=lambda s: int(s[1:])) == [f"t{i}" for i in range(n_tasks)]
    assert q.pending_count("gen") == 0 and q.leased_count() == 0


_CONSUMER = """
import sys
from digen.controlplane.redis_conn import connect
from digen.controlplane.queue import TaskQueue
q = TaskQueue(connect(sys.argv[1]), "job1", task_ids=False)
n = 0
while (task := q.lease(["gen"], sys.argv[2], block_s=0.2)) is not None:
    n += q.ack(task.task_id, sys.argv[2].encode(), worker=sys.argv[2])
print(n)
"""


@pytest.mark.slow
def test_consumers_in_other_processes_share_the_queue(q: TaskQueue, redis_client: redis.Redis):
    n_tasks = 300
    q.put_many("gen", [(f"t{i}", {}) for i in range(n_tasks)])
    url = embedded_url(redis_client)
    procs = [
        subprocess.Popen([sys.executable, "-c", _CONSUMER, url, f"p{k}"], stdout=subprocess.PIPE, text=True)
        for k in range(2)
    ]
    counts = [int(p.communicate(timeout=60)[0]) for p in procs]
    assert sum(counts) == n_tasks
    results = q.results()
    assert len(results) == n_tasks and set(results.values()) <= {b"p0", b"p1"}


def test_bench_queue_reports_a_rate(redis_client: redis.Redis):
    rate = bench_queue(200, 2, redis_client=redis_client)
    print(f"\nbench_queue(200, 2): {rate:.0f} round trips/s")
    assert rate > 0
    assert redis_client.keys("digen:bench-*") == []


def test_put_all_queues_its_tasks_at_once_as_issued_ids(redis_client):
    q = TaskQueue(redis_client, "all", issued_only=True)  # the controller's queue
    assert q.put_all([("gen", "gen:0:0", {"n": 0}), ("gen", "gen:0:1", {"n": 1})]) == [True, True]
    assert q.put_all([("gen", "gen:0:1", {"n": 1})]) == [False]  # exists: nothing changes
    got = [q.lease(["gen"], "w") for _ in range(2)]
    assert [t.task_id for t in got if t is not None] == ["gen:0:0", "gen:0:1"]
    for t in got:
        assert t is not None and q.ack(t.task_id, {"ok": 1}, worker="w")
    assert sorted(q.pop_done()) == ["gen:0:0", "gen:0:1"] and q.quarantined_count() == 0
