"""Simulation configs (``configs/sim/*.yaml``): a run names a workload and a testbed from a
shared catalog (``configs/sim/catalog.yaml``: GPU types, models, workloads, testbeds, every
constant cited there).

    # configs/sim/qwen-image_A.yaml
    catalog: catalog.yaml
    workload: flow-grpo-qwen-image
    testbed: A
    sim: {iterations: 8, warmup: 3, trailing: 1, neighbours: 2}

Loading reports every problem at once as a :class:`~digen.errors.ConfigError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from digen.errors import ConfigError
from digen.sim.costmodel import CostModel, GpuType, ModelSpec, Testbed, Workload, paper_costmodel
from digen.sim.dataplane import DataPlaneModel
from digen.sim.files import read_mapping
from digen.sim.sp_calibration import calibrated_model, load_calibration
from digen.sim.study import SimSettings

CITED_LATENT_NUMEL = {
    "qwen-image": 1_024 * 64,
    "flux": 1_024 * 64,
    "hunyuan-video": 12_600 * 64,
    "wan2.1-14b": 14_040 * 64,
}
"""One sample's latent elements of the catalog's models that give no ``latent_numel``: the
tokens of cost-model.md l.12-15 (as ``tflop_per_step`` cites them) x 64 (16 latent channels x
a 2x2 patch; a video's 1x2x2). The trajectory transfer's size."""
RUN_CONFIG = "pass a simulation config (configs/sim/*.yaml: a workload and a testbed of a catalog)"
CATALOG = "name a catalog in the config's catalog: key (a path relative to the config)"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GpuEntry(_Section):
    tflops: float = Field(gt=0)
    memory_gb: float = Field(gt=0)
    host_gbps: float = Field(gt=0)
    intra_gbps: float = Field(gt=0)
    mem_gbps: float | None = Field(None, gt=0)


class ModelEntry(_Section):
    tflop_per_step: float = Field(gt=0)
    cfg: int = Field(ge=1, le=2)
    weights_gb: float = Field(gt=0)
    adapter_gb: float | None = Field(None, gt=0)
    layers: int = Field(ge=1)
    activation_gb: float = Field(ge=0)
    train_flops_factor: float = Field(3.0, ge=1)
    decode_s_ref: float = Field(ge=0)
    reward_tflop: float = Field(0.0, ge=0)
    sp_efficiency: dict[int, float] = {}
    train_cfg: int | None = Field(None, ge=1, le=2)
    latent_numel: int | None = Field(None, ge=1)


class WorkloadEntry(_Section):
    model: str
    steps: int = Field(ge=1)
    timestep_fraction: float = Field(gt=0, le=1)
    prompts: int = Field(32, ge=1)
    group_size: int = Field(16, ge=1)
    samples_per_task: int = Field(1, ge=1)


class TestbedEntry(_Section):
    net_gbps: float = Field(gt=0)
    gpus: dict[str, int]


class Catalog(_Section):
    gpus: dict[str, GpuEntry]
    models: dict[str, ModelEntry]
    workloads: dict[str, WorkloadEntry]
    testbeds: dict[str, TestbedEntry]


class SimSection(_Section):
    """:class:`~digen.sim.study.SimSettings` (its defaults)."""

    iterations: int = Field(SimSettings.iterations, ge=2)
    warmup: int = Field(SimSettings.warmup, ge=0)
    neighbours: int = Field(SimSettings.neighbours, ge=0)
    trailing: int = Field(SimSettings.trailing, ge=0)


class SimRunConfig(_Section):
    catalog: str = "catalog.yaml"
    workload: str
    testbed: str
    prompts: int | None = Field(None, ge=1)
    """Override the workload's prompt groups per iteration (large clusters)."""
    samples_per_task: int | None = Field(None, ge=1)
    tsp_batch_gain: float = Field(1.0, ge=1.0)
    """Compute speedup of batching K timesteps in one forward (1.0: compute bound already,
    cost-model.md l.49-50)."""
    sim: SimSection = SimSection.model_validate({})


@dataclass(frozen=True)
class SimSetup:
    """A loaded simulation config: what to simulate and how."""

    name: str
    workload: Workload
    testbed: Testbed
    settings: SimSettings
    cost: CostModel


def _validate(model: type[BaseModel], data: dict, where: Path) -> BaseModel:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = [f"{where.name}: {'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()]
        raise ConfigError(problems) from None


def load_catalog(path: Path) -> Catalog:
    cat = _validate(Catalog, read_mapping(path, CATALOG), path)
    assert isinstance(cat, Catalog)
    problems = [
        f"{path.name}: workloads.{n}.model ({w.model}) is not in models"
        for n, w in cat.workloads.items()
        if w.model not in cat.models
    ]
    problems += [
        f"{path.name}: testbeds.{n}.gpus.{g} is not in gpus"
        for n, t in cat.testbeds.items()
        for g in t.gpus
        if g not in cat.gpus
    ]
    if problems:
        raise ConfigError(problems)
    return cat


def is_run_config(path: Path) -> bool:
    """True for a run config (names a workload), False for the catalog."""
    data = read_mapping(path, RUN_CONFIG)
    return "workload" in data and "testbed" in data


def load_sim_config(
    path: str | Path,
    *,
    testbed: str | None = None,
    calibration: str | Path | None = None,
    dataplane: DataPlaneModel | None = None,
) -> SimSetup:
    """Read a run config and its catalog; build the paper-scale cost model. ``calibration``:
    a sequence-parallel calibration file or run directory whose measured efficiencies replace
    the catalog's cited ones (:mod:`digen.sim.sp_calibration`); ``dataplane``: the data
    plane's calibration (default :class:`DataPlaneModel`'s, :mod:`digen.sim.dataplane`)."""
    p = Path(path)
    run = _validate(SimRunConfig, read_mapping(p, RUN_CONFIG), p)
    assert isinstance(run, SimRunConfig)
    cat = load_catalog((p.parent / run.catalog).resolve())
    tb_name = testbed or run.testbed
    problems = []
    if run.workload not in cat.workloads:
        problems.append(f"{p.name}: workload ({run.workload}) must be one of {', '.join(cat.workloads)}")
    if tb_name not in cat.testbeds:
        problems.append(f"{p.name}: testbed ({tb_name}) must be one of {', '.join(cat.testbeds)}")
    if run.sim.warmup + run.sim.trailing >= run.sim.iterations:
        problems.append(
            f"{p.name}: sim.warmup ({run.sim.warmup}) + sim.trailing ({run.sim.trailing}) must be below "
            f"sim.iterations ({run.sim.iterations}): at least one iteration is measured"
        )
    if problems:
        raise ConfigError(problems)
    wl = cat.workloads[run.workload]
    m = cat.models[wl.model]
    spt = run.samples_per_task or wl.samples_per_task
    if wl.group_size % spt:
        raise ConfigError(
            f"{p.name}: samples_per_task ({spt}) must divide the group size ({wl.group_size}) of "
            f"workload {run.workload}"
        )
    numel = m.latent_numel or CITED_LATENT_NUMEL.get(wl.model)
    if numel is None:
        raise ConfigError(
            f"{run.catalog}: models.{wl.model}.latent_numel is missing: the elements of one sample's latent "
            f"(channels x latent frames x height x width), the size of the trajectories a trainer fetches"
        )
    model = ModelSpec(name=wl.model, **(m.model_dump() | {"latent_numel": numel}))
    if calibration is not None:
        cal = load_calibration(calibration)
        model = calibrated_model(model, cal, f"{calibration}: {cal.source}")
    workload = Workload(
        run.workload, model, wl.steps, wl.timestep_fraction, run.prompts or wl.prompts, wl.group_size, spt
    )
    tbe = cat.testbeds[tb_name]
    tb = Testbed(
        tb_name, tbe.net_gbps, tuple((GpuType(g, **cat.gpus[g].model_dump()), n) for g, n in tbe.gpus.items())
    )
    cost = paper_costmodel(workload, tb, tsp_batch_gain=run.tsp_batch_gain, dataplane=dataplane)
    settings = SimSettings(**run.sim.model_dump())
    return SimSetup(f"{run.workload} @ {tb_name}", workload, tb, settings, cost)
