"""What a simulated run measured: :class:`SimResult`, the measured window of its iterations
(steady state, :func:`measured_window`), its bubble ratio and data-plane seconds. Shared by the
discrete-event driver of digen's modes (:mod:`digen.sim.driver`) and the phase-by-phase
restatement of the peers (:mod:`digen.sim.peers`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from digen.core.events import Role

BUSY_KINDS = frozenset({"gen", "decode", "reward", "train"})
"""Timeline kinds that count as useful work in the bubble ratio (``sync`` does not, as in
the controller's metrics)."""
DATAPLANE_PARTS = {
    "all-reduce": "reduce_s",
    "AdamW step": "step_s",
    "weights fetch": "distribute_s",
    "trajectory fetch": "trajectory_s",
}
"""The timeline ``part`` of each data-plane phase, and its key in :attr:`SimResult.dataplane`."""


@dataclass
class SimResult:
    """One simulated run: the timeline and per-iteration step ends, and its metrics over the
    measured iterations (after ``warmup``, before ``trailing``: :func:`measured_window`)."""

    mode: str
    roles: dict[str, Role]
    rows: list[dict]
    step_ends: list[float]
    samples_per_iteration: int
    gpus: int
    warmup: int
    trailing: int = 0
    s_per_iteration: float = 0.0
    samples_per_s: float = 0.0
    bubble_ratio: float = 0.0
    window: tuple[float, float] = (0.0, 0.0)
    dataplane: dict[str, float] = field(default_factory=dict)
    """Data-plane seconds per iteration, per phase (:func:`dataplane_per_iteration`)."""

    @property
    def samples_per_s_per_gpu(self) -> float:
        return self.samples_per_s / self.gpus if self.gpus else 0.0


def measured_window(step_ends: list[float], warmup: int, trailing: int = 0) -> tuple[float, float]:
    """``[lo, hi]`` of the measured iterations: from the step of iteration ``warmup - 1`` (0 s
    without warm-up) to that of the last iteration before the ``trailing`` ones. Whole
    iterations, step to step: the window holds the measured iterations' training; where
    generation runs ahead (staleness) it holds part of the next iteration's generation in
    place of part of the first one's, as every steady iteration does, which is why the
    iteration after the window must exist."""
    lo = step_ends[warmup - 1] if warmup > 0 else 0.0
    return lo, step_ends[len(step_ends) - 1 - trailing]


def measure_rows(res: SimResult) -> None:
    """Fill ``res``'s metrics from its rows and step ends (:func:`measured_window`)."""
    lo, hi = measured_window(res.step_ends, res.warmup, res.trailing)
    n = len(res.step_ends) - res.warmup - res.trailing
    res.window = (lo, hi)
    res.s_per_iteration = (hi - lo) / n
    res.samples_per_s = res.samples_per_iteration / res.s_per_iteration if res.s_per_iteration > 0 else 0.0
    res.bubble_ratio = bubble_ratio(res.rows, lo, hi, res.gpus)
    res.dataplane = dataplane_per_iteration(res.rows, lo, hi, n)


def dataplane_per_iteration(rows: list[dict], lo: float, hi: float, iterations: int) -> dict[str, float]:
    """Seconds per iteration of each data-plane phase in ``[lo, hi]``, on the lane of one
    worker that pays it (the mean over those that do): the step's all-reduce and AdamW (every
    trainer at once), a rollout worker's weight fetches, a training worker's trajectory
    fetches. Keys: the values of :data:`DATAPLANE_PARTS`."""
    spent: dict[str, dict[str, float]] = {key: {} for key in DATAPLANE_PARTS.values()}
    for r in rows:
        key = DATAPLANE_PARTS.get(r.get("part", ""))
        d = max(0.0, min(r["end"], hi) - max(r["start"], lo))
        if key is not None and d > 0:
            spent[key][r["worker"]] = spent[key].get(r["worker"], 0.0) + d
    return {
        key: sum(by.values()) / len(by) / iterations if by and iterations > 0 else 0.0
        for key, by in spent.items()
    }


def bubble_ratio(rows: list[dict], lo: float, hi: float, gpus: int) -> float:
    """Idle GPU-seconds / GPU-seconds in ``[lo, hi]`` (``sync`` and switches count as idle)."""
    if hi <= lo or gpus <= 0:
        return 0.0
    busy = sum(
        max(0.0, min(r["end"], hi) - max(r["start"], lo)) * r["gpus"]
        for r in rows
        if r["kind"] in BUSY_KINDS and r["worker"] != "controller"
    )
    return max(0.0, 1.0 - busy / (gpus * (hi - lo)))
