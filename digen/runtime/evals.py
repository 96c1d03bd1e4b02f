"""The controller's side of held-out evaluation: ``eval`` tasks out, their scores in.

The scheduler decides when an evaluation's tasks are released (:mod:`digen.core.scheduler`:
only when the workers that evaluate have no generation task left); :class:`Evaluations`
builds their payloads (:class:`~digen.evaluation.EvalTask`), collects each chunk's scores and
grid cells (the task's result: JSON, the cells a small PNG), writes ``eval.jsonl`` and
the grid once an evaluation is complete, and says which weight versions must stay published
until their evaluation has run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from PIL import Image

from digen.config import Config
from digen.controlplane.jobstate import JobState
from digen.controlplane.messages import EvalChunkResult
from digen.controlplane.payloads import EvalPayload
from digen.core.events import TaskRef
from digen.evaluation import (
    TOTAL,
    EvalBook,
    EvalResult,
    EvalTask,
    eval_version,
    plan_eval,
    progress_row,
    write_evaluation,
)
from digen.rundir import RunDir
from digen.viz import CELL, from_png


@dataclass
class Evaluations:
    cfg: Config
    run: RunDir
    job: JobState
    prompts: list[str]
    progress: object = None
    books: dict[int, EvalBook] = field(default_factory=dict)
    plans: dict[int, list[EvalTask]] = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)
    """Rows written so far (one per finished evaluation)."""

    def payload(self, ref: TaskRef) -> EvalPayload:
        """The queued payload of ``eval`` task ``ref`` (chunk ``ref.group`` of the evaluation
        after iteration ``ref.iteration``)."""
        k = ref.iteration
        if k not in self.plans:
            self.plans[k] = plan_eval(self.cfg, self.prompts, k)
            self.books[k] = EvalBook(k, eval_version(self.cfg, k), len(self.plans[k]))
        return EvalPayload(self.plans[k][ref.group])

    def pending(self, ref: TaskRef) -> bool:
        """True while ``eval`` task ``ref``'s result is awaited (not counted yet)."""
        book = self.books.get(ref.iteration)
        return book is not None and ref.group not in book.results

    def keep_from(self, default: int, waiting: list[int]) -> int:
        """The oldest weight version still needed: ``default``, an unfinished evaluation's, or
        that of an evaluation the scheduler holds back (``waiting``: its iterations)."""
        waits = [eval_version(self.cfg, k) for k in waiting]
        return min([default, *(b.version for b in self.books.values()), *waits])

    def collect(self, ref: TaskRef, res: EvalChunkResult, events: list[dict]) -> list[dict]:
        """Count one chunk's result (once) and its timeline rows ``events`` (as written);
        returns the timeline rows of an evaluation that completed with it (empty otherwise),
        after writing its ``eval.jsonl`` row and grid."""
        book = self.books.get(ref.iteration)
        if book is None or ref.group in book.results:
            return []
        task = self.plans[ref.iteration][ref.group]
        book.add(EvalResult(task, from_png(res.cells), res.scores), res.end - res.start)
        book.events += events
        if not book.complete:
            return []
        return self._finish(ref.iteration)

    def drop(self, ref: TaskRef) -> list[dict]:
        """A dead ``eval`` task (``schedule.on_poison: drop``): its prompts score NaN."""
        book = self.books.get(ref.iteration)
        if book is None or ref.group in book.results:
            return []
        task = self.plans[ref.iteration][ref.group]
        n = len(task.indices)
        other = next(iter(book.results.values()), None)
        names = list(other.scores) if other is not None else [TOTAL]
        side = other.cells.height if other is not None else CELL
        blank = Image.new("RGB", (n * side, side), "black")
        book.add(EvalResult(task, blank, {k: [float("nan")] * n for k in names}))
        return self._finish(ref.iteration) if book.complete else []

    def _finish(self, k: int) -> list[dict]:
        book = self.books.pop(k)
        self.plans.pop(k, None)
        row = write_evaluation(self.run, book)
        self.rows.append(row)
        if callable(self.progress):
            self.progress(progress_row(row))
        return book.events
