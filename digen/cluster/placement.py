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
- One worker per GPU. Two workers share a GPU only with ``cluster.local.workers_per_gpu`` > 1;
  more workers than that allows is a :class:`~digen.errors.ConfigError` (exit 2, one line)
  before anything starts. GPUs left over stay idle (listed by ``digen plan``).
- No GPU (none visible, ``cluster.local.gpus: []``, ``model.device: cpu``): every worker runs
  on CPU, tagged ``cluster.local.gpu_type``, as before placement existed.

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

    def env(self) -> dict[str, str]:
        """The environment that pins the worker process to its GPUs (empty for a CPU worker:
        it inherits the parent's)."""
        if not self.gpus:
            return {}
        ids = self.cuda_ids or tuple(str(i) for i in self.gpus)
        return {
            "CUDA_VISIBLE_DEVICES": ",".join(ids),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "DIGEN_DEVICE": "cuda:0",
        }

    def to_json(self) -> dict:
        return {"worker": self.worker, "role": self.role, "gpus": list(self.gpus), "gpu_type": self.gpu_type}


@dataclass(frozen=True)
class Placement:
    """Every worker's GPUs (:func:`place`), the GPUs left idle, and why none, if none."""

    slots: list[Slot]
    idle: list[Gpu] = field(default_factory=list)
    cpu_reason: str | None = None
    """Set when the workers run on CPU: why."""

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
        return head + rows


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


def place(
    workers: Sequence[tuple[str, str]],
    gpus: Sequence[Gpu],
    *,
    workers_per_gpu: int = 1,
    sp_degree: int = 1,
    cpu_type: str = "cpu",
    cpu_reason: str | None = None,
    what: str = "cluster.local",
) -> Placement:
    """Place ``workers`` (``(name, role)``) on ``gpus`` by the rules of the module docstring;
    no GPU: all on CPU tagged ``cpu_type``. A :class:`ConfigError` when they do not fit."""
    if not gpus:
        slots = [Slot(n, r, (), cpu_type) for n, r in workers]
        return Placement(slots, [], cpu_reason or "no GPU visible")
    if workers_per_gpu < 1:
        raise ConfigError(f"{what}.workers_per_gpu ({workers_per_gpu}) must be at least 1")
    order = _ordered(gpus)
    capacity = len(order) * workers_per_gpu
    if len(workers) > capacity:
        raise ConfigError(_too_many(workers, order, workers_per_gpu, what))
    free = [g for g in order for _ in range(workers_per_gpu)]  # one entry per worker seat
    taken: dict[str, Gpu] = {}
    for unit in _units(workers, sp_degree):
        seats = _seats(free, len(unit))
        for (name, _), seat in zip(unit, seats, strict=True):
            taken[name] = free[seat]
        for seat in sorted(seats, reverse=True):
            free.pop(seat)
    slots = []
    for name, role in workers:
        g = taken[name]
        slots.append(Slot(name, role, (g.index,), g.type, (g.cuda_id,)))
    used = {g.index for g in taken.values()}
    return Placement(slots, [g for g in order if g.index not in used])


def _seats(free: list[Gpu], n: int) -> list[int]:
    """Positions in ``free`` for a unit of ``n`` workers: the first ``n`` of the first GPU type
    that has ``n`` free, else the first ``n`` free ones."""
    for kind in dict.fromkeys(g.type for g in free):
        of_kind = [i for i, g in enumerate(free) if g.type == kind]
        if len(of_kind) >= n:
            return of_kind[:n]
    return list(range(n))


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
    return place(
        workers,
        chosen,
        workers_per_gpu=cl.workers_per_gpu,
        sp_degree=cfg.rollout.sequence_parallel,
        cpu_type=cl.gpu_type,
        cpu_reason=reason,
    )


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
