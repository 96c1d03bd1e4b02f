"""``digen serve --burst`` returns right after its last job: rq's command thread, which the
runner's exit joins, waits on Redis :data:`~digen.service.runner.PUBSUB_WAKE_S` at a time
instead of rq's 60 s, so the exit waits at most that once the queue is empty. Decided by the
waits the thread asked of Redis, against the real embedded Redis and the real runner (its job
a refused rq job: the work horse forks, records it failed and returns, with no cluster)."""

from __future__ import annotations

import threading

from redis.client import PubSub, PubSubWorkerThread

from digen.controlplane.redis_conn import embedded_url
from digen.service import jobs, runner


def test_a_burst_runner_waits_at_most_pubsub_wake_s_for_its_command_thread_after_its_last_job(r, monkeypatch):
    """Every wait of the runner's command thread on Redis (``get_message(timeout=...)``, what
    its exit joins) is at most PUBSUB_WAKE_S, a second, far below rq's 60 s that kept ``serve
    --burst`` a minute after its last job; and the thread has ended when ``serve`` returns.
    ``get_message`` is redis-py's own, called through: the test only records the waits."""
    waits: list[float] = []
    real = PubSub.get_message

    def recording(self, *args, **kwargs):
        if isinstance(threading.current_thread(), PubSubWorkerThread):
            waits.append(kwargs.get("timeout", 0.0))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PubSub, "get_message", recording)
    before = {t for t in threading.enumerate() if isinstance(t, PubSubWorkerThread)}
    jobs.job_queue(r).enqueue_call("os.getpid", job_id="not-digens")  # refused, then the queue is empty

    assert runner.serve(r, embedded_url(r), burst=True, burst_wait_s=5, name="serve-burst-exit") is True

    assert jobs.job_info(r, "not-digens").state == "failed"  # it ran the job, and returned after it
    assert runner.PUBSUB_WAKE_S <= 1.0
    assert waits and max(waits) <= runner.PUBSUB_WAKE_S, waits
    left = [t for t in threading.enumerate() if isinstance(t, PubSubWorkerThread) and t not in before]
    assert not left, left  # joined on the way out: nothing of the runner keeps waiting
