"""The controller's records of one job: what was released, what came back, where it lives.

Plain data and small queries, no I/O: the parts of the controller
(:mod:`~digen.runtime.dispatch` releases tasks, :mod:`~digen.runtime.results` collects them,
:mod:`~digen.runtime.steps` asks for optimizer steps) read and write one :class:`Ledger`.
It holds no tensor: a generated group's trajectories and a train task's gradient stay on the
worker that made them; the ledger says which worker (and, for a blob, its
:class:`~digen.controlplane.messages.BlobRef`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from digen.config import Config
from digen.controlplane.messages import BlobRef
from digen.controlplane.payloads import Payload
from digen.core.events import TaskKind, TaskRef
from digen.core.versions import generation_version
from digen.iteration import IterationBook
from digen.task_records import plan_groups


@dataclass(frozen=True)
class Trained:
    """A train task whose result counted: who holds its gradient (in its running sum, or as a
    blob when ``blob`` is set)."""

    task: TaskRef
    worker: str
    blob: BlobRef | None = None


@dataclass
class Ledger:
    cfg: Config
    prompts: list[str]
    books: dict[int, IterationBook] = field(default_factory=dict)
    outstanding: dict[str, tuple[str, Payload]] = field(default_factory=dict)
    """Released tasks not yet collected: id -> (queue, payload), to queue again if Redis lost them."""
    released_at: dict[str, float] = field(default_factory=dict)
    """When each outstanding task went into its queue (controller clock): its timeline rows get
    it as ``released`` (:func:`digen.evaluation.eval_interference` reads the waits)."""
    collected: set[str] = field(default_factory=set)
    """Tasks of unfinished iterations whose result (or death) is counted: never twice."""
    sources: dict[int, dict[int, BlobRef]] = field(default_factory=dict)
    """Per iteration, per group: where its generated trajectories are (``worker`` set: the
    worker whose result said so)."""
    trained: dict[int, dict[str, Trained]] = field(default_factory=dict)
    """Per iteration: the train tasks that counted and whose gradient is held, by id (until
    their step commits)."""
    train_released: dict[int, set[str]] = field(default_factory=dict)
    """Per iteration: every train task put in the ``train`` queue (a step sums them all)."""
    committed: dict[int, dict[str, int]] = field(default_factory=dict)
    """Per iteration: the train tasks in committed steps -> their rows (the iteration's books)."""
    regenerating: set[tuple[int, int]] = field(default_factory=set)
    """(iteration, group) whose trajectories were lost and are being generated again."""
    parked: dict[tuple[int, int], set[str]] = field(default_factory=dict)
    """(iteration, group) -> tasks parked until its trajectories exist again."""
    cells: dict[int, dict[int, bytes]] = field(default_factory=dict)
    """Per grid iteration, per group: its images as grid cells (PNG)."""
    gen_versions: dict[int, dict[int, int]] = field(default_factory=dict)
    dead: dict[int, list[str]] = field(default_factory=dict)
    """Dropped dead tasks per iteration (``schedule.on_poison: drop``)."""
    untrained: dict[int, set[tuple[int, int | None]]] = field(default_factory=dict)
    """(group, part) per iteration whose train task died: its samples do not count as trained."""
    events: list[dict] = field(default_factory=list)
    """Timeline rows collected and not yet written."""

    def generation_versions(self) -> list[int]:
        """The weight versions that generation not yet done will load: every group of an open
        iteration that is not scored yet, and every group being generated again after its
        trajectories were lost (with the version it first had, so it comes out the same).
        With mini-batches at staleness 1 an iteration can take its first step while its last
        groups still generate, so the trainers must keep serving these
        (:meth:`digen.runtime.controller.Controller.oldest_needed`)."""
        needed = [
            t.version for book in self.books.values() for t in book.groups if t.group not in book.rewards
        ]
        needed += [self.books[i].groups[g].version for i, g in self.regenerating if i in self.books]
        return needed

    def book(self, iteration: int) -> IterationBook:
        if iteration not in self.books:
            lag = int(self.cfg.schedule.resolved().max_staleness or 0)  # in iterations
            version = generation_version(iteration, self.cfg.train.mini_batches, lag)
            self.books[iteration] = IterationBook(
                self.cfg, iteration, plan_groups(self.cfg, self.prompts, iteration, version)
            )
        return self.books[iteration]

    def held_on(
        self, worker: str, keep: frozenset[str] | set[str] = frozenset()
    ) -> tuple[list[tuple[int, int]], dict[int, list[TaskRef]]]:
        """What a worker that left took with it: the (iteration, group) whose trajectories
        only it held, and per iteration the train tasks whose gradients it held (less those in
        ``keep``: the step in flight's, which its decision settles)."""
        groups = [
            (k, g)
            for k, src in sorted(self.sources.items())
            for g, b in sorted(src.items())
            if b.worker == worker and self.trajectories_needed(k, g)
        ]
        tasks = {
            k: [
                t.task
                for t in done.values()
                if (t.blob.worker if t.blob else t.worker) == worker and t.task.id not in keep
            ]
            for k, done in sorted(self.trained.items())
        }
        return groups, {k: v for k, v in tasks.items() if v}

    def trajectories_needed(self, iteration: int, group: int) -> bool:
        """Whether a train task may still read the group's trajectories: some mini-batch it
        trains in (every one with ``train.mini_batch_split: samples``) has no committed step
        yet. A group whose mini-batches are all committed is not generated again when its
        trajectories are lost: nothing would read them, and the version it was generated
        with may be served no more (:meth:`generation_versions`)."""
        book = self.books.get(iteration)
        if book is None:
            return False
        m = self.cfg.train.mini_batches
        wanted = set(range(m)) if book.by_samples else {book.mini_batch(group)}
        committed = {
            book.task_mini_batch(r.group, r.part)
            for r in map(TaskRef.parse, self.committed.get(iteration, {}))
        }
        return not wanted <= committed

    def untrain(self, iteration: int, refs: list[TaskRef]) -> None:
        """Forget train results that no longer count (their gradient is gone)."""
        done = self.trained.get(iteration, {})
        book = self.books.get(iteration)
        for ref in refs:
            done.pop(ref.id, None)
            self.collected.discard(ref.id)
            if book is not None:
                book.stats.pop((ref.group, ref.part or 0), None)

    def settle(self, iteration: int) -> list[str]:
        """The books of a finished iteration follow its committed steps: a train result no
        committed step summed stops counting (its stats go), and a released train task that no
        committed step holds and that is not dead counts as dead (its samples are dropped).
        Returns those tasks (none while the step invariant holds: :mod:`digen.runtime.steps`)."""
        committed = self.committed.get(iteration, {})
        dead = self.dead.setdefault(iteration, [])
        never = sorted(self.train_released.get(iteration, set()) - committed.keys() - set(dead))
        for tid in never:
            ref = TaskRef.parse(tid)
            dead.append(tid)
            self.untrained.setdefault(iteration, set()).add((ref.group, ref.part))
        book = self.books[iteration]
        summed = {(r.group, r.part or 0) for r in map(TaskRef.parse, committed)}
        for key in [k for k, st in book.stats.items() if k not in summed and st.rows]:
            del book.stats[key]
        if not dead:
            del self.dead[iteration]
        return never

    def forget(self, iteration: int) -> None:
        """Drop an iteration's records once it is finished."""
        for d in (
            self.books,
            self.sources,
            self.trained,
            self.cells,
            self.gen_versions,
            self.train_released,
            self.committed,
        ):
            d.pop(iteration, None)
        self.collected = {t for t in self.collected if TaskRef.parse(t).iteration != iteration}
        self.regenerating = {x for x in self.regenerating if x[0] != iteration}
        self.parked = {x: v for x, v in self.parked.items() if x[0] != iteration}

    def gen_id(self, iteration: int, group: int) -> str:
        return TaskRef(TaskKind.GEN, iteration, group).id
