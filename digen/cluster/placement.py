"""Which GPU each worker process gets: the placement of a local cluster or of a node.

A machine's GPUs come from one seam, :func:`discover` (``nvidia-smi``, no torch: the
controller imports none; ``$DIGEN_FAKE_GPUS`` replaces it with a spec such as ``4xh100,4xl40s``,
as tests and ``digen plan --gpus`` do). :func:`place` maps workers onto them; a placed worker
process sees only its own GPU (``CUDA_VISIBLE_DEVICES``, ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so the
ids are ``nvidia-smi``'s) and runs on ``cuda:0`` (``DIGEN_DEVICE``), tagged with the Dask
resource ``gpu-<type>`` of that GPU (:func:`gpu_type` reads it from the name). A machine with
two kinds of GPU is thus a heterogeneous cluster with no flag.

The rules, as GPU training wants them:

- GPUs of one type are kept together, the types with the most memory first; within a type,
  ids ascending (neighbouring ids share a switch or an NVLink bridge on PCIe boxes).
- Trainers go first, as one block (on the largest GPUs: optimizer state and activations need
  the memory), in rank order (sorted names: :class:`~digen.controlplane.trainer_group.TrainerGroup`),
  so FSDP ranks (``train.fsdp``) and a replicated group's all-reduce get adjacent ids.
- Rollout workers follow in sorted-name order, cut into sequence-parallel replicas of
  ``rollout.sequence_parallel`` exactly as the controller cuts them
  (:func:`~digen.runtime.sp_group.plan_replicas`: consecutive sorted names within one GPU
  type): each replica is placed on adjacent GPUs of one type, moving to the next type rather
  than splitting a replica across two. Reward workers come last.
- One worker per GPU. Two workers share a GPU only with ``cluster.local.workers_per_gpu`` > 1,
  and only once every GPU has one (each GPU's first seat comes before any GPU's second); more
  workers than that allows is a :class:`~digen.errors.ConfigError` (exit 2, one line)
  before anything starts. GPUs left over stay idle (listed by ``digen plan``).
- Ranks of one ``torch.distributed`` group go to distinct GPUs: NCCL refuses a group with two
  ranks on one device. Where they cannot (fewer GPUs than ranks), FSDP ranks and a
  sequence-parallel replica are refused (exit 2, one line naming the key: their collectives,
  all-gathers and all-to-alls of CUDA tensors, have no gloo equivalent), and the replicated
  trainer group all-reduces on gloo, through host memory (:data:`BACKEND_ENV`; ``digen plan``
  prints a note): slower, but a one-GPU box can still run several trainers, or ``colocated``
  mode with several workers, whose every worker is in the trainer group.
- No GPU (none visible, ``cluster.local.gpus: []``, ``model.device: cpu``): every worker runs
  on CPU, tagged ``cluster.local.gpu_type``, and is pinned there (no GPU visible to it,
  ``DIGEN_DEVICE=cpu``), so torch gives it none; only a ``model.device`` that names CUDA
  itself, on a machine whose GPUs :func:`discover` cannot list (no ``nvidia-smi``), leaves the
  worker's environment alone.

A unit that fits no single type (6 trainers on a box of 4 H100 and 4 L40S) takes the first
free GPUs in order and spans types; ``digen plan`` shows it. A worker added to a running local
cluster (:func:`~digen.cluster.cluster.add_local_worker`, tests of elasticity) is not placed:
it inherits the controller's environment.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

from digen.errors import ConfigError

BACKEND_ENV = "DIGEN_TRAINER_BACKEND"  # digen.parallel.comm.TRAINER_BACKEND_ENV (no torch here)
"""Set to ``gloo`` in the environment of a trainer group's members that share a GPU: NCCL
refuses two ranks of one group on one device, so the group all-reduces on gloo, through host
memory (:func:`digen.parallel.comm.trainer_backend`)."""

FAKE_ENV = "DIGEN_FAKE_GPUS"
"""A GPU spec (``8xh100``, ``4xh100,4xl40s``) that replaces the machine's GPUs in
:func:`discover`: tests prove placement with it on a machine without GPUs."""

SPEC_MEMORY_MIB = {
    "h100": 81559,
    "h200": 143771,
    "h800": 81559,
    "a100": 81920,
    "a800": 81920,
    "l40s": 46068,
    "l40": 46068,
    "l4": 23034,
    "a10g": 23028,
    "a10": 23028,
    "rtx4090": 24564,
    "v100": 32768,
    "b200": 183359,
}
"""Memory of a GPU named in a spec (MiB, as ``nvidia-smi`` reports the common models); other
types get 0 (they then sort after these)."""

_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "quadro"}
_JOINED_PREFIXES = {"rtx", "titan", "gtx"}


def gpu_type(name: str) -> str:
    """The short type of a device name: ``NVIDIA H100 80GB HBM3`` -> ``h100``,
    ``NVIDIA A100-SXM4-80GB`` -> ``a100``, ``NVIDIA GeForce RTX 4090`` -> ``rtx4090``,
    ``NVIDIA L40S`` -> ``l40s``; ``gpu`` when nothing is left."""
    words = [w for w in re.split(r"[\s\-_/]+", name.lower()) if w and w not in _VENDOR_WORDS]
    if not words:
        return "gpu"
    first = words[0]
    if first in _JOINED_PREFIXES and len(words) > 1:
        first += words[1]
    return re.sub(r"[^a-z0-9]", "", first) or "gpu"


@dataclass(frozen=True)
class Gpu:
    """One GPU of a machine: its ``nvidia-smi`` index, name and memory."""

    index: int
    name: str
    memory_mib: int
    visible_id: str = ""
    """What a worker's ``CUDA_VISIBLE_DEVICES`` names it by (default: the index)."""

    @property
    def type(self) -> str:
        return gpu_type(self.name)

    @property
    def cuda_id(self) -> str:
        return self.visible_id or str(self.index)


def parse_spec(spec: str, what: str = "--gpus") -> list[Gpu]:
    """GPUs of a spec ``NxTYPE[,NxTYPE...]`` (``8xh100``, ``4xh100,4xl40s``), numbered from 0
    in the order given."""
    out: list[Gpu] = []
    for part in (p.strip() for p in spec.split(",")):
        m = re.fullmatch(r"(\d+)\s*[xX*]\s*([A-Za-z0-9][A-Za-z0-9.\-_]*)", part)
        if not m or int(m.group(1)) < 1:
            raise ConfigError(f"{what} ({spec}) must look like 8xh100 or 4xh100,4xl40s")
        kind = gpu_type(m.group(2))
        for _ in range(int(m.group(1))):
            out.append(Gpu(len(out), f"{kind} (planned)", SPEC_MEMORY_MIB.get(kind, 0)))
    return out


def discover() -> list[Gpu]:
    """The GPUs this process may use: ``$DIGEN_FAKE_GPUS`` when set, else ``nvidia-smi``'s
    list, narrowed to ``$CUDA_VISIBLE_DEVICES`` when set (ids or ``GPU-`` UUIDs; empty or
    ``-1``: none). No ``nvidia-smi``, or one that fails: no GPU."""
    fake = os.environ.get(FAKE_ENV)
    if fake is not None:
        return parse_spec(fake, FAKE_ENV) if fake.strip() else []
    return _visible(_nvidia_smi(), os.environ.get("CUDA_VISIBLE_DEVICES"))


def _visible(listed: list[tuple[Gpu, str]], cvd: str | None) -> list[Gpu]:
    if cvd is None:
        return [g for g, _ in listed]
    wanted = [w.strip() for w in cvd.split(",") if w.strip()]
    out: list[Gpu] = []
    for w in wanted:
        if w.lstrip("-").isdigit() and int(w) < 0:
            break  # CUDA stops at the first invalid id
        hit = next((g for g, uuid in listed if w == str(g.index) or (uuid and uuid.startswith(w))), None)
        if hit is None:
            break
        out.append(Gpu(hit.index, hit.name, hit.memory_mib, w if not w.isdigit() else ""))
    return out


@functools.lru_cache(maxsize=1)
def _nvidia_smi() -> list[tuple[Gpu, str]]:
    """(GPU, UUID) for every GPU ``nvidia-smi`` lists; empty without it."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        res = subprocess.run(
            [exe, "--query-gpu=index,name,memory.total,uuid", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    if res.returncode != 0:
        return []
    return parse_nvidia_smi(res.stdout)


def parse_nvidia_smi(text: str) -> list[tuple[Gpu, str]]:
    """Rows of ``nvidia-smi --query-gpu=index,name,memory.total,uuid --format=csv,noheader,nounits``."""
    out = []
    for line in text.splitlines():
        cols = [c.strip() for c in line.split(",")]
        if len(cols) < 3 or not cols[0].isdigit():
            continue
        mem = int(float(cols[2])) if re.fullmatch(r"[\d.]+", cols[2]) else 0
        out.append((Gpu(int(cols[0]), cols[1], mem), cols[3] if len(cols) > 3 else ""))
    return out


@dataclass(frozen=True)
class Slot:
    """One worker process and the GPU(s) it sees."""

    worker: str
    role: str
    gpus: tuple[int, ...]
    gpu_type: str
    cuda_ids: tuple[str, ...] = ()

    cpu: bool = True
    """Without GPUs: pin the worker to the CPU (``CUDA_VISIBLE_DEVICES`` empty, ``DIGEN_DEVICE``
    ``cpu``). False where the config names a CUDA device itself (``model.device: cuda:1`` on a
    machine whose GPUs :func:`discover` cannot list): the worker then inherits the parent's
    environment and computes where ``model.device`` says."""
    backend: str = ""
    """The backend of the trainer group this worker is in when it is not NCCL's: ``gloo``
    where members share a GPU (:data:`BACKEND_ENV`); empty: gloo on CPU, NCCL on CUDA."""

    def env(self) -> dict[str, str]:
        """The environment that pins the worker process to its GPUs, or to the CPU (see
        :attr:`cpu`). A placed worker sees its first GPU as ``cuda:0``."""
        if not self.gpus:
            return {"CUDA_VISIBLE_DEVICES": "", "DIGEN_DEVICE": "cpu"} if self.cpu else {}
        ids = self.cuda_ids or tuple(str(i) for i in self.gpus)
        env = {
            "CUDA_VISIBLE_DEVICES": ",".join(ids),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "DIGEN_DEVICE": "cuda:0",
        }
        if self.backend:
            env[BACKEND_ENV] = self.backend
        return env

    def to_json(self) -> dict:
        return {"worker": self.worker, "role": self.role, "gpus": list(self.gpus), "gpu_type": self.gpu_type}


@dataclass(frozen=True)
class Placement:
    """Every worker's GPUs (:func:`place`), the GPUs left idle, and why none, if none."""

    slots: list[Slot]
    idle: list[Gpu] = field(default_factory=list)
    cpu_reason: str | None = None
    """Set when the workers run on CPU: why."""
    notes: list[str] = field(default_factory=list)
    """What the placement changed about the job, one line each (a trainer group on gloo)."""

    def slot(self, worker: str) -> Slot:
        return next(s for s in self.slots if s.worker == worker)

    def to_json(self) -> list[dict]:
        return [s.to_json() for s in self.slots]

    def lines(self) -> list[str]:
        """One line per worker (for a run's start and ``digen plan``), then the idle GPUs."""
        if self.cpu_reason is not None:
            head = [f"placement: on CPU ({self.cpu_reason})"]
        else:
            head = ["placement:"]
        width = max((len(s.worker) for s in self.slots), default=0)
        rows = [
            f"  {s.worker:<{width}}  {s.role:<7}  "
            + (f"GPU {','.join(map(str, s.gpus))} ({s.gpu_type})" if s.gpus else f"CPU ({s.gpu_type})")
            for s in self.slots
        ]
        if self.idle:
            rows.append("  idle: " + ", ".join(f"GPU {g.index} ({g.type})" for g in self.idle))
        return head + rows + [f"note: {n}" for n in self.notes]


def _ordered(gpus: Sequence[Gpu]) -> list[Gpu]:
    """GPUs grouped by type, the types with the most memory first, ids ascending within one."""
    best: dict[str, int] = {}
    for g in gpus:
        best[g.type] = max(best.get(g.type, 0), g.memory_mib)
    return sorted(gpus, key=lambda g: (-best[g.type], g.type, g.index))


def _units(workers: Sequence[tuple[str, str]], sp_degree: int) -> list[list[tuple[str, str]]]:
    """Workers in placement order, in units placed on one GPU type together: all trainers as
    one unit, rollout replicas of ``sp_degree`` (the controller's cut), then single workers."""
    by_role: dict[str, list[tuple[str, str]]] = {}
    for name, role in workers:
        by_role.setdefault(role, []).append((name, role))
    units: list[list[tuple[str, str]]] = []
    trainers = sorted(by_role.pop("trainer", []))
    if trainers:
        units.append(trainers)
    rollouts = sorted(by_role.pop("rollout", []))
    d = max(1, sp_degree)
    whole = len(rollouts) - len(rollouts) % d if d > 1 else 0
    units += [rollouts[i : i + d] for i in range(0, whole, d)]
    units += [[w] for w in rollouts[whole:]]
    for role in sorted(by_role):
        units += [[w] for w in sorted(by_role[role])]
    return units


@dataclass(frozen=True)
class Collectives:
    """Which placed workers form one ``torch.distributed`` group (NCCL on GPU), so that two of
    them must not share a GPU: the trainer group (``trainers``: ``allreduce``, the replicated
    group's all-reduce, which can fall back to gloo; ``fsdp``, which cannot; None: no
    collective, one trainer or ``train.reduce: exact``) over the workers of ``trainer_roles``
    (every non-reward worker in ``colocated`` mode), and each sequence-parallel replica of
    rollout workers (Ulysses' all-to-all: no fallback)."""

    trainers: str | None = None
    trainer_roles: tuple[str, ...] = ("trainer",)
    trainer_key: str = "cluster.local.trainer_workers"
    sp_key: str = "rollout.sequence_parallel"


def place(
    workers: Sequence[tuple[str, str]],
    gpus: Sequence[Gpu],
    *,
    workers_per_gpu: int = 1,
    sp_degree: int = 1,
    cpu_type: str = "cpu",
    cpu_reason: str | None = None,
    cpu_pinned: bool = True,
    collectives: Collectives = Collectives(),
    what: str = "cluster.local",
) -> Placement:
    """Place ``workers`` (``(name, role)``) on ``gpus`` by the rules of the module docstring;
    no GPU: all on CPU tagged ``cpu_type`` (pinned there unless ``cpu_pinned`` is False). A
    :class:`ConfigError` when they do not fit, or when two ranks of a group that needs NCCL
    (``collectives``) would share a GPU; a replicated trainer group that would is put on gloo
    (:attr:`Placement.notes` says so)."""
    if not gpus:
        slots = [Slot(n, r, (), cpu_type, cpu=cpu_pinned) for n, r in workers]
        return Placement(slots, [], cpu_reason or "no GPU visible")
    if workers_per_gpu < 1:
        raise ConfigError(f"{what}.workers_per_gpu ({workers_per_gpu}) must be at least 1")
    order = _ordered(gpus)
    capacity = len(order) * workers_per_gpu
    if len(workers) > capacity:
        raise ConfigError(_too_many(workers, order, workers_per_gpu, what))
    # one entry per worker seat, every GPU's first seat before any GPU's second: workers
    # spread over distinct GPUs first and share one only when there are more workers than GPUs
    free = [g for _ in range(workers_per_gpu) for g in order]
    taken: dict[str, Gpu] = {}
    units = _units(workers, sp_degree)
    for unit in units:
        seats = _seats(free, len(unit))
        for (name, _), seat in zip(unit, seats, strict=True):
            taken[name] = free[seat]
        for seat in sorted(seats, reverse=True):
            free.pop(seat)
    gloo, notes = _check_groups(workers, units, taken, collectives, sp_degree, len(order))
    slots = []
    for name, role in workers:
        g = taken[name]
        slots.append(
            Slot(name, role, (g.index,), g.type, (g.cuda_id,), backend="gloo" if name in gloo else "")
        )
    used = {g.index for g in taken.values()}
    return Placement(slots, [g for g in order if g.index not in used], notes=notes)


def _seats(free: list[Gpu], n: int) -> list[int]:
    """Positions in ``free`` for a unit of ``n`` workers (one group's ranks, or one worker), on
    ``n`` distinct GPUs where that can be: the first free seat of each of the first ``n`` GPUs
    of the first GPU type that has ``n`` with a free seat, else of any ``n`` GPUs in order
    (spanning types); only when fewer than ``n`` GPUs have a free seat, the first ``n`` seats
    of one type, else the first ``n`` free ones."""
    kinds = list(dict.fromkeys(g.type for g in free))
    for kind in kinds:
        firsts = _first_seats(free, kind)
        if len(firsts) >= n:
            return firsts[:n]
    firsts = _first_seats(free, None)
    if len(firsts) >= n:
        return firsts[:n]
    for kind in kinds:
        of_kind = [i for i, g in enumerate(free) if g.type == kind]
        if len(of_kind) >= n:
            return of_kind[:n]
    return list(range(n))


def _first_seats(free: list[Gpu], kind: str | None) -> list[int]:
    """The position of each GPU's first free seat in ``free`` (of type ``kind``; None: any)."""
    seen: set[int] = set()
    out = []
    for i, g in enumerate(free):
        if (kind is None or g.type == kind) and g.index not in seen:
            seen.add(g.index)
            out.append(i)
    return out


def _check_groups(
    workers: Sequence[tuple[str, str]],
    units: list[list[tuple[str, str]]],
    taken: dict[str, Gpu],
    collectives: Collectives,
    sp_degree: int,
    n_gpus: int,
) -> tuple[set[str], list[str]]:
    """Refuse a group that needs NCCL with two ranks on one GPU (one line, naming the key);
    returns the replicated trainer group's members when that group goes to gloo instead, and
    the note that says so."""
    if sp_degree > 1:
        for unit in units:
            if len(unit) == sp_degree and all(r == "rollout" for _, r in unit):
                _refuse_shared(
                    [n for n, _ in unit], taken, "a sequence-parallel replica", collectives.sp_key, n_gpus
                )
    if collectives.trainers is None:
        return set(), []
    group = sorted(n for n, r in workers if r in collectives.trainer_roles)
    if len(group) < 2 or not _shared(group, taken):
        return set(), []
    if collectives.trainers == "fsdp":
        _refuse_shared(group, taken, "the FSDP trainer group", collectives.trainer_key, n_gpus)
    a, b, gpu = _shared(group, taken)[0]
    note = (
        f"the trainer group ({len(group)} ranks) all-reduces on gloo, through host memory: {a} and {b} "
        f"share GPU {gpu}, and NCCL needs a GPU per rank"
    )
    return set(group), [note]


def _shared(group: Sequence[str], taken: dict[str, Gpu]) -> list[tuple[str, str, int]]:
    """(first, second, GPU) for each pair of ``group`` placed on one GPU (first ones first)."""
    first: dict[int, str] = {}
    out = []
    for name in group:
        g = taken[name].index
        if g in first:
            out.append((first[g], name, g))
        else:
            first[g] = name
    return out


def _refuse_shared(group: Sequence[str], taken: dict[str, Gpu], what: str, key: str, n_gpus: int) -> None:
    shared = _shared(group, taken)
    if not shared:
        return
    a, b, gpu = shared[0]
    raise ConfigError(
        f"{a} and {b} of {what} would share GPU {gpu} ({len(group)} ranks, {n_gpus} GPU"
        f"{'s' if n_gpus != 1 else ''}): NCCL refuses "
        f"two ranks of one group on one GPU; set {key} to at most {n_gpus} (or give the workers more GPUs)"
    )


def _too_many(workers: Sequence[tuple[str, str]], gpus: Sequence[Gpu], per_gpu: int, what: str) -> str:
    counts: dict[str, int] = {}
    for _, role in workers:
        counts[role] = counts.get(role, 0) + 1
    asked = ", ".join(f"{n} {r}" for r, n in counts.items())
    kinds: dict[str, int] = {}
    for g in gpus:
        kinds[g.type] = kinds.get(g.type, 0) + 1
    have = " + ".join(f"{n}x{t}" for t, n in kinds.items())
    share = (
        f"{what}.workers_per_gpu: {-(-len(workers) // len(gpus))} to share GPUs"
        if per_gpu == 1
        else f"a larger {what}.workers_per_gpu"
    )
    return (
        f"{len(workers)} workers ({asked}) do not fit {len(gpus)} GPUs ({have}) at {per_gpu} per GPU; "
        f"lower the worker counts or set {share}"
    )


def local_workers(rollout: int, trainer: int, reward: int = 0) -> list[tuple[str, str]]:
    """The embedded cluster's workers, named as :func:`~digen.cluster.cluster.start_local_cluster`
    names them."""
    return [
        (f"{role}-{i}", role)
        for role, n in (("rollout", rollout), ("trainer", trainer), ("reward", reward))
        for i in range(n)
    ]


def plan_local(cfg, gpus: Sequence[Gpu] | None = None) -> Placement:
    """The placement of ``cfg``'s embedded cluster (``cluster.local``) on ``gpus`` (default:
    :func:`discover`). A :class:`ConfigError` when its workers do not fit or ``gpus`` names a
    GPU that is not there."""
    cl = cfg.cluster.local
    workers = local_workers(cl.rollout_workers, cl.trainer_workers, cl.reward_workers)
    found = list(discover() if gpus is None else gpus)
    chosen, reason = _chosen(cfg, found)
    # gpus: [] and model.device cpu mean CPU whatever torch sees; so does auto without a GPU
    named_cuda = str(cfg.model.device).startswith("cuda") and cl.gpus == "auto"
    return place(
        workers,
        chosen,
        workers_per_gpu=cl.workers_per_gpu,
        sp_degree=cfg.rollout.sequence_parallel,
        cpu_type=cl.gpu_type,
        cpu_reason=reason,
        cpu_pinned=not named_cuda,
        collectives=collectives_of(cfg),
    )


def collectives_of(cfg) -> Collectives:
    """The groups of ``cfg``'s job that run collectives (see :class:`Collectives`)."""
    mode, train = cfg.schedule.mode, cfg.train
    roles = ("trainer", "rollout") if mode == "colocated" else ("trainer",)
    if mode == "reference":
        kind = None
    elif train.fsdp:
        kind = "fsdp"
    else:
        kind = "allreduce" if train.reduce == "allreduce" else None
    return Collectives(trainers=kind, trainer_roles=roles)


def _chosen(cfg, found: list[Gpu]) -> tuple[list[Gpu], str | None]:
    """The GPUs of ``found`` the config lets its workers use, or why none."""
    cl = cfg.cluster.local
    if str(cfg.model.device) == "cpu":
        return [], "model.device is cpu"
    if cl.gpus != "auto":
        ids = {g.index: g for g in found}
        missing = [i for i in cl.gpus if i not in ids]
        if missing:
            have = ", ".join(str(i) for i in sorted(ids)) or "none"
            raise ConfigError(
                f"cluster.local.gpus lists GPU {', '.join(map(str, missing))} but the GPUs here are: {have}"
            )
        found = [ids[i] for i in dict.fromkeys(cl.gpus)]
        if not found:
            return [], "cluster.local.gpus is []"
    if not found:
        return [], "no GPU visible"
    allowed = cfg.cluster.gpu_types
    if allowed:
        kept = [g for g in found if g.type in allowed]
        if not kept:
            kinds = ", ".join(sorted({g.type for g in found}))
            raise ConfigError(
                f"cluster.gpu_types is {allowed} but the GPUs here are {kinds}; add one of them to "
                f"cluster.gpu_types or set cluster.local.gpus: []"
            )
        found = kept
    return found, None


def parse_gpu_ids(spec: str) -> list[int] | None:
    """``--gpus`` of ``digen worker``: ``auto`` (None: every visible GPU) or ids ``0,1,2``."""
    if spec.strip() == "auto":
        return None
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts or not all(p.isdigit() for p in parts):
        raise ConfigError(f"--gpus ({spec}) must be auto or GPU ids such as 0,1,2,3")
    return [int(p) for p in parts]


def parse_roles(spec: str, n: int) -> list[str]:
    """``--role`` of a node with ``n`` GPUs: ``rollout`` (every GPU) or counts such as
    ``trainer=2,rollout`` (the entry without a count takes the rest) -> one role per worker."""
    roles: list[str] = []
    rest: str | None = None
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        role, _, count = part.partition("=")
        if role not in ("rollout", "trainer", "reward"):
            raise ConfigError(f"--role ({spec}): {role!r} must be rollout, trainer or reward")
        if not count:
            if rest is not None:
                raise ConfigError(f"--role ({spec}): only one role may take the rest (no =N)")
            rest = role
        elif not count.isdigit():
            raise ConfigError(f"--role ({spec}): {part!r} must look like trainer=2")
        else:
            roles += [role] * int(count)
    if len(roles) > n or (rest is None and len(roles) != n):
        raise ConfigError(f"--role ({spec}) names {len(roles)} workers for {n} GPUs")
    return roles + [rest] * (n - len(roles)) if rest is not None else roles
