"""``digen bench --dataplane``: the data plane at the sizes the peers train, beside the path it replaced.

Synthetic tensors of real sizes (:data:`SIZES`: the trained tensors of SD3.5-M LoRA r32, FLUX
LoRA r64, Qwen-Image LoRA r64, and a full-model stand-in), moved by the real transport
between real worker processes of a local Dask cluster of 2 trainers and 2 rollout workers,
with a real Redis. One round per size; per round:

- **reduce**: each trainer holds a running gradient sum of the size
  (:class:`~digen.dataplane.reduce.TaskSum`); they all-reduce it (gloo);
- **step**: each trainer steps AdamW on the mean (:class:`~digen.optim.ParameterStore`, with
  the moments of an earlier step); skipped for the full-model stand-in, whose replicated
  AdamW (16 bytes a parameter per trainer) does not fit this machine, and which digen trains
  sharded (``train.fsdp``);
- **distribute**: each trainer serves the new version as a blob in the rollout's dtype
  (bfloat16); both rollout workers fetch it at once, bucketed over both trainers
  (:func:`~digen.dataplane.weights.fetch_version`); the phase ends when the last has it;
- **trajectory**: a rollout worker keeps one FLUX group as a blob (16 samples x 7 latents
  x 4096 tokens x 64 float32, 117 MiB), a trainer fetches it.

And the **digest** (:mod:`digen.dataplane.digest`): every blob is hashed when it is stored
and checked when it lands. Per round, the seconds a trainer spent storing the version (the cast
to bfloat16, and its manifest: every tensor hashed with
:data:`~digen.dataplane.digest.ALGORITHM`, over :data:`~digen.dataplane.digest.THREADS`
threads) and
the seconds a rollout worker's hashing of what it received takes on its own (an upper bound of
what verification adds to the distribute phase: the fetch hashes each piece while the next one
is on the wire); and once, at the FLUX LoRA r64 size (or the first size), each candidate hash
over the float32 gradient and its bfloat16 copy, on one thread and on the pool.

And the **link** itself: raw TCP between a rollout and a trainer process (one socket, one
``sendall`` of 256 MiB, no framing), so that each phase's rate reads as a fraction of what
the machine's link carries: the simulator (:mod:`digen.sim.dataplane`) takes these fractions
to a testbed's network bandwidth.

Beside it, **the path this replaced** (what digen did before): each of 4 train tasks SETs its
gradient in Redis as safetensors, the controller GETs them all, sums them, steps AdamW and SETs
the new version, which every rollout worker GETs. Redis refuses a value over 512 MiB, so it
runs at 250 MiB; :func:`compare` scales its per-byte time to the other sizes.

Counted per phase: wall seconds; the bytes Redis took in and gave out (``INFO stats``); the
bytes through the controller's process (this one): what its Redis client sent and received,
counted at the socket (:func:`~digen.controlplane.redis_conn.count_bytes`), plus the results it
gathered from the workers (their msgpack size); per trainer, the bytes it wrote during the
all-reduce (``/proc/self/io`` wchar: gloo writes with ``write``/``writev``) over the gradient's
size (a ring all-reduce sends ``2 (N-1)/N`` of it).
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

MiB = 2**20

SIZES: dict[str, int] = {
    "sd3.5-m-lora-r32": 72 * MiB,
    "flux-lora-r64": 684 * MiB,
    "qwen-image-lora-r64": 1620 * MiB,
    "full-4gib": 4096 * MiB,
}
"""Trained tensors in float32 (LoRA sizes with the peers' target modules and ranks, counted on
the real architectures); the last stands in for a full fine-tune (a size whose name starts with
``full`` has no optimizer step: see the module docstring)."""
TRAINERS, ROLLOUTS = 2, 2
"""The bench's local cluster."""
OLD_PATH_BYTES = 250 * MiB
OLD_PATH_TASKS = 4
TENSORS = 64
"""A size is cut into this many tensors (an adapter is hundreds; the per-tensor overhead is
small either way)."""
TRAJECTORY_SHAPE = (16, 7, 4096, 64)
"""One FLUX group: 16 samples x (6 steps + 1) latents x 4096 packed tokens x 64 channels."""
TRAJECTORY_BYTES = 16 * 7 * 4096 * 64 * 4 + 16 * 6 * 4

log = logging.getLogger(__name__)


@dataclass
class Round:
    """One size's measurements (seconds; bytes)."""

    name: str
    bytes: int
    path: str
    """``dataplane`` (digen's) or ``through-redis`` (the path it replaced)."""
    reduce_s: float = 0.0
    step_s: float | None = 0.0
    distribute_s: float = 0.0
    trajectory_s: float | None = None
    redis_bytes: int = 0
    controller_bytes: int = 0
    reduce_traffic_per_trainer: list[float] = field(default_factory=list)
    """Bytes each trainer wrote during the reduction, over the gradient's size."""
    link_bytes_per_s: float | None = None
    """The raw link's rate on this machine (measured once per bench)."""
    digest_put_s: float | None = None
    """A trainer's time to hash the version's bfloat16 copy (its manifest: made once, at the
    first fetch; timed here apart)."""
    digest_s: float | None = None
    """A rollout worker's time to hash the version it received (bfloat16), on its own (one
    rollout worker at a time)."""
    digests: list[dict] = field(default_factory=list)
    """Candidate hashes at this round's size: ``{algorithm, dtype, threads, s, bytes}``."""

    def digest_share(self) -> float | None:
        """The digest's cost as a fraction of the transfer: a rollout's hashing of the version
        it received over the distribute phase (an upper bound: the fetch overlaps it)."""
        if self.digest_s is None or self.distribute_s <= 0:
            return None
        return self.digest_s / self.distribute_s

    def efficiency(self) -> dict[str, float]:
        """Each transfer phase's rate as a fraction of the raw link's: reduce (bytes each
        trainer sent / s), distribute (bytes every rollout received, bfloat16, / s, per
        trainer link: they serve in parallel), trajectory (bytes / s)."""
        if not self.link_bytes_per_s or self.path != "dataplane":
            return {}
        link = self.link_bytes_per_s
        sent = max(self.reduce_traffic_per_trainer or [0.0]) * self.bytes
        out = {"reduce": sent / self.reduce_s / link if self.reduce_s > 0 else 0.0}
        if self.distribute_s > 0:  # every rollout worker takes in the bfloat16 half; the trainers serve it
            received = ROLLOUTS * self.bytes / 2
            out["distribute"] = received / TRAINERS / self.distribute_s / link
        if self.trajectory_s:
            out["trajectory"] = TRAJECTORY_BYTES / self.trajectory_s / link
        return out

    @property
    def total_s(self) -> float:
        return self.reduce_s + (self.step_s or 0.0) + self.distribute_s


def _gathered(*results) -> int:
    """Bytes of what the controller gathered from the workers (their msgpack size)."""
    import msgpack

    return sum(len(msgpack.packb(x, use_bin_type=True)) for x in results)


def _wchar() -> int:
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["wchar"])


def _redis_bytes(r) -> int:
    s = r.info("stats")
    return int(s["total_net_input_bytes"]) + int(s["total_net_output_bytes"])


def _tensors(nbytes: int, seed: int, scale: float = 1.0) -> dict:
    """``nbytes`` of float32 in :data:`TENSORS` tensors (random, seeded)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n = nbytes // 4 // TENSORS
    return {f"t{i:03d}": torch.randn(n, generator=g) * scale for i in range(TENSORS)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- in the trainer workers -------------------------------------------------------------------
def _join(job: str, key: str) -> None:
    """This worker process holds the bench job's blob key (a real worker reads its job's from
    the job's Redis)."""
    from digen.dataplane.auth import keyring

    keyring().add(job, bytes.fromhex(key))


def trainer_round(rank: int, world: int, port: int, nbytes: int, job: str, step: bool, key: str) -> dict:
    """One trainer's part: build a running sum and (with ``step``) an AdamW store of the size;
    all-reduce; step; serve the new version in bfloat16. Returns timings and traffic."""
    import torch
    import torch.distributed as dist

    _join(job, key)
    from digen.config import TrainConfig
    from digen.core import blobnames
    from digen.dataplane.blobs import local_server, local_store
    from digen.dataplane.reduce import TaskSum, all_reduce_sum
    from digen.optim import ParameterStore

    torch.set_num_threads(1)
    sums = TaskSum()
    sums.add("task", _tensors(nbytes, seed=10 + rank, scale=1e-3))
    store = None
    if step:  # AdamW with its moments (a first step on the sum: it stays in place, scaled)
        store = ParameterStore(_tensors(nbytes, seed=1), TrainConfig())
        store.step(sums.total, 1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        dist.barrier()
        w0, t0 = _wchar(), time.time()
        all_reduce_sum(sums.flat)
        t1, w1 = time.time(), _wchar()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    t2 = time.time()
    if store is not None:
        store.step(sums.total, 2)
        weights = {k: p.detach() for k, p in store.params.items()}
    else:
        weights = sums.total
    t3 = time.time()
    server = local_server()
    version = {k: v.to(torch.bfloat16) for k, v in weights.items()}
    t4 = time.time()
    local_store().put(blobnames.weights(job, 1), version).digest  # noqa: B018 - hash every tensor now (else the first fetch would)
    t5 = time.time()
    del store, weights, sums, version
    return {
        "reduce_s": t1 - t0,
        "step_s": t3 - t2 if step else None,
        "put_s": t5 - t4,
        "traffic": w1 - w0,
        "addr": server.address,
    }


def rollout_fetch(holders: list[str], job: str, start: int, key: str) -> dict:
    """One rollout worker takes in version 1 from the trainers (bucketed, bfloat16, every
    tensor checked against its digest as it lands); then, for the report, how long hashing
    all of it takes on its own."""
    import torch

    from digen.core import blobnames
    from digen.dataplane.weights import fetch_version

    _join(job, key)
    t0 = time.time()
    got = fetch_version(holders, blobnames.weights(job, 1), dtype=torch.bfloat16, start=start)
    t1 = time.time()
    _RECEIVED["version"] = got
    n = sum(v.numel() * v.element_size() for v in got.values())
    return {"s": t1 - t0, "bytes": n}


_RECEIVED: dict = {}
"""What :func:`rollout_fetch` received, kept for :func:`hash_received` (then dropped)."""


def hash_received() -> float:
    """Seconds to hash what this rollout worker received, on its own: run on one rollout
    worker at a time, so that the other's hashing does not share the cores."""
    from digen.dataplane.digest import tensor_digests

    got = _RECEIVED.pop("version")
    t0 = time.time()
    tensor_digests(got)
    return time.time() - t0


DIGEST_ROUND = "flux-lora-r64"
"""The size whose candidate hashes the bench measures (else its first size)."""


def digest_candidates(nbytes: int) -> list[dict]:
    """Each candidate hash over ``nbytes`` of float32 and its bfloat16 copy, one thread and
    the pool (pieces of :data:`~digen.dataplane.digest.CHUNK`): the cryptographic SHA-256 and
    BLAKE2b, and the non-cryptographic CRC-32 (zlib) and XXH3-128 (what digen uses, from the
    ``xxhash`` package)."""
    import hashlib
    import zlib

    import torch

    from digen.dataplane.digest import CHUNK, THREADS, pool, raw_bytes

    algos: dict[str, Callable[[memoryview], object]] = {
        "sha256": lambda m: hashlib.sha256(m).digest(),
        "blake2b": lambda m: hashlib.blake2b(m).digest(),
        "crc32": zlib.crc32,
    }
    try:
        import xxhash

        algos["xxh3-128"] = lambda m: xxhash.xxh3_128(m).digest()
    except ImportError:
        pass
    f32 = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(5))
    out = []
    for dtype, t in (("float32", f32), ("bfloat16", f32.to(torch.bfloat16))):
        data = raw_bytes(t)
        pieces = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)]
        for name, fn in algos.items():
            for threads in (1, THREADS):
                t0 = time.perf_counter()
                if threads == 1:
                    for p in pieces:
                        fn(p)
                else:
                    list(pool().map(fn, pieces))
                out.append(
                    {
                        "algorithm": name,
                        "dtype": dtype,
                        "threads": threads,
                        "s": time.perf_counter() - t0,
                        "bytes": len(data),
                    }
                )
    return out


def keep_trajectory(job: str, key: str) -> dict:
    """A rollout worker keeps one FLUX group as a blob (as a generation task does)."""
    import torch

    from digen.core.blobnames import trajectories
    from digen.dataplane.blobs import local_server, local_store

    _join(job, key)
    name = trajectories(job, "gen:0:0")
    latents = torch.randn(*TRAJECTORY_SHAPE, generator=torch.Generator().manual_seed(3))
    local_store().put(name, {"latents": latents, "log_probs": torch.zeros(16, 6)})
    return {"addr": local_server().address, "name": name}


def fetch_trajectory(addr: str, name: str, job: str, key: str) -> dict:
    from digen.dataplane.blobs import fetch

    _join(job, key)
    t0 = time.time()
    got, _ = fetch(addr, name, names=["latents", "log_probs"])
    return {"s": time.time() - t0, "bytes": sum(v.numel() * v.element_size() for v in got.values())}


def drop_blobs(job: str) -> None:
    from digen.dataplane.auth import keyring
    from digen.dataplane.blobs import local_store

    local_store().drop_where(lambda n: not n.startswith(job + ":"))
    keyring().drop(job)


# --- the raw link ------------------------------------------------------------------------------
LINK_BYTES = 256 * MiB


def link_listen(nbytes: int) -> dict:
    """Serve ``nbytes`` once, raw (a thread of this worker): the other side's rate is the link's."""
    import threading

    sock = socket.create_server(("127.0.0.1", 0))
    payload = memoryview(bytearray(nbytes))

    def serve() -> None:
        conn, _ = sock.accept()
        with conn:
            conn.sendall(payload)
        sock.close()

    threading.Thread(target=serve, daemon=True).start()
    return {"addr": f"127.0.0.1:{sock.getsockname()[1]}"}


def link_receive(addr: str, nbytes: int) -> dict:
    host, port = addr.rsplit(":", 1)
    buf = memoryview(bytearray(nbytes))
    t0 = time.time()
    with socket.create_connection((host, int(port))) as s:
        got = 0
        while got < nbytes:
            n = s.recv_into(buf[got:])
            if n == 0:
                break
            got += n
    return {"s": time.time() - t0, "bytes": got}


def measure_link(client, sender: str, receiver: str, nbytes: int = LINK_BYTES) -> float:
    """Raw TCP bytes per second from ``sender``'s process to ``receiver``'s."""
    where = client.submit(link_listen, nbytes, workers=[sender], pure=False).result()
    got = client.submit(link_receive, where["addr"], nbytes, workers=[receiver], pure=False).result()
    return got["bytes"] / got["s"]


# --- the path this replaced -------------------------------------------------------------------
def old_put_gradient(redis_url: str, key: str, nbytes: int, seed: int) -> float:
    """A train task of the old path: its gradient into Redis as safetensors."""
    from digen.controlplane.codec import pack_tensors
    from digen.controlplane.redis_conn import connect

    r = connect(redis_url)
    t0 = time.time()
    r.set(key, pack_tensors(_tensors(nbytes, seed=seed, scale=1e-3)))
    r.close()
    return time.time() - t0


def old_get_weights(redis_url: str, key: str) -> float:
    """A rollout worker of the old path takes in the version from Redis."""
    from digen.controlplane.codec import unpack_tensors
    from digen.controlplane.redis_conn import connect

    r = connect(redis_url)
    t0 = time.time()
    unpack_tensors(r.get(key))
    r.close()
    return time.time() - t0


# --- the driver (the controller's process) ----------------------------------------------------
def run_dataplane_bench(
    sizes: dict[str, int], progress: Callable[[str], None] | None = None, old_bytes: int = OLD_PATH_BYTES
) -> list[Round]:
    """Every size's round of the data plane (``{name: bytes}``), then the path it replaced
    (at ``old_bytes`` a task)."""
    from digen.cluster.cluster import close_local_cluster, list_workers, start_local_cluster
    from digen.controlplane.redis_conn import connect, count_bytes, embedded_url

    say = progress or (lambda _m: None)
    r = connect(None)
    url = embedded_url(r)
    counted = connect(url)
    through = count_bytes(counted)
    cluster, client = start_local_cluster(ROLLOUTS, TRAINERS, "cpu", 1, start_method="spawn")
    try:
        workers = list_workers(client)
        trainers = [w.address for w in workers if w.role.value == "trainer"]
        rollouts = [w.address for w in workers if w.role.value == "rollout"]
        rounds = []
        link = measure_link(client, rollouts[0], trainers[0])
        say(f"raw link: {link / 2**30:.2f} GiB/s")
        hashed = DIGEST_ROUND if DIGEST_ROUND in sizes else next(iter(sizes), None)
        for name, nbytes in sizes.items():
            say(f"data plane: {name} ({nbytes / MiB:g} MiB)")
            rounds.append(_dataplane_round(client, r, counted, through, trainers, rollouts, name, nbytes))
            rounds[-1].link_bytes_per_s = link
            if name == hashed:
                say(f"candidate digests at {name}")
                fut = client.submit(digest_candidates, nbytes, workers=[rollouts[0]], pure=False)
                rounds[-1].digests = fut.result()
        say(f"the path through Redis: {OLD_PATH_TASKS} tasks x {old_bytes / MiB:g} MiB")
        rounds.append(_old_round(client, r, counted, through, url, trainers, rollouts, old_bytes))
        return rounds
    finally:
        client.close()
        close_local_cluster(cluster)
        counted.close()
        r.close()


def _dataplane_round(
    client, r, counted, through, trainers: list[str], rollouts: list[str], name: str, nbytes: int
) -> Round:
    from digen.dataplane.auth import new_key

    job = f"bench-dp-{name}"
    key = new_key().hex()  # the bench's job key (a controller keeps its job's in the job's Redis)
    step = not name.startswith("full")
    io0, redis0 = through.total, _redis_bytes(r)
    counted.set(f"digen:{job}:status", "running")  # what a controller does with Redis: small values
    port = _free_port()
    futs = [
        client.submit(trainer_round, i, len(trainers), port, nbytes, job, step, key, workers=[a], pure=False)
        for i, a in enumerate(trainers)
    ]
    parts = client.gather(futs)
    holders = [p["addr"] for p in parts]
    got = client.gather(
        [
            client.submit(rollout_fetch, holders, job, i, key, workers=[a], pure=False)
            for i, a in enumerate(rollouts)
        ]
    )
    hashed = [client.submit(hash_received, workers=[a], pure=False).result() for a in rollouts]
    traj = client.submit(keep_trajectory, job, key, workers=[rollouts[0]], pure=False).result()
    moved = client.submit(
        fetch_trajectory, traj["addr"], traj["name"], job, key, workers=[trainers[0]], pure=False
    ).result()
    for a in trainers + rollouts:
        client.submit(drop_blobs, job, workers=[a], pure=False).result()
    return Round(
        name,
        nbytes,
        "dataplane",
        reduce_s=max(p["reduce_s"] for p in parts),
        step_s=max(p["step_s"] for p in parts) if step else None,
        distribute_s=max(g["s"] for g in got),
        trajectory_s=moved["s"],
        redis_bytes=_redis_bytes(r) - redis0,
        controller_bytes=through.total - io0 + _gathered(*parts, *got, traj, moved),
        reduce_traffic_per_trainer=[p["traffic"] / nbytes for p in parts],
        digest_put_s=max(p["put_s"] for p in parts),
        digest_s=max(hashed),
    )


def _old_round(
    client, r, counted, through, url: str, trainers: list[str], rollouts: list[str], nbytes: int
) -> Round:
    """The path through Redis and the controller, as digen ran it before (see the module docstring)."""
    from digen.config import TrainConfig
    from digen.controlplane.codec import pack_tensors, unpack_tensors
    from digen.optim import ParameterStore

    keys = [f"digen:bench-old:data:train:0:{i}" for i in range(OLD_PATH_TASKS)]
    store = ParameterStore(_tensors(nbytes, seed=1), TrainConfig())
    store.step(_tensors(nbytes, seed=2, scale=1e-3), 1)
    io0, redis0 = through.total, _redis_bytes(r)
    t0 = time.time()
    futs = [
        client.submit(
            old_put_gradient, url, k, nbytes, 10 + i, workers=[trainers[i % len(trainers)]], pure=False
        )
        for i, k in enumerate(keys)
    ]
    client.gather(futs)
    total = None
    for k in keys:  # the controller reads every gradient back and sums in task order
        g, _ = unpack_tensors(counted.get(k))
        if total is None:
            total = g
        else:
            for name, v in g.items():
                total[name] += v
    t1 = time.time()
    assert total is not None
    store.step(total, OLD_PATH_TASKS)
    t2 = time.time()
    counted.set("digen:bench-old:weights:1", pack_tensors(store.weights(), {"version": "1"}))
    secs = client.gather(
        [
            client.submit(old_get_weights, url, "digen:bench-old:weights:1", workers=[a], pure=False)
            for a in rollouts
        ]
    )
    t3 = time.time() - t2  # publish, then every rollout worker's read
    del total, store
    out = Round(
        f"through-redis-{OLD_PATH_TASKS}x{nbytes / MiB:g}mib",
        nbytes,
        "through-redis",
        reduce_s=t1 - t0,
        step_s=t2 - t1,
        distribute_s=t3,
        redis_bytes=_redis_bytes(r) - redis0,
        controller_bytes=through.total - io0 + _gathered(*secs),
    )
    r.delete(*keys, "digen:bench-old:weights:1")
    return out


def compare(rounds: list[Round]) -> dict[str, dict]:
    """Per data-plane round: the path through Redis scaled to its size by that path's measured
    seconds per byte, and the speed-up of reduce + step + distribute."""
    old = next((x for x in rounds if x.path == "through-redis"), None)
    out = {}
    for x in rounds:
        if x.path != "dataplane" or old is None:
            continue
        scaled = old.total_s * x.bytes / old.bytes
        out[x.name] = {
            "through_redis_scaled_s": scaled,
            "dataplane_s": x.total_s,
            "speedup": scaled / x.total_s if x.total_s > 0 else float("inf"),
            "fits_redis": x.bytes <= 512 * MiB,
        }
    return out


def write_dataplane_report(
    rounds: list[Round], out: Path, command: str, commit: str, date: str
) -> tuple[Path, Path]:
    """``bench-dataplane.json`` and ``bench-dataplane.md`` (a table for docs/benchmarks.md)."""
    out.mkdir(parents=True, exist_ok=True)
    data = {
        "command": command,
        "commit": commit,
        "date": date,
        "rounds": [
            asdict(x) | {"total_s": x.total_s, "efficiency": x.efficiency(), "digest_share": x.digest_share()}
            for x in rounds
        ],
        "compare": compare(rounds),
    }
    (out / "bench-dataplane.json").write_text(json.dumps(data, indent=1))
    lines = [
        f"`{command}` at {commit}, {date}; 2 trainers + 2 rollout workers (local processes, gloo, loopback).",
        "",
        "| tensors | path | reduce s | step s | distribute s | total s | trajectory s | through Redis | through the controller | reduce traffic / trainer |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in rounds:
        step = "-" if x.step_s is None else f"{x.step_s:.2f}"
        traj = "-" if x.trajectory_s is None else f"{x.trajectory_s:.2f}"
        traffic = ", ".join(f"{t:.2f}x" for t in x.reduce_traffic_per_trainer) or "-"
        lines.append(
            f"| {x.name} ({x.bytes / MiB:g} MiB) | {x.path} | {x.reduce_s:.2f} | {step} | {x.distribute_s:.2f} | "
            f"{x.total_s:.2f} | {traj} | {_human(x.redis_bytes)} | {_human(x.controller_bytes)} | {traffic} |"
        )
    cmp = compare(rounds)
    if cmp:
        lines += [
            "",
            "| tensors | through Redis, scaled (s) | data plane (s) | speed-up |",
            "|---|---|---|---|",
        ]
        for name, c in cmp.items():
            note = "" if c["fits_redis"] else " (over Redis's 512 MiB value limit: cannot run that way)"
            lines.append(
                f"| {name} | {c['through_redis_scaled_s']:.2f}{note} | {c['dataplane_s']:.2f} | {c['speedup']:.1f}x |"
            )
    lines += _digest_lines(rounds)
    md = out / "bench-dataplane.md"
    md.write_text("\n".join(lines) + "\n")
    return out / "bench-dataplane.json", md


def _digest_lines(rounds: list[Round]) -> list[str]:
    """The digest's cost per round, and the candidate hashes where they were measured."""
    rows = [x for x in rounds if x.digest_s is not None]
    if not rows:
        return []
    lines = [
        "",
        "| tensors | store the version (hash) s | hash what landed s | distribute s | hash / distribute |",
        "|---|---|---|---|---|",
    ]
    for x in rows:
        share = x.digest_share()
        lines.append(
            f"| {x.name} ({x.bytes / MiB:g} MiB) | {x.digest_put_s or 0:.3f} | {x.digest_s:.3f} | "
            f"{x.distribute_s:.2f} | {'-' if share is None else f'{100 * share:.1f}%'} |"
        )
    for x in rounds:
        if x.digests:
            lines += [
                "",
                f"Candidate digests at {x.name} ({x.bytes / MiB:g} MiB float32, and its bfloat16 copy):",
                "",
                "| algorithm | dtype | threads | s | GB/s |",
                "|---|---|---|---|---|",
            ]
            for d in x.digests:
                rate = d["bytes"] / d["s"] / 1e9 if d["s"] > 0 else float("inf")
                lines.append(
                    f"| {d['algorithm']} | {d['dtype']} | {d['threads']} | {d['s']:.3f} | {rate:.2f} |"
                )
    return lines


def _human(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


__all__ = ["SIZES", "Round", "compare", "run_dataplane_bench", "write_dataplane_report"]
