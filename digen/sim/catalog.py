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
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from digen.config import Dtype
from digen.errors import ConfigError
from digen.sim.costmodel import (
    FLAT,
    NO_BATCH_GAIN,
    ROWS_PER_FORWARD,
    BatchGain,
    CostModel,
    EfficiencyCurve,
    GpuType,
    ModelSpec,
    PaperInputs,
    Testbed,
    Workload,
    paper_costmodel,
)
from digen.sim.dataplane import DataPlaneModel
from digen.sim.files import read_mapping
from digen.sim.peers import PeerRecipe
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


class LoraEntry(_Section):
    """A LoRA recipe counted on the architecture: each adapted ``in x out`` linear adds
    ``rank x (in + out)`` parameters; ``dims_per_block`` is the sum of ``in + out`` over one
    block's adapted linears (the recipe's target modules)."""

    rank: int = Field(ge=1)
    dims_per_block: int = Field(ge=1)


class ModelEntry(_Section):
    tflop_per_step: float = Field(gt=0)
    cfg: int = Field(ge=1, le=2)
    weights_gb: float = Field(gt=0)
    adapter_gb: float | None = Field(None, gt=0)
    lora: LoraEntry | None = None
    """The adapter's size from the architecture (overrides ``adapter_gb``)."""
    text_encoder_gb: float = Field(0.0, ge=0)
    vae_gb: float = Field(0.0, ge=0)
    dtype: Dtype = "bfloat16"
    """The transformer's weights (the sizes above stay bf16 counts): a full fine-tune's version."""
    lora_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The adapter's weights (``model.lora.dtype``): an adapter's version."""
    layers: int = Field(ge=1)
    activation_gb: float = Field(ge=0)
    train_flops_factor: float = Field(3.0, ge=1)
    decode_s_ref: float = Field(ge=0)
    reward_tflop: float = Field(0.0, ge=0)
    reward: str | None = None
    """A key of the catalog's ``rewards`` (overrides ``reward_tflop``)."""
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
    reward: str | None = None
    """A key of the catalog's ``rewards`` (overrides the model's)."""
    kl_beta: float = Field(0.0, ge=0.0)
    """digen's ``train.kl_beta``: > 0 adds a reference forward per trained row."""


class RewardEntry(_Section):
    """A reward model's cost per sample: measured GPU-seconds on a catalog GPU, or TFLOP."""

    gpu_s_per_sample: float | None = Field(None, gt=0)
    measured_on: str | None = None
    tflop_per_sample: float | None = Field(None, ge=0)
    weights_gb: float = Field(0.0, ge=0)


class BatchGainEntry(_Section):
    """:class:`~digen.sim.costmodel.BatchGain`: per-sample speedup at each measured batch."""

    points: dict[int, float]
    max_tokens: int = Field(4096, ge=1)


class CurveEntry(_Section):
    half_tokens: float = Field(gt=0)
    ref_tokens: float = Field(gt=0)
    cap: float = Field(1.0, gt=0)


class PeerOverride(_Section):
    """A peer's own recipe for one model, where it differs from the peer's defaults."""

    gen_batch: int | None = Field(None, ge=1)
    train_micro_batch: int | None = Field(None, ge=1)
    reference_forward: bool | None = None
    fsdp: bool | None = None
    logprob_batch: int | None = Field(None, ge=1)
    optimizer_steps: int | None = Field(None, ge=1)


class PeerEntry(_Section):
    """:class:`digen.sim.peers.PeerRecipe`'s fields, the models the peer has a pipeline for and
    its own recipe per model (``per_model``)."""

    commit: str
    models: list[str]
    per_model: dict[str, PeerOverride] = {}
    engine: str
    gen_batch: int = Field(ge=1)
    gen_on_trainer: bool
    fsdp: bool
    logprob_batch: int | None = Field(None, ge=1)
    reference_forward: bool
    train_micro_batch: int = Field(ge=1)
    optimizer_steps: int = Field(ge=1)
    rollout_sleep_wake: bool
    actor_offload: bool
    reward_wake: bool
    reward_tp: int = Field(1, ge=1)
    weight_sync: bool = False
    driver_gbps: float | None = Field(None, gt=0)
    async_sync: Literal["abort", "drain"] | None = None
    async_staleness: int = Field(1, ge=0, le=1)


class TestbedEntry(_Section):
    net_gbps: float = Field(gt=0)
    gpus: dict[str, int]


class Catalog(_Section):
    gpus: dict[str, GpuEntry]
    models: dict[str, ModelEntry]
    workloads: dict[str, WorkloadEntry]
    testbeds: dict[str, TestbedEntry]
    rewards: dict[str, RewardEntry] = {}
    engines: dict[str, float] = {"eager": 1.0}
    """Rollout engine speedup over eager PyTorch."""
    efficiency_curve: CurveEntry | None = None
    generation_batch: BatchGainEntry | None = None
    peers: dict[str, PeerEntry] = {}


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
    groups_per_task: int = Field(1, ge=1)
    """Simulated tasks (micro-batches of ``samples_per_task``) one train task carries, as
    ``train.groups_per_task`` does: their rows share passes, so an FSDP trainer gathers once
    per pass of the batch."""
    rows_per_forward: int = Field(ROWS_PER_FORWARD, ge=1)
    """Rows of one TSP training pass at most, as ``train.rows_per_forward`` (its default):
    a train task of more rows makes ``ceil(rows / rows_per_forward)`` passes."""
    max_batch: int = Field(1, ge=1)
    """Generation tasks a rollout worker runs as one forward per denoising step, as
    ``rollout.max_batch``. Default 1, one task per forward, where the runtime's is 4: the
    shipped tables are of unbatched digen, and ``--optimize`` searches the batch."""
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
    named = [(f"models.{n}", m.reward) for n, m in cat.models.items()]
    named += [(f"workloads.{n}", w.reward) for n, w in cat.workloads.items()]
    problems += [
        f"{path.name}: {where}.reward ({r}) is not in rewards"
        for where, r in named
        if r and r not in cat.rewards
    ]
    problems += [
        f"{path.name}: rewards.{n}: give gpu_s_per_sample with measured_on (a GPU of gpus), or tflop_per_sample"
        for n, r in cat.rewards.items()
        if (r.gpu_s_per_sample is None or r.measured_on not in cat.gpus) and r.tflop_per_sample is None
    ]
    problems += [
        f"{path.name}: peers.{n}.engine ({p.engine}) is not in engines"
        for n, p in cat.peers.items()
        if p.engine not in cat.engines
    ]
    problems += [
        f"{path.name}: peers.{n}.{key}.{m} is not in models"
        for n, p in cat.peers.items()
        for key, names in (("models", p.models), ("per_model", list(p.per_model)))
        for m in names
        if m not in cat.models
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


def lora_gb(lora: LoraEntry, blocks: int) -> float:
    """bf16 GB of a LoRA adapter (the catalog's unit of size): ``rank x dims_per_block``
    parameters per block, 2 B each (what ``digen bench --dataplane`` counts in float32:
    :data:`digen.bench.dataplane.SIZES`). What its version moves is the model's
    ``lora_dtype``'s (:attr:`~digen.sim.costmodel.ModelSpec.version_bytes_per_param`)."""
    return lora.rank * lora.dims_per_block * blocks * 2 / 1e9


def reward_cost(cat: Catalog, name: str) -> tuple[float, float]:
    """``(TFLOP-equivalent per sample, weights GB)`` of reward ``name``: a measured
    ``gpu_s_per_sample`` on GPU ``measured_on`` is that GPU's achieved TFLOPS x the seconds,
    so it scales with the GPU as the model's other work does."""
    r = cat.rewards[name]
    if r.gpu_s_per_sample is not None and r.measured_on in cat.gpus:
        return r.gpu_s_per_sample * cat.gpus[r.measured_on].tflops, r.weights_gb
    return r.tflop_per_sample or 0.0, r.weights_gb


def peer_recipe(name: str, entry: PeerEntry, model: str) -> PeerRecipe:
    """Peer ``name``'s recipe for ``model``: its defaults with its own recipe for the model."""
    fields = entry.model_dump(exclude={"models", "per_model"})
    if model in entry.per_model:
        fields |= entry.per_model[model].model_dump(exclude_none=True)
    return PeerRecipe(name=name, **fields)


def parse_gpus(spec: str, cat: Catalog, where: Path) -> dict[str, int]:
    """``64xh100`` or ``32xl20,16xh20`` -> GPU type -> count (types of the catalog)."""
    out: dict[str, int] = {}
    for part in (x.strip() for x in spec.split(",") if x.strip()):
        count, sep, name = part.partition("x")
        if not sep or not count.isdigit() or int(count) < 1 or name not in cat.gpus:
            raise ConfigError(
                f"--gpus {spec}: '{part}' must be COUNTxTYPE with TYPE one of {', '.join(cat.gpus)} "
                f"({where.name}'s catalog), e.g. 64xh100"
            )
        out[name] = out.get(name, 0) + int(count)
    return out


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
    gpus: str | None = None,
) -> SimSetup:
    """Read a run config and its catalog; build the paper-scale cost model. ``calibration``:
    a sequence-parallel calibration file or run directory whose measured efficiencies replace
    the catalog's cited ones (:mod:`digen.sim.sp_calibration`); ``dataplane``: the data
    plane's calibration (default :class:`DataPlaneModel`'s, :mod:`digen.sim.dataplane`);
    ``gpus``: another cluster of the catalog's GPU types (``64xh100`` or ``32xl20,16xh20``),
    with the testbed's network."""
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
    reward_name = wl.reward or m.reward
    reward_tflop, reward_gb = m.reward_tflop, 0.0
    if reward_name:
        reward_tflop, reward_gb = reward_cost(cat, reward_name)
    fields = m.model_dump(exclude={"lora", "reward"}) | {"latent_numel": numel, "reward_tflop": reward_tflop}
    if m.lora is not None:
        fields["adapter_gb"] = lora_gb(m.lora, m.layers)
    model = ModelSpec(name=wl.model, **fields)
    if calibration is not None:
        cal = load_calibration(calibration)
        model = calibrated_model(model, cal, f"{calibration}: {cal.source}")
    workload = Workload(
        run.workload,
        model,
        wl.steps,
        wl.timestep_fraction,
        run.prompts or wl.prompts,
        wl.group_size,
        spt,
        run.groups_per_task,
        run.rows_per_forward,
        max_batch=run.max_batch,
        kl_beta=wl.kl_beta,
    )
    tbe = cat.testbeds[tb_name]
    counts = parse_gpus(gpus, cat, p) if gpus else tbe.gpus
    tb = Testbed(
        gpus or tb_name,
        tbe.net_gbps,
        tuple((GpuType(g, **cat.gpus[g].model_dump()), n) for g, n in counts.items()),
    )
    paper = PaperInputs(
        workload,
        tb,
        curve=EfficiencyCurve(**cat.efficiency_curve.model_dump()) if cat.efficiency_curve else FLAT,
        batch_gain=(
            BatchGain(tuple(sorted(cat.generation_batch.points.items())), cat.generation_batch.max_tokens)
            if cat.generation_batch
            else NO_BATCH_GAIN
        ),
        engines=dict(cat.engines),
        reward_weights_gb=reward_gb,
        peers={
            n: peer_recipe(n, p, wl.model)
            for n, p in cat.peers.items()
            if wl.model in p.models and not (p.async_sync and len(tb.gpus) > 1)
        },
        not_modelled={
            n: f"{n}: an asynchronous peer is modelled on one GPU type only"
            for n, p in cat.peers.items()
            if wl.model in p.models and p.async_sync and len(tb.gpus) > 1
        },
        no_pipeline={
            n: f"{n} ({p.commit}) has no {wl.model} pipeline"
            for n, p in cat.peers.items()
            if wl.model not in p.models
        },
    )
    cost = paper_costmodel(workload, tb, tsp_batch_gain=run.tsp_batch_gain, dataplane=dataplane, paper=paper)
    settings = SimSettings(**run.sim.model_dump())
    return SimSetup(f"{run.workload} @ {tb_name}", workload, tb, settings, cost)
