"""Sequence-parallel efficiency measured instead of cited: ``speedup(d) / d`` per degree.

Two sources give a :class:`SpCalibration`:

- a run directory (:func:`sp_from_run`): every timeline row of a task run by a
  sequence-parallel replica carries ``"sp_degree": d`` and ``"ranks": [names, leader
  first]``. The per-sample seconds of the ``gen`` rows (the denoising loop, the part the
  cost model scales by the efficiency) of d-replicas are set beside those of d=1 workers of
  the same GPU type, from the same run or from a given d=1 ``baseline`` run:
  ``efficiency(d) = t1 / (d * t_d)``;
- the micro-benchmark :func:`digen.sim.sp_bench.run_sp_bench` (``digen sp-bench``), which
  times tiny-Wan generation at d=1 and d over gloo on this machine.

Either is saved as a JSON file (:func:`save_calibration`) that ``digen simulate
--calibration FILE`` loads (:func:`load_calibration` also takes a run directory) and applies
to the simulated model's table (:func:`calibrated_model`); the report then says, per degree,
whether the efficiency is a cited constant or calibrated, and from what.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

from digen.errors import ConfigError
from digen.sim.costmodel import ModelSpec
from digen.sim.files import read_mapping
from digen.sim.rundata import is_follower_row, read_config, read_jsonl

FORMAT = "digen-sp-calibration/1"


@dataclass(frozen=True)
class SpCalibration:
    """Measured sequence-parallel efficiency per degree (degree 1 is the reference)."""

    efficiency: dict[int, float]
    """``speedup(d) / d`` per measured degree d > 1."""
    gen_s_per_sample: dict[int, float]
    """Mean denoising seconds per sample at each degree (1 included)."""
    tasks: dict[int, int]
    """Generation tasks (or timed repeats) behind each mean."""
    source: str
    """What was measured, in words (run directory, or the benchmark's command and machine)."""
    setup: dict = field(default_factory=dict)
    """Free-form details of the measurement (sizes, device, backend)."""

    @property
    def speedup(self) -> dict[int, float]:
        return {d: e * d for d, e in self.efficiency.items()}

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "source": self.source,
            "sp_efficiency": {str(d): e for d, e in sorted(self.efficiency.items())},
            "speedup": {str(d): s for d, s in sorted(self.speedup.items())},
            "gen_s_per_sample": {str(d): t for d, t in sorted(self.gen_s_per_sample.items())},
            "tasks": {str(d): n for d, n in sorted(self.tasks.items())},
            "setup": self.setup,
        }


def efficiency(t1: float, td: float, degree: int) -> float:
    """``speedup / degree`` from per-sample seconds at degree 1 (``t1``) and ``degree`` (``td``)."""
    if not (t1 > 0 and td > 0 and math.isfinite(t1) and math.isfinite(td)):
        raise ConfigError(
            f"per-sample generation seconds must be positive and finite to give an efficiency; got "
            f"{t1} at degree 1 and {td} at degree {degree}"
        )
    return t1 / (degree * td)


# --- from a run directory ----------------------------------------------------------------
def _gen_rows(run: Path, warmup: int) -> tuple[list[dict], int]:
    """The steady ``gen`` rows of a run (iterations after ``warmup`` when later ones exist)
    and the samples of one gen task (``rollout.group_size``)."""
    group = int(read_config(run).get("rollout", {}).get("group_size", 1))
    rows = [r for r in read_jsonl(run / "timeline.jsonl") if r.get("kind") == "gen"]
    steady = [r for r in rows if int(r["iteration"]) >= warmup]
    return (steady or rows), group


def _degree(row: dict) -> int:
    d = int(row.get("sp_degree", 1))
    ranks = row.get("ranks")
    if d < 1 or (ranks is not None and len(ranks) != d):
        raise ConfigError(
            f"timeline row of worker {row.get('worker')}: sp_degree ({row.get('sp_degree')}) must be at least "
            f"1 and match its ranks ({ranks})"
        )
    return d


def _per_sample(rows: list[dict], group: int) -> dict[tuple[int, str], list[float]]:
    """Per-sample gen seconds by (degree, GPU type), one row per task."""
    out: dict[tuple[int, str], list[float]] = defaultdict(list)
    for r in rows:
        if is_follower_row(r):
            continue
        out[(_degree(r), str(r.get("gpu_type", "?")))].append((r["end"] - r["start"]) / group)
    return out


def sp_from_run(run_dir: str | Path, *, baseline: str | Path | None = None, warmup: int = 1) -> SpCalibration:
    """Efficiency per degree from ``run_dir``'s sequence-parallel ``gen`` rows against d=1 rows
    of the same GPU type (this run's, else ``baseline``'s). Several GPU types: each type's
    efficiency weighted by its d-replica task count."""
    run = Path(run_dir)
    rows, group = _gen_rows(run, warmup)
    times = _per_sample(rows, group)
    if baseline is not None:
        base_rows, base_group = _gen_rows(Path(baseline), warmup)
        for (d, gpu), ts in _per_sample(base_rows, base_group).items():
            if d == 1 and (1, gpu) not in times:
                times[(1, gpu)] = ts
    degrees = sorted({d for d, _ in times if d > 1})
    if not degrees:
        raise ConfigError(
            f"{run}/timeline.jsonl has no sequence-parallel gen rows (rows with sp_degree > 1): the run "
            f"had no replica of several workers"
        )
    eff: dict[int, float] = {}
    per_s: dict[int, float] = {}
    tasks: dict[int, int] = {}
    for d in degrees:
        weighted, mine = 0.0, []
        for gpu in sorted({g for dd, g in times if dd == d}):
            ones = times.get((1, gpu))
            if not ones:
                where = f"{run}" + (f" or {baseline}" if baseline is not None else "")
                raise ConfigError(
                    f"no d=1 gen rows of GPU type {gpu} in {where} to compare the sp_degree {d} replicas "
                    f"with: pass a d=1 baseline run on the same GPU type"
                )
            ts = times[(d, gpu)]
            weighted += len(ts) * efficiency(_mean(ones), _mean(ts), d)
            mine += ts
        eff[d], per_s[d], tasks[d] = weighted / len(mine), _mean(mine), len(mine)
    base = [t for gpu in sorted({g for d, g in times if d > 1}) for t in times[(1, gpu)]]
    per_s[1], tasks[1] = _mean(base), len(base)
    source = f"run {run}" + (f" against d=1 run {baseline}" if baseline is not None else "")
    return SpCalibration(eff, per_s, tasks, source, {"group_size": group, "warmup": warmup})


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


# --- files ---------------------------------------------------------------------------------
def save_calibration(cal: SpCalibration, path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(cal.to_json(), indent=1) + "\n")
    return p


def _degree_key(path: Path, key: str) -> int:
    try:
        d = int(key)
    except ValueError:
        raise ConfigError(f"{path}: sp_efficiency key ({key!r}) must be an integer degree") from None
    if d < 2:
        raise ConfigError(
            f"{path}: sp_efficiency degree ({d}) must be at least 2 (degree 1 is 1 by definition)"
        )
    return d


def load_calibration(path: str | Path) -> SpCalibration:
    """A calibration JSON file (:func:`save_calibration`), or a run directory (:func:`sp_from_run`)."""
    p = Path(path)
    if p.is_dir():
        return sp_from_run(p)
    data = read_mapping(p, "pass a calibration file written by digen sp-bench or a run directory")
    if data.get("format") != FORMAT:
        raise ConfigError(f"{p}: format must be {FORMAT!r} (a file written by digen sp-bench)")
    raw = data.get("sp_efficiency")
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{p}: sp_efficiency must map degrees to efficiencies")
    eff = {}
    for k, v in raw.items():
        d = _degree_key(p, k)
        if not isinstance(v, int | float) or not (0 < v < math.inf):
            raise ConfigError(f"{p}: sp_efficiency[{k}] ({v}) must be a positive finite number")
        eff[d] = float(v)
    return SpCalibration(
        efficiency=eff,
        gen_s_per_sample={int(k): float(v) for k, v in (data.get("gen_s_per_sample") or {}).items()},
        tasks={int(k): int(v) for k, v in (data.get("tasks") or {}).items()},
        source=str(data.get("source") or p),
        setup=dict(data.get("setup") or {}),
    )


def calibrated_model(model: ModelSpec, cal: SpCalibration, where: str) -> ModelSpec:
    """``model`` with its efficiency table's measured degrees replaced by ``cal``'s (the other
    degrees stay cited); ``where`` names the calibration in the report."""
    return replace(
        model,
        sp_efficiency={**model.sp_efficiency, **cal.efficiency},
        sp_calibrated={**model.sp_calibrated, **dict.fromkeys(cal.efficiency, where)},
    )
