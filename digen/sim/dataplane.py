"""The simulator's data plane: what the runtime's transfers and optimizer step cost per
iteration, from the bytes they move, the testbed's network bandwidth and the efficiencies
``digen bench --dataplane`` measures (:mod:`digen.bench.dataplane`).

The runtime's data plane (``docs/dataplane.md``, :mod:`digen.dataplane`), phase by phase, and
what the simulator charges for it (``net`` = the testbed's ``net_gbps``, a worker's link; ``P``
the trained parameters):

- **reduce**: every trainer adds the train tasks it ran into one float32 sum
  (:class:`~digen.dataplane.reduce.TaskSum`); at the step the ``N`` trainers all-reduce it in a
  ring, which sends ``2 (N-1)/N`` of the ``4 P`` gradient bytes per trainer whatever the task
  count: ``2 (N-1)/N x 4 P / (reduce_efficiency x net)``. A colocated system reduces too:
  every worker is a trainer. With ``train.fsdp`` there is no such step: FSDP2
  reduce-scatters each block's float32 gradient inside every backward
  (:mod:`digen.parallel.fsdp`), so every rank already holds its shard of the sum when the
  step comes, and the step's all-reduce is 0; the reduce-scatters are charged to each
  training pass instead (:func:`digen.sim.costmodel.worker_cost`).
- **step**: each trainer steps its replica of AdamW (:class:`~digen.optim.ParameterStore`,
  float32 master weights) on its GPU, a memory-bound pass: ``P x step_bytes_per_param /
  mem_gbps``, the slowest trainer GPU type setting the pace (the members step at once).
- **distribute**: after the step each trainer serves the new version in the dtype of the
  policy's trained tensors (:func:`digen.config.trained_dtype_name`, the runtime's rule:
  ``model.lora.dtype``, float32 by default, for an adapter; ``model.dtype`` for a full
  fine-tune): ``V = b P`` bytes, ``b`` = :attr:`DataPlane.version_bytes_per_param` (4 for a
  float32 adapter, 2 for a bfloat16 transformer). A rollout worker that needs it cuts the tensor list into
  64 MiB buckets and fetches bucket ``i`` from holder ``(i + start) mod T``, its ``start``
  its own (:func:`~digen.dataplane.weights.fetch_version`): the ``R`` rollout workers'
  ``R x V`` bytes spread over the ``T`` trainers' links, ``R V / T`` each, while every rollout
  worker's own link takes in ``V``. The slower side sets the time: ``V x max(1, R / T) /
  (distribute_efficiency x net)``. (When a version has fewer buckets than there are trainers,
  fewer holders serve, but then ``R / T`` is below one bucket per holder and each rollout
  worker's own link bounds the time: the same formula.) This is the time of one fetch with
  every rollout worker fetching at once, as they do after a synchronous step; it is paid on
  each rollout worker's lane when it starts its first task of the new version. Trainers hold
  the version they made (a trainer generating under TAG fetches nothing), and a colocated
  system has no distribution. With ``train.fsdp`` (a full fine-tune) each of the ``T`` ranks
  serves its dim-0 shard, ``V / T`` bytes, and a rollout worker fetches the shards one after
  the other starting at its own rank, ``start mod T`` (``WorkerContext._fetch_weights``: the
  same ``start``, a hash of the worker's name, as above): at any moment the ``R`` rollout
  workers are spread over the ``T`` ranks, each rank serving ``R / T`` of them, so the same
  formula, ``V x max(1, R / T) / (distribute_efficiency x net)``. (Spread evenly: the hashed
  starts are taken as distinct modulo ``T``; two workers whose starts collide share a rank's
  link for the whole fetch, which this does not charge.)
- **trajectory**: a train task fetches its group's tensors (the latents of every stored step,
  ``steps + 1`` per sample, and the log-probs; not the images) from the worker that
  generated them, at the task's start (``workers/tasks.py``): on the train task's critical
  path, ``bytes / (trajectory_efficiency x net)``. A worker training a group it generated
  itself reads its own store: no transfer.

Two biases, stated: ``net`` is taken as what one raw TCP stream between two workers carries
(the bench's "raw link"); a single stream over a 200-400 Gb/s fabric may carry less, which
``digen bench --dataplane`` run on the cluster shows. And the reduce efficiency is gloo's; on
GPUs the runtime all-reduces with NCCL, which over RDMA commonly reaches a larger fraction of
the link. On the paper's workloads the data plane is well under 1% of an iteration either
way (``docs/simulator.md``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from digen.errors import ConfigError
from digen.sim.files import read_mapping

GB = 1e9
"""The catalog's bandwidths are decimal GB/s (200 Gb/s = 25 GB/s)."""
GRAD_BYTES = 4
"""Per trained parameter: the float32 running sum the trainers all-reduce."""
CATALOG_BYTES = 2
"""Per parameter in the catalog's sizes (``weights_gb``, ``adapter_gb``: bf16 GB), to count
parameters from them; what a version moves per parameter is the trained dtype's, not this."""


@dataclass(frozen=True)
class DataPlaneModel:
    """The calibration constants of the simulator's data plane, in one place: each transfer's
    rate as a fraction of the raw link's (``digen bench --dataplane``'s ``efficiency``), and
    the optimizer step's memory traffic.

    The defaults are the medians of three runs of

        digen bench --dataplane --sizes sd3.5-m-lora-r32 --out /tmp/simbench

    (``python -m digen.cli.main``) at commit e13d8e4, 2026-12-06, on a shared 2-core machine (2
    trainers + 2 rollout workers as local processes, gloo, loopback; raw link 1.68, 1.75 and
    1.60 GiB/s): reduce 0.350 / 0.285 / 0.222, distribute 0.171 / 0.123 / 0.152, trajectory
    0.491 / 0.405 / 0.555. On loopback the "link" is a kernel memory copy as fast as the data
    plane's own copies, and the four processes share two cores (two transfers at once, as in
    the distribute phase, halve each other's CPU), so these fractions understate a real
    network's: read them as a floor. :meth:`from_bench` takes them from a bench run on the
    cluster instead (``digen simulate --dataplane FILE``).

    The bench's own step (AdamW on one CPU thread: 19M parameters in 0.42-0.50 s) says nothing
    of a GPU's; the step is modelled from the GPU's memory bandwidth instead.
    """

    reduce_efficiency: float = 0.285
    """All-reduce: bytes each trainer sends per second / the raw link's rate."""
    distribute_efficiency: float = 0.152
    """Weight distribution: bytes each trainer serves per second / the raw link's rate."""
    trajectory_efficiency: float = 0.491
    """Trajectory fetch: bytes per second / the raw link's rate."""
    step_bytes_per_param: float = 28.0
    """AdamW's memory traffic per parameter: it reads the float32 weight, gradient and two
    moments and writes the weight and the moments back (7 x 4 bytes)."""
    gpu_mem_gbps: float = 700.0
    """Achieved GPU memory bandwidth (GB/s) of the step where the catalog's GPU type gives
    none (``mem_gbps``): an assumption, about 80% of the L20's 864 GB/s datasheet figure, the
    slowest GPU of ``configs/sim/catalog.yaml`` (H100 SXM 3,350, H20 4,000), so the step is
    if anything overestimated."""
    source: str = (
        "digen bench --dataplane --sizes sd3.5-m-lora-r32 at e13d8e4, 2026-12-06 (median of 3; loopback, "
        "2 cores); step from an assumed 700 GB/s GPU memory bandwidth"
    )
    """Where the numbers come from, in words (reported with the results)."""

    @classmethod
    def from_bench(cls, data: dict, size: str | None = None) -> DataPlaneModel:
        """The efficiencies of one data-plane round of a ``bench-dataplane.json`` (the parsed
        object): round ``size``, else the largest (fixed per-transfer costs weigh least
        there); the step's constants stay the defaults."""
        rounds = [r for r in data.get("rounds", []) if r.get("path") == "dataplane" and r.get("efficiency")]
        if size is not None:
            rounds = [r for r in rounds if r.get("name") == size]
        if not rounds:
            which = f"round {size!r}" if size is not None else "data-plane round"
            raise ConfigError(
                f"the bench results hold no {which} with efficiencies (a bench-dataplane.json of "
                f"`digen bench --dataplane`, which measures the raw link, is needed)"
            )
        r = max(rounds, key=lambda x: x["bytes"])
        eff = r["efficiency"]
        missing = [k for k in ("reduce", "distribute", "trajectory") if not eff.get(k)]
        if missing:
            raise ConfigError(f"bench round {r['name']} has no {', '.join(missing)} efficiency")
        link = r.get("link_bytes_per_s") or 0.0
        return cls(
            reduce_efficiency=eff["reduce"],
            distribute_efficiency=eff["distribute"],
            trajectory_efficiency=eff["trajectory"],
            source=(
                f"{data.get('command', 'digen bench --dataplane')} at {data.get('commit', '?')}, "
                f"{data.get('date', '?')} (round {r['name']}, raw link {link / GB:.2f} GB/s); step from "
                f"the GPUs' memory bandwidth"
            ),
        )

    @classmethod
    def load(cls, path: str | Path, size: str | None = None) -> DataPlaneModel:
        """:meth:`from_bench` of a ``bench-dataplane.json`` file (or the folder holding it)."""
        p = Path(path)
        if p.is_dir():
            p = p / "bench-dataplane.json"
        data = read_mapping(p, "pass the bench-dataplane.json of `digen bench --dataplane`")
        return cls.from_bench(data, size)

    def describe(self) -> str:
        """One line: the constants and their source."""
        return (
            f"Data plane: efficiencies reduce {self.reduce_efficiency:.3f}, distribute "
            f"{self.distribute_efficiency:.3f}, trajectory {self.trajectory_efficiency:.3f} of the link; "
            f"step {self.step_bytes_per_param:g} B/param ({self.source})."
        )


@dataclass(frozen=True)
class DataPlaneSeconds:
    """Seconds of each data-plane phase, as the driver charges them: ``reduce_s`` and
    ``step_s`` once per step (every trainer at once); ``distribute_s`` per rollout worker
    taking in a new version; ``trajectory_s`` per train task whose group another worker
    generated.

    Also a cost model's data plane when it was measured (:mod:`digen.sim.calibrate`): then
    the same seconds whatever the split."""

    reduce_s: float = 0.0
    step_s: float = 0.0
    distribute_s: float = 0.0
    trajectory_s: float = 0.0

    def for_split(self, trainer_gpus: list[str], rollouts: int) -> DataPlaneSeconds:
        return self


@dataclass(frozen=True)
class DataPlane:
    """What the data plane moves for one workload on one testbed, and its seconds for a given
    rollout/trainer split (see the module docstring for the formulas)."""

    params: float
    """Trained parameters (a LoRA adapter's, or the model's for a full fine-tune)."""
    trajectory_bytes: float
    """The tensors a train task fetches: its samples' stored latents and log-probs."""
    net_gbps: float
    mem_gbps: dict[str, float]
    """Achieved GPU memory bandwidth per GPU type name (GB/s)."""
    sharded: bool = False
    """A full fine-tune: trained with ``train.fsdp`` (sharded step, shard-by-shard distribution)."""
    model: DataPlaneModel = DataPlaneModel()
    version_bytes_per_param: int = 4
    """Bytes per trained parameter of a served version: its trained dtype's
    (:attr:`digen.sim.costmodel.ModelSpec.version_bytes_per_param`; 4 = a float32 adapter,
    ``model.lora.dtype``'s default)."""

    @property
    def grad_bytes(self) -> float:
        return GRAD_BYTES * self.params

    @property
    def version_bytes(self) -> float:
        return self.version_bytes_per_param * self.params

    def reduce_s(self, trainers: int) -> float:
        """Ring all-reduce of the float32 sum among ``trainers``; 0 for an FSDP group
        (``sharded``: its backward passes reduce-scatter the gradient, see the module docstring)."""
        if trainers <= 1 or self.sharded:
            return 0.0
        sent = 2 * (trainers - 1) / trainers * self.grad_bytes
        return sent / (self.model.reduce_efficiency * self.net_gbps * GB)

    def step_s(self, trainer_gpus: list[str]) -> float:
        """AdamW on every trainer at once (``trainer_gpus``: their GPU types), the slowest
        GPU's memory setting the pace; sharded over the trainers under FSDP."""
        if not trainer_gpus:
            return 0.0
        params = self.params / len(trainer_gpus) if self.sharded else self.params
        slowest = min(self.mem_gbps.get(g, self.model.gpu_mem_gbps) for g in set(trainer_gpus))
        return params * self.model.step_bytes_per_param / (slowest * GB)

    def distribute_s(self, rollouts: int, trainers: int) -> float:
        """One rollout worker's fetch of a version while all ``rollouts`` fetch it from the
        ``trainers`` that hold it (whole, or with ``sharded`` each its FSDP rank's shard: the
        rollout workers start at different ranks, so the same spread)."""
        if rollouts <= 0 or trainers <= 0:
            return 0.0
        shared = max(1.0, rollouts / trainers)
        return self.version_bytes * shared / (self.model.distribute_efficiency * self.net_gbps * GB)

    def trajectory_s(self) -> float:
        """One train task's fetch of its group from the worker that generated it."""
        return self.trajectory_bytes / (self.model.trajectory_efficiency * self.net_gbps * GB)

    def for_split(self, trainer_gpus: list[str], rollouts: int) -> DataPlaneSeconds:
        """The phases' seconds with these trainers (their GPU types; every worker of a
        colocated system) and ``rollouts`` rollout workers."""
        n = len(trainer_gpus)
        return DataPlaneSeconds(
            reduce_s=self.reduce_s(n),
            step_s=self.step_s(trainer_gpus),
            distribute_s=self.distribute_s(rollouts, n),
            trajectory_s=self.trajectory_s(),
        )
