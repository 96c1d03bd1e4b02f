"""The simulator's cost model: seconds of every task part on every simulated worker.

The driver (:mod:`digen.sim.driver`) only reads a :class:`CostModel`: a list of
:class:`SimWorker` (name, GPU type, GPUs per worker, a :class:`WorkerCost` table) and the
iteration's shape (tasks, samples per task) and its data plane (the step's all-reduce and
AdamW, weight distribution to rollout workers, trajectory transfer to trainers), whose seconds
depend on the rollout/trainer split. Two builders fill it:

- :func:`paper_costmodel` derives every number from hardware and model figures
  (``configs/sim/catalog.yaml``, each constant cited to ``reference/cost-model.md``):
  ``seconds = FLOPs / achieved TFLOPS`` per denoising step (x CFG passes), training
  ``train_flops_factor`` x forward per trained timestep, VAE decode and reward per sample,
  FSDP weight gathers, sequence-parallel efficiency, offload/reload over PCIe, and the data
  plane (gradient all-reduce, optimizer step, weight distribution, trajectory transfer:
  :mod:`digen.sim.dataplane`, calibrated by ``digen bench --dataplane``);
- :func:`digen.sim.calibrate.costmodel_from_run` measures them from a real run's timeline.

Task unit. A task is one micro-batch of ``samples_per_task`` samples of one prompt group
(``tasks_per_group = group_size / samples_per_task`` siblings). The Scheduler sees each
micro-batch as a "group", and a train task carries ``groups_per_task`` of them as the runtime's
``train.groups_per_task`` does; the driver keeps a sibling's training out of the queue until every
micro-batch of its prompt group is scored, so advantages use whole-group statistics (exact
GRPO). A worker is a replica of ``gpus`` GPUs: one GPU, or a sequence-parallel group when
one sample does not fit in one GPU's memory.

Training passes, the runtime's rule (:func:`digen.training.forward_chunks`): a train task's
rows, ``groups x samples_per_task x K`` (sample, trained timestep) pairs, are cut into passes
as a trainer cuts them (:class:`TrainPasses`). With TSP: passes of ``rows_per_forward`` rows
(``train.rows_per_forward``, 64 by default), the last taking the rest, so
``ceil(rows / rows_per_forward)`` of them; without TSP one pass per trained timestep holding
that step's rows of every micro-batch (the runtime does not cut these). Each pass computes at
the :func:`pass_efficiency` of its own tokens and, with FSDP, gathers the sharded weights for
its forward and its backward (:func:`_pass_s`); :meth:`WorkerCost.train_task_s` sums them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from digen.config import DTYPE_BYTES, Dtype, TrainConfig, trained_dtype_name
from digen.errors import ConfigError
from digen.sim.dataplane import CATALOG_BYTES, GB, GRAD_BYTES, DataPlane, DataPlaneModel, DataPlaneSeconds

# Reference GPU for the measured VAE-decode figures (RTX 4090, cost-model.md l.28-29):
# 165 TFLOPS peak (l.40) x 0.31 eager MFU (l.4; l.18 gives 74*28/6.71/989 = 0.312).
REFERENCE_TFLOPS = 165.0 * 0.31
USABLE_MEMORY = 0.9
"""Fraction of a GPU's memory usable by the model (CUDA context, allocator fragmentation)."""
SP_DEGREES = (1, 2, 4, 8)
ROWS_PER_FORWARD: int = TrainConfig.model_fields["rows_per_forward"].default
"""The runtime's default ``train.rows_per_forward``: rows of one training pass with TSP."""


@dataclass(frozen=True)
class GpuType:
    name: str
    tflops: float
    """Achieved dense bf16 TFLOPS of a DiT forward in eager PyTorch (peak x MFU)."""
    memory_gb: float
    host_gbps: float
    """GPU <-> host bandwidth (PCIe), GB/s: offload and reload."""
    intra_gbps: float
    """GPU <-> GPU bandwidth inside a node, GB/s: FSDP all-gathers."""
    mem_gbps: float | None = None
    """Achieved GPU memory bandwidth, GB/s: the optimizer step (None: the data plane model's
    assumption, :attr:`digen.sim.dataplane.DataPlaneModel.gpu_mem_gbps`)."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    tflop_per_step: float
    """Forward TFLOP of one denoising step of one sample, one pass."""
    cfg: int
    """Passes per step: 2 for true CFG, 1 for embedded guidance."""
    weights_gb: float
    """bf16 transformer weights."""
    adapter_gb: float | None
    """bf16 LoRA adapter size (what is trained, synced and loaded); None = full fine-tune."""
    layers: int
    """Transformer blocks (FSDP gathers layer by layer: one layer's gather is exposed)."""
    activation_gb: float
    """Peak activation memory of generating one sample on one GPU."""
    train_flops_factor: float
    """Forward+backward FLOPs / forward FLOPs of a training pass."""
    decode_s_ref: float
    """VAE decode seconds of one sample on the reference GPU (:data:`REFERENCE_TFLOPS`)."""
    reward_tflop: float
    """Reward model TFLOP per sample."""
    latent_numel: int
    """Elements of one sample's latent (channels x latent frames x height x width): the
    trajectory a trainer fetches holds ``steps + 1`` of them per sample, in float32."""
    sp_efficiency: dict[int, float] = field(default_factory=lambda: {1: 1.0})
    """Sequence-parallel efficiency per degree: speedup(d) / d."""
    train_cfg: int | None = None
    """Passes per trained timestep (None: as ``cfg``; the log-prob of a guided step needs
    both branches)."""
    sp_calibrated: dict[int, str] = field(default_factory=dict)
    """Degrees of ``sp_efficiency`` measured rather than cited, and where (a calibration file
    or run directory, :mod:`digen.sim.sp_calibration`)."""
    text_encoder_gb: float = 0.0
    """bf16 text encoder(s): resident while prompts are encoded, offloaded while the
    transformer runs (the fit check takes the larger of the two)."""
    vae_gb: float = 0.0
    """The VAE, resident with the transformer (it decodes every sample)."""
    dtype: Dtype = "bfloat16"
    """The transformer's weights (``model.dtype``): bfloat16, as the catalog sizes and its
    TFLOPS are; what a full fine-tune's version travels in."""
    lora_dtype: Dtype = "float32"
    """The adapter's weights (``model.lora.dtype``, float32 by default): what an adapter's
    version travels in."""

    @property
    def trained_params(self) -> float:
        """Parameters trained: the adapter's, or the transformer's for a full fine-tune (the
        catalog's bf16 sizes / 2 B)."""
        gb = self.adapter_gb if self.adapter_gb is not None else self.weights_gb
        return gb * GB / CATALOG_BYTES

    @property
    def version_bytes_per_param(self) -> int:
        """Bytes per trained parameter of a version as the trainers serve it, by the runtime's
        rule (:func:`digen.config.trained_dtype_name`): 4 for a float32 adapter, 2 for a
        bfloat16 full fine-tune."""
        return DTYPE_BYTES[trained_dtype_name(self.dtype, self.adapter_gb is not None, self.lora_dtype)]

    @property
    def version_gb(self) -> float:
        """One version's GB as it travels and loads (:attr:`version_bytes_per_param`)."""
        return self.trained_params * self.version_bytes_per_param / GB

    @property
    def tokens(self) -> int:
        """Latent tokens of one sample (``latent_numel`` / 64: 16 channels x a 2x2 patch)."""
        return max(1, self.latent_numel // 64)

    def sp_eff_source(self, degree: int) -> str:
        """Where :meth:`sp_eff` ``(degree)`` comes from, in words."""
        if degree == 1:
            return "1 by definition"
        if degree in self.sp_calibrated:
            return f"calibrated from {self.sp_calibrated[degree]}"
        if degree in self.sp_efficiency:
            return "cited constant (catalog)"
        listed = sorted({1, *self.sp_efficiency})
        return f"interpolated between the listed degrees {listed}"

    def sp_eff(self, degree: int) -> float:
        """Efficiency at ``degree`` (log-linear interpolation between listed degrees)."""
        table = dict(sorted({1: 1.0, **self.sp_efficiency}.items()))
        if degree in table:
            return table[degree]
        lo = max(d for d in table if d < degree)
        hi = min((d for d in table if d > degree), default=None)
        if hi is None:
            return table[lo] * lo / degree  # no data: no further speedup beyond the last degree
        w = (math.log(degree) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return table[lo] + w * (table[hi] - table[lo])


@dataclass(frozen=True)
class Workload:
    name: str
    model: ModelSpec
    steps: int
    timestep_fraction: float
    prompts: int
    """Prompt groups per iteration (one optimizer step)."""
    group_size: int
    samples_per_task: int
    groups_per_task: int = 1
    """Micro-batches per train task (``train.groups_per_task``)."""
    rows_per_forward: int = ROWS_PER_FORWARD
    """Rows of one TSP training pass at most (``train.rows_per_forward``)."""
    max_batch: int = 1
    """Generation tasks a rollout worker runs as one forward per step (``rollout.max_batch``)."""
    kl_beta: float = 0.0
    """``train.kl_beta``: > 0 adds a reference forward (the base weights) to every trained row."""

    def __post_init__(self) -> None:
        if self.rows_per_forward < 1:
            raise ConfigError(f"rows_per_forward ({self.rows_per_forward}) must be >= 1")

    @property
    def trained_timesteps(self) -> int:
        """K: the trained steps per trajectory as the workload's paper states them
        (``steps * fraction``, the count of Flow-GRPO's prefix selection; DanceGRPO's random
        selection trains ``int((steps - 1) * fraction)``, see
        :func:`digen.algos.timesteps.select_timesteps`). The small slack keeps a product
        such as 20 * 0.6 from rounding down in float."""
        return max(1, math.floor(self.steps * self.timestep_fraction + 1e-6))

    @property
    def samples(self) -> int:
        return self.prompts * self.group_size

    @property
    def tasks_per_group(self) -> int:
        return self.group_size // self.samples_per_task

    @property
    def tasks(self) -> int:
        return self.prompts * self.tasks_per_group

    @property
    def trajectory_bytes(self) -> float:
        """What a train task fetches from the worker that generated its samples: per sample
        the ``steps + 1`` float32 latents Flow-GRPO stores and ``steps`` log-probs (the
        images stay; sigmas and rewards are a few bytes)."""
        per_sample = (self.steps + 1) * self.model.latent_numel + self.steps
        return 4.0 * self.samples_per_task * per_sample


@dataclass(frozen=True)
class Testbed:
    name: str
    net_gbps: float
    """Inter-node bandwidth, GB/s: weight broadcast and gradient all-reduce."""
    gpus: tuple[tuple[GpuType, int], ...]

    @property
    def gpu_count(self) -> int:
        return sum(n for _, n in self.gpus)


@dataclass(frozen=True)
class WorkerCost:
    """Seconds of the parts of one task (one micro-batch) on one worker."""

    gen_s: float
    """Denoising loop on a rollout (full weights resident)."""
    decode_s: float
    reward_s: float
    train_s: float
    """K trained timesteps, one forward/backward each (no TSP)."""
    train_tsp_s: float
    """K timesteps packed in batched forward/backwards (TSP): one pass, one weight gather,
    while the K x ``samples_per_task`` rows fit in ``rows_per_forward``."""
    gen_on_trainer_s: float
    """Denoising loop on a trainer (TAG): slower when its weights are FSDP-sharded."""
    recompute_s: float = 0.0
    """Old-log-prob forward over the K timesteps (colocated peers that do not reuse the
    rollout's log-probs)."""
    phase_switch_s: float = 0.0
    """Colocated peers: offload one engine and reload the other (one transition)."""
    context_switch_s: float = 0.0
    """A disaggregated worker switching between generation and training (TAG)."""
    load_s: float = 0.0
    """Load a newly published weights version (adapter or full weights) into the worker."""
    overhead_s: float = 0.0
    """Per-task time outside its parts: lease, data transfer, acknowledgement (idle time)."""
    train_gather_s: float = 0.0
    """FSDP: the collectives of one training pass (the weights' all-gathers for the forward and
    the backward, the gradient's reduce-scatter: :func:`fsdp_pass_comm_s`; 0 without FSDP)."""
    layers: int = 1
    """Transformer blocks (the one gather per pass that cannot overlap is a block's)."""
    passes: TrainPasses | None = None
    """How a train task's rows make passes (None: a measured model, which has no breakdown)."""
    gen_batch_gain: BatchGain | None = None
    """Generation's batch gain (None: a measured model: batching tasks gains nothing known)."""
    tokens: int = 0
    """Latent tokens of one sample (where the batch gain applies)."""

    def gen_batch_s(self, tasks: int, samples_per_task: int) -> float:
        """Denoising seconds of ``tasks`` generation tasks run as one forward per step
        (``rollout.max_batch``): their samples at the batch gain of all of them."""
        if tasks <= 1 or self.gen_batch_gain is None:
            return tasks * self.gen_s
        gain = self.gen_batch_gain
        m = samples_per_task
        return tasks * self.gen_s * gain(m, self.tokens) / gain(tasks * m, self.tokens)

    def train_task_s(self, groups: int, tsp: bool) -> float:
        """Seconds of a train task of ``groups`` micro-batches (``train.groups_per_task``):
        its rows cut into passes as the runtime cuts them (:meth:`TrainPasses.sizes`), each
        at its own efficiency and gathering the FSDP-sharded weights. One micro-batch's is
        ``train_tsp_s`` / ``train_s``; a measured model scales that by ``groups``."""
        one = self.train_tsp_s if tsp else self.train_s
        if self.passes is None:
            return groups * one
        if groups == 1:
            return one
        return self.passes.task_s(groups, tsp, self.train_gather_s, self.layers)

    def group_task_s(self, groups: int, tsp: bool, ranks: int) -> float:
        """Seconds of a train task of ``groups`` micro-batches run by an FSDP group of
        ``ranks`` ranks of this cost, every rank its share of the rows
        (:meth:`TrainPasses.group_task_s`); one rank, or a measured model: :meth:`train_task_s`."""
        if ranks <= 1 or self.passes is None:
            return self.train_task_s(groups, tsp)
        return self.passes.group_task_s(groups, tsp, ranks, self.train_gather_s, self.layers)

    @property
    def rollout_s(self) -> float:
        """A generation task end to end: denoise, decode, score."""
        return self.gen_s + self.decode_s + self.reward_s


@dataclass(frozen=True)
class SimWorker:
    name: str
    gpu_type: str
    gpus: int
    cost: WorkerCost


@dataclass
class CostModel:
    """Everything the driver needs: workers with their task costs, the iteration's shape,
    and its data plane."""

    workers: list[SimWorker]
    tasks: int
    """Tasks per iteration (the Scheduler's groups)."""
    samples_per_task: int
    tasks_per_group: int = 1
    groups_per_task: int = 1
    """Tasks (the Scheduler's groups) per train task (``train.groups_per_task``)."""
    rows_per_forward: int = ROWS_PER_FORWARD
    """Rows of one TSP training pass at most (``train.rows_per_forward``)."""
    max_batch: int = 1
    """Generation tasks a rollout worker leases and runs as one forward per denoising step
    (``rollout.max_batch``); each is acknowledged on its own."""
    dataplane: DataPlane | DataPlaneSeconds = DataPlaneSeconds()
    """The step's all-reduce and AdamW, weight distribution, trajectory transfer: modelled
    from bytes for a split (:class:`~digen.sim.dataplane.DataPlane`), or measured."""
    label: str = ""
    notes: list[str] = field(default_factory=list)
    """Derived choices to report (parallel degrees, FSDP, bytes moved)."""
    sp: list[SpChoice] = field(default_factory=list)
    """The sequence-parallel degree chosen per GPU type (paper-scale models)."""
    paper: PaperInputs | None = None
    """What a paper-scale model was built from (None: measured from a run)."""
    fsdp_group: bool = False
    """The trainers shard the trained weights as one FSDP group (``train.fsdp``, a full
    fine-tune): a disaggregated mode's trainers run every train task together, each rank its
    share of the rows (:meth:`group_task_s`), and only train (the runtime turns TAG and RAT
    off with ``train.fsdp``). False: every trainer a replica of its own."""

    def __post_init__(self) -> None:
        if self.rows_per_forward < 1:
            raise ConfigError(f"rows_per_forward ({self.rows_per_forward}) must be >= 1")

    @property
    def samples(self) -> int:
        return self.tasks * self.samples_per_task

    @property
    def gpu_count(self) -> int:
        return sum(w.gpus for w in self.workers)

    def split_workers(self, trainers: set[str]) -> list[SimWorker]:
        """The workers with their training costs when ``trainers`` (names; every worker of a
        colocated mode) train. Trainers that shard the weights (FSDP) shard over all of them;
        past one node (:data:`GPUS_PER_NODE`
        GPUs) its collectives cross the network, at ``min(intra, net)`` instead of the GPU's
        NVLink (a paper-scale model; a measured one keeps its measured times)."""
        if self.paper is None:
            return list(self.workers)
        group = sum(w.gpus for w in self.workers if w.name in trainers)
        if group <= GPUS_PER_NODE:
            return list(self.workers)
        intra = {g.name: g.intra_gbps for g, _ in self.paper.testbed.gpus}
        net = self.paper.testbed.net_gbps
        out = []
        for w in self.workers:
            c = w.cost
            slow = intra[w.gpu_type] / min(intra[w.gpu_type], net)
            if w.name not in trainers or c.train_gather_s <= 0 or c.passes is None or slow <= 1:
                out.append(w)
                continue
            gather = c.train_gather_s * slow
            slower = replace(
                c,
                train_gather_s=gather,
                train_s=c.passes.task_s(1, False, gather, c.layers),
                train_tsp_s=c.passes.task_s(1, True, gather, c.layers),
            )
            out.append(replace(w, cost=slower))
        return out

    def group_task_s(self, trainers: list[SimWorker], groups: int, tsp: bool) -> float:
        """Seconds of a train task of ``groups`` micro-batches on the FSDP group ``trainers``
        (their costs at the split: :meth:`split_workers`): one rank per trainer worker, the
        slowest rank setting the pace (every pass ends at its collectives)."""
        return max(w.cost.group_task_s(groups, tsp, len(trainers)) for w in trainers)

    def group_rate(self, trainers: set[str], *, tsp: bool = True) -> float:
        """Samples/s the FSDP group ``trainers`` (names) trains, in the train tasks the runtime
        makes (``groups_per_task`` micro-batches each, one at a time on every rank)."""
        if not trainers:
            return 0.0
        group = [w for w in self.split_workers(trainers) if w.name in trainers]
        task = self.group_task_s(group, self.groups_per_task, tsp)
        return self.groups_per_task * self.samples_per_task / task if task > 0 else 0.0

    def rates(self, w: SimWorker, *, tsp: bool = True) -> tuple[float, float]:
        """``(g, t)``: samples/s of worker ``w`` when it only generates / only trains, training
        in the train tasks the runtime makes (``groups_per_task`` micro-batches each: their
        passes share gathers, so a batched task is cheaper per sample than one micro-batch)."""
        c = w.cost
        train = c.train_task_s(self.groups_per_task, tsp)
        b = self.max_batch
        gen = c.gen_batch_s(b, self.samples_per_task) + b * (c.decode_s + c.reward_s)
        g = b * self.samples_per_task / gen if gen > 0 else 0.0
        t = self.groups_per_task * self.samples_per_task / train if train > 0 else 0.0
        return g, t


@dataclass(frozen=True)
class EfficiencyCurve:
    """Achieved TFLOPS as a function of the tokens of one pass (``configs/sim/catalog.yaml``
    ``efficiency_curve``): ``n / (n + half_tokens)``, relative to its value at ``ref_tokens``
    (where the GPU's ``tflops`` were measured) and at most ``cap``."""

    half_tokens: float = 0.0
    ref_tokens: float = 1.0
    cap: float = 1.0


FLAT = EfficiencyCurve()
"""No dependence on the pass's size (0 half-tokens)."""


@dataclass(frozen=True)
class BatchGain:
    """Per-sample speedup of generating ``b`` samples as one forward per denoising step over
    ``b`` forwards of one (``configs/sim/catalog.yaml`` ``generation_batch``, each point a
    published measurement): log-linear in ``b`` between the listed batches, flat beyond the
    largest (no measurement says more), 1 for samples of more than ``max_tokens`` tokens (the
    measurements are of images; a video's pass of thousands of tokens is compute bound
    already, an assumption: docs/cost-model.md)."""

    points: tuple[tuple[int, float], ...] = ((1, 1.0),)
    max_tokens: int = 4096

    def __call__(self, batch: int, tokens: int) -> float:
        if batch <= 1 or tokens > self.max_tokens:
            return 1.0
        table = dict(sorted({1: 1.0, **dict(self.points)}.items()))
        if batch in table:
            return table[batch]
        below = max(b for b in table if b < batch)
        above = min((b for b in table if b > batch), default=None)
        if above is None:
            return table[below]
        w = (math.log(batch) - math.log(below)) / (math.log(above) - math.log(below))
        return table[below] * (table[above] / table[below]) ** w


NO_BATCH_GAIN = BatchGain()
"""Batching generation gains nothing (no ``generation_batch`` in the catalog)."""


def pass_efficiency(curve: EfficiencyCurve, tokens: float) -> float:
    """The GPU's relative efficiency on a pass of ``tokens`` tokens (1.0 at ``ref_tokens``)."""
    if curve.half_tokens <= 0:
        return 1.0
    at = tokens / (tokens + curve.half_tokens)
    ref = curve.ref_tokens / (curve.ref_tokens + curve.half_tokens)
    return min(curve.cap, at / ref)


@dataclass(frozen=True)
class TrainPasses:
    """A replica's training passes: what one row costs and how the runtime packs rows."""

    row_s: float
    """Compute of one row (one sample at one trained timestep, forward and backward, every
    CFG pass) at relative efficiency 1 (:func:`pass_efficiency`)."""
    row_tokens: int
    """Latent tokens of one row (one sample's): a pass's efficiency is of its rows' tokens."""
    samples: int
    """Samples of one micro-batch (``samples_per_task``)."""
    steps: int
    """Trained timesteps per sample (K)."""
    rows_per_forward: int = ROWS_PER_FORWARD
    curve: EfficiencyCurve = FLAT
    tsp_gain: float = 1.0
    """Compute speedup of batching timesteps in one pass (``tsp_batch_gain``; TSP only)."""

    def sizes(self, groups: int, tsp: bool) -> list[int]:
        """Rows of each pass of a task of ``groups`` micro-batches, as
        :func:`digen.training.forward_chunks` cuts them: TSP, runs of ``rows_per_forward``
        rows; else one pass per trained timestep with that step's rows, cut into runs of
        ``rows_per_forward`` too."""
        if not tsp:
            return self._runs(groups * self.samples) * self.steps
        return self._runs(groups * self.samples * self.steps)

    def _runs(self, rows: int) -> list[int]:
        full, rest = divmod(rows, self.rows_per_forward)
        return [self.rows_per_forward] * full + ([rest] if rest else [])

    def compute_s(self, rows: int, tsp: bool) -> float:
        """Compute of one pass of ``rows`` rows, at the efficiency of its tokens."""
        gain = self.tsp_gain if tsp else 1.0
        return rows * self.row_s / (gain * pass_efficiency(self.curve, rows * self.row_tokens))

    def task_s(self, groups: int, tsp: bool, gather_s: float, layers: int) -> float:
        """Seconds of a task of ``groups`` micro-batches: every pass pays its compute and,
        with FSDP (``gather_s`` > 0), its weight gathers (:func:`_pass_s`)."""
        return sum(_pass_s(self.compute_s(r, tsp), gather_s, layers) for r in self.sizes(groups, tsp))

    def rank_sizes(self, groups: int, tsp: bool, ranks: int) -> list[int]:
        """Rows of each pass of the busiest rank of an FSDP group of ``ranks`` that trains a
        task of ``groups`` micro-batches together (:mod:`digen.workers.fsdp_loop`): each rank
        takes a contiguous share of the task's rows (:func:`digen.parallel.fsdp.shard_rows`, the
        largest ``ceil(rows / ranks)``) and cuts it as :func:`digen.training.forward_chunks`
        does. The rows are sample-major, then by step, so without TSP a share of ``s`` rows
        holds ``min(K, s)`` steps, taken as equal runs (one pass each, cut at
        ``rows_per_forward``). The ranks run as many passes as the busiest one (the others pad
        with zero-weight passes that gather alike), so its passes are the group's."""
        share = -(-(groups * self.samples * self.steps) // max(1, ranks))
        if tsp:
            return self._runs(share)
        steps = min(self.steps, share)
        return self._runs(-(-share // steps)) * steps

    def group_task_s(self, groups: int, tsp: bool, ranks: int, gather_s: float, layers: int) -> float:
        """Seconds of a task of ``groups`` micro-batches on an FSDP group of ``ranks``: the
        busiest rank's passes (:meth:`rank_sizes`), each with the group's collectives."""
        return sum(
            _pass_s(self.compute_s(r, tsp), gather_s, layers) for r in self.rank_sizes(groups, tsp, ranks)
        )


@dataclass(frozen=True)
class PaperInputs:
    """What a paper-scale cost model was built from: the peers' modes restate their
    iterations from it (:mod:`digen.sim.peers`)."""

    workload: Workload
    testbed: Testbed
    curve: EfficiencyCurve = FLAT
    batch_gain: BatchGain = NO_BATCH_GAIN
    """Generation's per-sample speedup at a batch (peers' generation batches, digen's
    micro-batches and ``rollout.max_batch``)."""
    engines: dict[str, float] = field(default_factory=lambda: {"eager": 1.0})
    """Rollout engine speedup over eager PyTorch per engine kind."""
    reward_weights_gb: float = 0.0
    """The reward model's weights (a peer that wakes it on the training GPUs loads them)."""
    peers: dict = field(default_factory=dict)
    """Name -> :class:`digen.sim.peers.PeerRecipe` (the peers with a pipeline for the model)."""
    no_pipeline: dict[str, str] = field(default_factory=dict)
    """Name -> why the peer cannot train this workload's model (no such pipeline)."""
    not_modelled: dict[str, str] = field(default_factory=dict)
    """Name -> why the simulator does not restate the peer on this testbed."""

    @property
    def gpus(self) -> int:
        return self.testbed.gpu_count

    @property
    def nodes(self) -> int:
        return math.ceil(self.testbed.gpu_count / GPUS_PER_NODE)

    @property
    def net_gbps(self) -> float:
        return self.testbed.net_gbps


GPUS_PER_NODE = 8
"""GPUs per node (assumption: 8-GPU servers), for where a collective leaves the node."""


# --- paper-scale builder ---------------------------------------------------------------
def sample_memory_gb(model: ModelSpec, degree: int) -> float:
    """GPU memory of generating one sample at sequence-parallel ``degree``: SP replicates the
    weights and splits the activations; the VAE stays resident; the text encoder is resident
    only while encoding (offloaded while the transformer runs), so the peak is the larger."""
    return max(model.text_encoder_gb, model.weights_gb + model.activation_gb / degree) + model.vae_gb


def sp_degree(model: ModelSpec, gpu: GpuType) -> int:
    """Smallest sequence-parallel degree at which one sample fits (:func:`sample_memory_gb`
    within :data:`USABLE_MEMORY` of the GPU's memory)."""
    for d in SP_DEGREES:
        if sample_memory_gb(model, d) <= USABLE_MEMORY * gpu.memory_gb:
            return d
    raise ConfigError(
        f"model {model.name} ({model.weights_gb} GB weights + {model.activation_gb} GB activations) does not fit "
        f"on {gpu.name} ({gpu.memory_gb} GB) even with sequence parallelism {SP_DEGREES[-1]}; use a GPU with more memory"
    )


@dataclass(frozen=True)
class SpChoice:
    """The sequence-parallel degree the cost model chose on one GPU type, and why."""

    gpu_type: str
    degree: int
    replicas: int
    memory_gb: float
    """One sample's memory at ``degree`` (:func:`sample_memory_gb`)."""
    usable_gb: float
    smaller_gb: float | None
    """One sample's memory at the next smaller degree (None at degree 1): above ``usable_gb``."""
    efficiency: float
    efficiency_source: str

    def describe(self) -> str:
        """One line: degree, the memory reason, the efficiency and its source."""
        fits = f"{self.memory_gb:.1f} GB per sample fits {self.usable_gb:.1f} GB usable"
        if self.smaller_gb is not None:
            below = SP_DEGREES[SP_DEGREES.index(self.degree) - 1]
            fits += f"; at SP {below} {self.smaller_gb:.1f} GB does not"
        return (
            f"{self.gpu_type}: sequence parallel {self.degree} ({fits}), {self.replicas} replicas x "
            f"{self.degree} GPU, efficiency {self.efficiency:.3f} ({self.efficiency_source})"
        )


def sp_choice(model: ModelSpec, gpu: GpuType, count: int) -> SpChoice:
    """:func:`sp_degree` on ``count`` GPUs of type ``gpu``, with its reason and efficiency."""
    d = sp_degree(model, gpu)
    if count % d:
        raise ConfigError(
            f"{count} x {gpu.name} is not a multiple of the sequence-parallel degree {d} that "
            f"{model.name} needs there"
        )
    smaller = SP_DEGREES[SP_DEGREES.index(d) - 1] if d > 1 else None
    return SpChoice(
        gpu_type=gpu.name,
        degree=d,
        replicas=count // d,
        memory_gb=sample_memory_gb(model, d),
        usable_gb=USABLE_MEMORY * gpu.memory_gb,
        smaller_gb=sample_memory_gb(model, smaller) if smaller else None,
        efficiency=model.sp_eff(d),
        efficiency_source=model.sp_eff_source(d),
    )


def needs_fsdp(model: ModelSpec, gpu: GpuType, degree: int) -> bool:
    """Training shards the base weights (FSDP) when weights plus training activations (taken
    as twice one sample's generation activations, with activation checkpointing) do not fit,
    and always for a full fine-tune (AdamW needs ~16 B/param, cost-model.md l.37)."""
    if model.adapter_gb is None:
        return True
    return model.weights_gb + 2 * model.activation_gb / degree > USABLE_MEMORY * gpu.memory_gb


def _pass_s(compute_s: float, gather_s: float, layers: int) -> float:
    """One FSDP pass: layer-wise all-gathers are prefetched under compute, so the pass takes
    the longer of the two plus the one gather that cannot overlap (the first layer)."""
    if gather_s <= 0:
        return compute_s
    return max(compute_s, gather_s) + gather_s / layers


def fsdp_pass_comm_s(model: ModelSpec, gpu: GpuType) -> float:
    """The collectives of one FSDP training pass inside a node, as FSDP2 runs them
    (:mod:`digen.parallel.fsdp`: ``reshard_after_forward``, ``reduce_dtype`` float32): the
    forward all-gathers every block's bf16 weights (``weights_gb``), the backward gathers them
    again and reduce-scatters each block's float32 gradient of the trained parameters (``4 P``
    bytes: the whole model for a full fine-tune, the adapter for LoRA). A ring sends and
    receives ``(N-1)/N`` of each, taken as 1: ``(2 x weights_gb + 4 P / GB) / intra_gbps``.
    There is no gradient all-reduce at the step (:meth:`DataPlane.reduce_s`)."""
    grad_gb = GRAD_BYTES * model.trained_params / GB
    return (2 * model.weights_gb + grad_gb) / gpu.intra_gbps


def worker_cost(
    w: Workload,
    gpu: GpuType,
    degree: int,
    *,
    tsp_batch_gain: float = 1.0,
    curve: EfficiencyCurve = FLAT,
    batch_gain: BatchGain = NO_BATCH_GAIN,
) -> tuple[WorkerCost, bool]:
    """Task costs of one replica of ``degree`` GPUs of type ``gpu``; also whether it trains
    with FSDP. A pass runs at :func:`pass_efficiency` of its tokens: a task's micro-batch
    (``samples_per_task`` samples), and with TSP its K timesteps in one pass while they fit
    in ``rows_per_forward`` rows, else the runtime's passes (:class:`TrainPasses`)."""
    m, mdl = w.samples_per_task, w.model
    k = w.trained_timesteps
    eff = pass_efficiency(curve, m * mdl.tokens)
    tsp_gain = tsp_batch_gain * pass_efficiency(curve, k * m * mdl.tokens) / eff
    speed = degree * gpu.tflops * mdl.sp_eff(degree) * eff  # TFLOP/s of the replica
    # generation: one sample's pass at its tokens' efficiency, the micro-batch at the batch gain
    gen_speed = degree * gpu.tflops * mdl.sp_eff(degree) * pass_efficiency(curve, mdl.tokens)
    gen_fwd = m * mdl.cfg * mdl.tflop_per_step / (gen_speed * batch_gain(m, mdl.tokens))
    fwd_train = m * (mdl.train_cfg or mdl.cfg) * mdl.tflop_per_step / speed
    fsdp = needs_fsdp(mdl, gpu, degree)
    gather = mdl.weights_gb / gpu.intra_gbps if fsdp else 0.0  # one full all-gather
    train_comm = fsdp_pass_comm_s(mdl, gpu) if fsdp else 0.0
    # a KL term (train.kl_beta > 0) adds the reference's forward to each row, in the same pass
    train_factor = mdl.train_flops_factor + (1.0 if w.kl_beta > 0 else 0.0)
    train_pass = fwd_train * train_factor
    # FSDP gathers the weights for the forward and again for the backward of every pass, and
    # reduce-scatters the gradient in the backward (fsdp_pass_comm_s)
    train_s = k * _pass_s(train_pass, train_comm, mdl.layers)
    train_tsp_s = _pass_s(k * train_pass / tsp_gain, train_comm, mdl.layers)
    tcfg = mdl.train_cfg or mdl.cfg
    passes = TrainPasses(
        row_s=tcfg * mdl.tflop_per_step * train_factor / (degree * gpu.tflops * mdl.sp_eff(degree)),
        row_tokens=mdl.tokens,
        samples=m,
        steps=k,
        rows_per_forward=w.rows_per_forward,
        curve=curve,
        tsp_gain=tsp_batch_gain,
    )
    if k * m > w.rows_per_forward:  # the runtime cuts the task's rows into several passes
        train_tsp_s = passes.task_s(1, True, train_comm, mdl.layers)
    gen_s = w.steps * gen_fwd
    gen_on_trainer_s = w.steps * _pass_s(gen_fwd, gather, mdl.layers)
    decode_s = m * mdl.decode_s_ref * REFERENCE_TFLOPS / gpu.tflops
    reward_s = m * mdl.reward_tflop / gpu.tflops
    trained_gb = mdl.version_gb  # a worker loads the version as it travels
    cost = WorkerCost(
        gen_s=gen_s,
        decode_s=decode_s,
        reward_s=reward_s,
        train_s=train_s,
        train_tsp_s=train_tsp_s,
        gen_on_trainer_s=gen_on_trainer_s,
        recompute_s=k * _pass_s(fwd_train, gather, mdl.layers),
        # full-duplex PCIe: offloading one engine's weights overlaps reloading the other's
        phase_switch_s=mdl.weights_gb / gpu.host_gbps,
        context_switch_s=trained_gb / gpu.host_gbps,
        load_s=trained_gb / gpu.host_gbps,
        train_gather_s=train_comm,
        layers=mdl.layers,
        passes=passes,
        gen_batch_gain=batch_gain,
        tokens=mdl.tokens,
    )
    return cost, fsdp


def paper_costmodel(
    w: Workload,
    tb: Testbed,
    *,
    tsp_batch_gain: float = 1.0,
    dataplane: DataPlaneModel | None = None,
    paper: PaperInputs | None = None,
) -> CostModel:
    """Cost model of workload ``w`` on testbed ``tb`` from FLOPs, bytes and bandwidths;
    ``dataplane``: the data plane's calibration (default: :class:`DataPlaneModel`'s);
    ``paper``: the efficiency curve, engines and peer recipes (default: flat, none)."""
    paper = paper or PaperInputs(w, tb)
    workers: list[SimWorker] = []
    notes: list[str] = []
    choices: list[SpChoice] = []
    for gpu, count in tb.gpus:
        try:
            choice = sp_choice(w.model, gpu, count)
        except ConfigError as exc:
            raise ConfigError(f"testbed {tb.name}: {exc}") from None
        choices.append(choice)
        degree = choice.degree
        cost, fsdp = worker_cost(
            w, gpu, degree, tsp_batch_gain=tsp_batch_gain, curve=paper.curve, batch_gain=paper.batch_gain
        )
        notes.append(
            f"{gpu.name}: {count // degree} workers x {degree} GPU (SP {degree}, eff "
            f"{w.model.sp_eff(degree):.2f}){', FSDP training' if fsdp else ''}"
        )
        workers += [SimWorker(f"{gpu.name}-{i:04d}", gpu.name, degree, cost) for i in range(count // degree)]
    mdl = w.model
    plane = DataPlane(
        params=mdl.trained_params,
        version_bytes_per_param=mdl.version_bytes_per_param,
        trajectory_bytes=w.trajectory_bytes,
        net_gbps=tb.net_gbps,
        mem_gbps={gpu.name: gpu.mem_gbps for gpu, _ in tb.gpus if gpu.mem_gbps is not None},
        sharded=mdl.adapter_gb is None,  # a full fine-tune trains with train.fsdp
        model=dataplane or DataPlaneModel(),
    )
    return CostModel(
        workers=workers,
        tasks=w.tasks,
        samples_per_task=w.samples_per_task,
        tasks_per_group=w.tasks_per_group,
        groups_per_task=w.groups_per_task,
        rows_per_forward=w.rows_per_forward,
        max_batch=w.max_batch,
        dataplane=plane,
        fsdp_group=mdl.adapter_gb is None,  # a full fine-tune trains with train.fsdp
        label=f"{w.name} on {tb.name}",
        notes=notes,
        sp=choices,
        paper=paper,
    )
