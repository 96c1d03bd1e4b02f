"""Validate the simulator against reality: a cost model measured from a real run.

A run directory written by ``digen train`` (:mod:`digen.rundir`) holds ``config.yaml``,
``timeline.jsonl`` (one row per task part: ``worker``, ``gpu_type``, ``role``, ``kind``,
``iteration``, ``version``, ``start``, ``end``; a sequence-parallel replica's rows also
``sp_degree`` and ``ranks``) and ``metrics.jsonl``.
:func:`costmodel_from_run` turns the timeline into a :class:`~digen.sim.costmodel.CostModel`:
per worker and kind, the mean seconds of its ``gen`` / ``decode`` / ``reward`` / ``train``
rows and of its weight loads (``sync`` rows: a rollout worker's include fetching the version);
the step's seconds (:func:`step_seconds`); plus the per-task overhead the timeline does not
cover (queue lease, trajectory fetch, acknowledgement), the median gap between back-to-back
tasks on a worker. A replica of ``sp_degree`` ranks is one simulated worker of that many GPUs
(its lane; the leader's rows); its efficiency against d=1 workers is
:func:`digen.sim.sp_calibration.sp_from_run`. The first ``warmup`` iterations (model loading,
compilation) are left out when later ones exist.

:func:`compare_run` then simulates the run's own mode and workers with that cost model and
sets the predicted samples/s and bubble ratio beside the measured ones;
:func:`predict_modes` predicts the other modes on the same workers.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from digen.core.events import Role
from digen.errors import ConfigError
from digen.sim.costmodel import ROWS_PER_FORWARD, CostModel, SimWorker, WorkerCost
from digen.sim.dataplane import DataPlaneSeconds
from digen.sim.driver import MODES, Mode
from digen.sim.measure import SimResult
from digen.sim.rundata import is_follower_row, read_config, read_jsonl
from digen.sim.study import SimSettings, run_mode

PART_KINDS = ("gen", "decode", "reward", "train")


@dataclass(frozen=True)
class RunInfo:
    """What :func:`costmodel_from_run` read besides the costs."""

    mode: Mode
    roles: dict[str, Role]
    iterations: int


@dataclass(frozen=True)
class Comparison:
    mode: str
    predicted_samples_per_s: float
    measured_samples_per_s: float | None
    predicted_bubble_ratio: float
    measured_bubble_ratio: float | None

    @property
    def samples_per_s_error(self) -> float | None:
        """Relative error of the prediction (predicted / measured - 1)."""
        m = self.measured_samples_per_s
        return self.predicted_samples_per_s / m - 1 if m else None

    def to_json(self) -> dict:
        return {
            "mode": self.mode,
            "predicted_samples_per_s": self.predicted_samples_per_s,
            "measured_samples_per_s": self.measured_samples_per_s,
            "predicted_bubble_ratio": self.predicted_bubble_ratio,
            "measured_bubble_ratio": self.measured_bubble_ratio,
            "samples_per_s_error": self.samples_per_s_error,
        }


def run_mode_of(cfg: dict) -> Mode:
    """The sim mode a run used: its resolved ``schedule`` (``config.yaml`` holds it resolved).
    The runtime's colocated mode pulls dynamically and has no offload or recompute."""
    s = cfg.get("schedule", {})
    mode = s.get("mode", "digen")
    if mode == "colocated":
        return MODES["colocated-digen"]
    if mode not in ("disaggregated", "digen"):
        raise ConfigError(
            f"schedule.mode ({mode}) of the run cannot be simulated: use colocated, disaggregated or digen"
        )
    return Mode(
        mode,
        gap=bool(s.get("gap")),
        tsp=bool(s.get("tsp")),
        tag=bool(s.get("tag")),
        rat=bool(s.get("rat")),
        max_staleness=int(s.get("max_staleness") or 0),
    )


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _overhead(rows: list[dict]) -> float:
    """Median gap between back-to-back tasks on one worker (a gap no longer than the median
    task part is taken as queue/ack overhead, a longer one as waiting for work)."""
    rows = sorted(rows, key=lambda r: r["start"])
    parts = [r["end"] - r["start"] for r in rows if r["kind"] in PART_KINDS]
    if len(rows) < 2 or not parts:
        return 0.0
    limit = statistics.median(parts)
    gaps = [
        b["start"] - a["end"]
        for a, b in zip(rows, rows[1:], strict=False)
        if b["kind"] in ("gen", "train", "sync") and 0 <= b["start"] - a["end"] <= limit
    ]
    return statistics.median(gaps) if gaps else 0.0


def _serving(rows: list[dict]) -> set[int]:
    """Ids of the ``sync`` rows that start where an ``optim`` row of the same lane ends: the
    step's members loading and serving the version they made (the controller's broadcast in
    runs from before the data plane). They belong to the step, not to a worker's loads."""
    ends = {(r["worker"], r["end"]) for r in rows if r["kind"] == "optim"}
    return {id(r) for r in rows if r["kind"] == "sync" and (r["worker"], r["start"]) in ends}


def step_seconds(rows: list[dict]) -> DataPlaneSeconds:
    """The step, measured: per iteration, each lane's ``optim`` rows and its serving ``sync``
    row after them (:func:`_serving`); the longest lane, averaged over iterations. The
    all-reduce is the rows' ``reduce_s`` (a step member's row since the data plane) or their
    ``all-reduce`` part (a simulated run), the rest the step. Weight fetches and trajectory
    fetches are not apart: they are inside the rollout workers' loads and the overheads."""
    serving = _serving(rows)
    lanes: dict[tuple[int, str], list[float]] = {}  # (iteration, lane) -> [seconds, of which reduce]
    for r in rows:
        if r["kind"] == "optim" or id(r) in serving:
            d = r["end"] - r["start"]
            lane = lanes.setdefault((int(r["iteration"]), r["worker"]), [0.0, 0.0])
            lane[0] += d
            lane[1] += float(r.get("reduce_s", d if r.get("part") == "all-reduce" else 0.0))
    per_iteration: dict[int, list[float]] = {}
    for (it, _), lane in lanes.items():
        per_iteration[it] = max(per_iteration.get(it, lane), lane)
    if not per_iteration:
        return DataPlaneSeconds()
    reduce = sum(x[1] for x in per_iteration.values()) / len(per_iteration)
    total = sum(x[0] for x in per_iteration.values()) / len(per_iteration)
    return DataPlaneSeconds(reduce_s=reduce, step_s=total - reduce)


def costmodel_from_run(run_dir: str | Path, *, warmup: int = 1) -> CostModel:
    """A cost model measured from ``run_dir``'s timeline (see the module docstring)."""
    return _calibrate(Path(run_dir), warmup)[0]


def _calibrate(run: Path, warmup: int) -> tuple[CostModel, RunInfo]:
    cfg = read_config(run)
    rows = [r for r in read_jsonl(run / "timeline.jsonl") if not is_follower_row(r)]
    iterations = max((int(r["iteration"]) for r in rows), default=-1) + 1
    if iterations == 0:
        raise ConfigError(f"{run}/timeline.jsonl has no rows")
    steady = [r for r in rows if int(r["iteration"]) >= warmup] if iterations > warmup else rows
    roll = cfg.get("rollout", {})
    group = int(roll.get("group_size", 1))
    tasks = int(roll.get("batch_size", group)) // group
    rows_per_forward = int(cfg.get("train", {}).get("rows_per_forward", ROWS_PER_FORWARD))
    # a train task carries train.groups_per_task groups: its measured seconds are that many
    # groups' (exact where groups_per_task divides the groups; the last task takes the rest)
    per_task = max(1, int(cfg.get("train", {}).get("groups_per_task", 1)))

    workers = sorted({r["worker"] for r in rows if r["worker"] != "controller"})
    gpu = {r["worker"]: r.get("gpu_type", "?") for r in rows}
    gpus: dict[str, int] = {}  # a sequence-parallel replica is one worker of sp_degree GPUs
    for r in rows:
        gpus[r["worker"]] = max(gpus.get(r["worker"], 1), int(r.get("sp_degree", 1)))
    role_seen: dict[str, str] = {}
    for r in rows:
        if r["worker"] != "controller":
            role_seen.setdefault(r["worker"], r.get("role", "rollout"))
    serving = _serving(rows)
    means: dict[tuple[str, str], float] = {}
    for w in workers:
        mine = [r for r in steady if r["worker"] == w] or [r for r in rows if r["worker"] == w]
        mine = [r for r in mine if id(r) not in serving]
        for kind in (*PART_KINDS, "sync"):
            # per whole group: a half group's train task (RAT) counts its share
            m = _mean([(r["end"] - r["start"]) / r.get("share", 1.0) for r in mine if r["kind"] == kind])
            if m is not None:
                means[(w, kind)] = m
        means[(w, "overhead")] = _overhead(mine)

    def pick(w: str, kind: str, *, role: str | None = None) -> float:
        """The worker's own mean, else its GPU type's, else everyone's (0 if none)."""
        if (w, kind) in means:
            return means[(w, kind)]
        for same in (
            [x for x in workers if gpu[x] == gpu[w] and (role is None or role_seen[x] == role)],
            workers,
        ):
            vals = [means[(x, kind)] for x in same if (x, kind) in means]
            if vals:
                return sum(vals) / len(vals)
        return 0.0

    if not any(k == "train" for _, k in means):
        raise ConfigError(f"{run}/timeline.jsonl has no train rows: the run trained nothing")
    sim_workers = []
    for w in workers:
        gen = pick(w, "gen")
        cost = WorkerCost(
            gen_s=gen,
            decode_s=pick(w, "decode"),
            reward_s=pick(w, "reward"),
            train_s=pick(w, "train") / per_task,
            train_tsp_s=pick(w, "train") / per_task,
            gen_on_trainer_s=gen,
            load_s=means.get((w, "sync"), 0.0),
            overhead_s=means[(w, "overhead")],
        )
        sim_workers.append(SimWorker(w, gpu[w], gpus[w], cost))
    cost_model = CostModel(
        workers=sim_workers,
        tasks=tasks,
        samples_per_task=group,
        tasks_per_group=1,
        groups_per_task=per_task,
        rows_per_forward=rows_per_forward,
        dataplane=step_seconds(steady if any(r["kind"] == "optim" for r in steady) else rows),
        label=f"calibrated from {run}",
        notes=[
            f"{len(workers)} workers, {tasks} tasks x {group} samples per iteration, {per_task} per train "
            f"task; TSP and non-TSP train times are both the measured one (its passes of up to "
            f"{rows_per_forward} rows)"
        ],
    )
    roles = {
        w: Role(role_seen[w]) if role_seen[w] in {r.value for r in Role} else Role.ROLLOUT for w in workers
    }
    return cost_model, RunInfo(run_mode_of(cfg), roles, iterations)


def measured(run_dir: str | Path, *, warmup: int = 1) -> tuple[float, float]:
    """``(samples/s, bubble ratio)`` of a run over its iterations after ``warmup``, from
    ``metrics.jsonl`` (as ``summary.json`` computes them)."""
    rows = read_jsonl(Path(run_dir) / "metrics.jsonl")
    rows = [r for r in rows if int(r["iteration"]) >= warmup] or rows
    wall = sum(r["wall_s"] for r in rows)
    worker_s = sum(r.get("worker_s", 0.0) for r in rows)
    sps = sum(r["samples"] for r in rows) / wall if wall > 0 else 0.0
    bubble = 1 - sum(r.get("busy_s", 0.0) for r in rows) / worker_s if worker_s > 0 else 0.0
    return sps, bubble


def _simulate_run(cost: CostModel, info: RunInfo, mode: Mode, warmup: int) -> SimResult:
    """``mode`` on the run's workers, measured as the run was: its iterations after
    ``warmup`` up to its end (``trailing = 0``), since :func:`measured` counts the run's last
    iteration too."""
    settings = SimSettings(max(info.iterations, warmup + 2), warmup, neighbours=2, trailing=0)
    roles = info.roles
    if mode.colocated:
        return settings.simulate(cost, mode)
    if not (
        any(r is Role.ROLLOUT for r in roles.values()) and any(r is Role.TRAINER for r in roles.values())
    ):
        return run_mode(cost, mode, settings)[0]  # the run had no split: search one
    return settings.simulate(cost, mode, roles)


def compare_run(run_dir: str | Path, *, warmup: int = 1) -> Comparison:
    """Predicted vs measured samples/s and bubble ratio of a run's own mode and workers."""
    run = Path(run_dir)
    cost, info = _calibrate(run, warmup)
    res = _simulate_run(cost, info, info.mode, warmup)
    sps, bubble = measured(run, warmup=warmup)
    return Comparison(info.mode.name, res.samples_per_s, sps, res.bubble_ratio, bubble)


def predict_modes(run_dir: str | Path, modes: list[str], *, warmup: int = 1) -> list[Comparison]:
    """Predictions for ``modes`` on the run's workers (measured fields are None except for the
    run's own mode). Colocated here is the runtime's (``colocated-digen``) unless asked for
    by name with the peers' overheads, which a calibrated model does not have. The peer modes
    (:mod:`digen.sim.peers`) are left out: they restate a peer's recipe at paper scale, and a
    model measured from a run has none."""
    modes = [m for m in modes if MODES[m].peer is None]
    run = Path(run_dir)
    cost, info = _calibrate(run, warmup)
    sps, bubble = measured(run, warmup=warmup)
    out = []
    for name in modes:
        mode = MODES[name]
        res = _simulate_run(cost, info, mode, warmup)
        own = _same(mode, info.mode)
        out.append(
            Comparison(
                name, res.samples_per_s, sps if own else None, res.bubble_ratio, bubble if own else None
            )
        )
    return out


def _same(a: Mode, b: Mode) -> bool:
    return (a.colocated, a.gap, a.tsp, a.tag, a.max_staleness) == (
        b.colocated,
        b.gap,
        b.tsp,
        b.tag,
        b.max_staleness,
    )
