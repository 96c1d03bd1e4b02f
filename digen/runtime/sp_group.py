"""The controller's side of sequence-parallel rollout replicas (``rollout.sequence_parallel: d``).

A *replica* is d rollout workers of one GPU type that generate each sample together
(:mod:`digen.parallel.ulysses`; the ranks run :mod:`digen.workers.sp_loop`). At job start, once the
workers are ready, the controller fixes the replicas (:func:`plan_replicas`) and writes the
plan to Redis. The scheduler then sees a replica as ONE rollout worker, its leader (rank 0,
the first name): the other ranks (*followers*) are taken out of its worker list, so
scheduling, TAG, RAT and the speed it learns from ``TaskDone`` durations count the replica
once, at its measured speed. Workers left over (a count that d does not divide, a GPU type
with fewer than d workers) and workers that join later run as d=1 workers.

Failure. A rank that dies makes its peers' next collective fail: the leader gives its
current task back (a failed attempt, re-queued at once; a dead leader's lease is re-queued
when it leaves the cluster, or when the lease expires), and every surviving rank leaves the
group and works on as a d=1 worker (recorded in ``sp:solo``; the controller announces a
former follower to the scheduler as a joining rollout worker). A restarted rank never
re-joins a replica (it runs d=1). Surviving ranks do not re-form a smaller replica.

Its keys in Redis (the plan, each leader's rendezvous, who joined, who left its replica) are
:class:`~digen.controlplane.sp_keys.SpGroup`'s, which the ranks read too.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from digen.controlplane.sp_keys import SpGroup
from digen.core.events import Instruction, Role, WorkerJoined, WorkerLeft

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    """A rollout worker the controller may put into a replica."""

    name: str
    gpu_type: str
    sp_group: str | None = None
    """``digen worker --sp-group NAME``: workers of one named group form replicas together."""


def plan_replicas(workers: Iterable[Candidate], degree: int) -> list[list[str]]:
    """Replicas of ``degree`` workers, each sorted by name (the leader first). Workers with an
    ``sp_group`` form replicas within their group only, the others within their GPU type; a
    pool's workers sorted by name are cut into consecutive runs of ``degree``, the rest stay
    d=1 (not listed). ``degree`` 1: no replica."""
    if degree < 2:
        return []
    pools: dict[tuple[str, str], list[str]] = {}
    for w in workers:
        key = ("group", w.sp_group) if w.sp_group else ("gpu", w.gpu_type)
        pools.setdefault(key, []).append(w.name)
    replicas: list[list[str]] = []
    for key in sorted(pools):
        names = sorted(pools[key])
        replicas += [names[i : i + degree] for i in range(0, len(names) - degree + 1, degree)]
    return sorted(replicas)


@dataclass
class SpControl:
    """Controller hooks for ``rollout.sequence_parallel`` (see the module docstring)."""

    group: SpGroup
    degree: int
    replicas: list[list[str]] = field(default_factory=list)
    hidden: set[str] = field(default_factory=set)
    """Followers the scheduler does not see (their leader stands for the replica)."""

    def start(self, members, sched, now: float) -> list[Instruction]:
        """Fix the replicas from the rollout workers known now and hide their followers from
        the scheduler (before its :meth:`~digen.core.scheduler.Scheduler.start`)."""
        candidates = [
            Candidate(n, w.gpu_type, getattr(w, "sp_group", None))
            for n, w in members.workers.items()
            if members.role_of(w) is Role.ROLLOUT
        ]
        self.replicas = plan_replicas(candidates, self.degree)
        self.group.set_plan(self.degree, self.replicas)
        out: list[Instruction] = []
        for replica in self.replicas:
            log.info(
                "sequence-parallel replica (d=%d): %s (%s leads)", self.degree, ", ".join(replica), replica[0]
            )
            for follower in replica[1:]:
                self.hidden.add(follower)
                out += sched.handle(WorkerLeft(follower, now))
        solo = sorted(c.name for c in candidates if not any(c.name in r for r in self.replicas))
        if solo:
            log.info("rollout workers outside a replica (d=1): %s", ", ".join(solo))
        return out

    def check(self, members, sched, now: float) -> list[Instruction]:
        """Followers that left their replica (:meth:`SpGroup.leave`) become rollout workers
        the scheduler sees, unless they already re-joined it (a restarted process does)."""
        out: list[Instruction] = []
        for name, why in sorted(self.group.solo().items()):
            if name not in self.hidden:
                continue
            self.hidden.discard(name)
            w = members.workers.get(name)
            if w is None or name in sched.workers:
                continue
            log.warning(
                "worker %s left its sequence-parallel replica (%s); it runs as a d=1 worker", name, why
            )
            out += sched.handle(WorkerJoined(name, members.role_of(w), w.gpu_type, now))
        return out
