"""One row of a run's ``timeline.jsonl``: who did what, when, with which weights version.

Every place that makes a timeline row makes a :class:`TimelineRow`: a worker's task events
(:func:`digen.workers.context.event`), an FSDP rank's (:mod:`digen.workers.fsdp_loop`), the
in-process reference loop (:mod:`digen.reference`) and the simulator
(:mod:`digen.sim.driver`, :mod:`digen.sim.peers`). A worker's rows travel to the controller
inside its task's result (:mod:`digen.controlplane.messages`), read back with
:meth:`~digen.records.Record.read_exact`; the controller stamps them and writes them as the
plain dicts of :meth:`TimelineRow.to_json`, which the bench, the plots and the simulator's
calibration read.

The row's keys are ``worker``, ``gpu_type``, ``role``, ``kind``, ``iteration``, ``version``,
``start``, ``end``, then whichever of the optional keys below a row carries (a key left None
is not written).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from digen.records import Record


@dataclass
class TimelineRow(Record):
    """A timeline row (see the module docstring); optional keys are None until set."""

    worker: str
    gpu_type: str
    role: str
    kind: str
    iteration: int
    version: int
    start: float
    end: float
    cpu_s: float | None = None
    """CPU seconds of the thread that ran it (:func:`time.thread_time`), for ``digen bench``'s bound."""
    batch: int | None = None
    """A batched generation: the groups of its forward."""
    share: float | None = None
    """A train task that is not one whole group: its work share in groups."""
    leased: float | None = None
    """When its task left the queue (the worker's clock)."""
    released: float | None = None
    """When the controller put its task in the queue (the controller's clock)."""
    task: str | None = None
    """Its task's id (stamped by the controller; an optimizer step's row names its step)."""
    redis_round_trips: int | None = None
    cycles: int | None = None
    """The worker's Redis requests and loop passes since its last task (its task's last row)."""
    embed_hits: int | None = None
    embed_misses: int | None = None
    """The prompt cache's hits and misses since the last report."""
    sp_degree: int | None = None
    ranks: list[str] | None = None
    """A sequence-parallel replica's degree and ranks."""
    reduce_s: float | None = None
    step_s: float | None = None
    """An optimizer step's reduction and update seconds."""
    gpus: int | None = None
    part: str | None = None
    """The simulator's: GPUs the row occupies, and which overhead it is."""

    def to_json(self) -> dict:
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}

    def set(self, **extra: object) -> TimelineRow:
        """Set optional keys (``TypeError`` for one the row does not have); returns the row."""
        names = {f.name for f in fields(self)}
        for k, v in extra.items():
            if k not in names:
                raise TypeError(f"a timeline row has no key {k!r}")
            setattr(self, k, v)
        return self
