"""``digen doctor --gpu-bench``: a few minutes of measurements that say whether digen's GPU
paths work on this machine, and how fast.

Parts, each in its own child process (a crash or a hang there is reported, not fatal; each has
a time limit), each skipped with its reason where it cannot run:

- ``allreduce``: the trainer group's all-reduce as digen forms it, 256 MiB of bfloat16 over
  every GPU (needs two: NCCL does not put two ranks on one GPU): one rank per GPU placed by
  digen's placement (each sees only its own GPU, ``CUDA_VISIBLE_DEVICES``, and computes on
  ``cuda:0``), the group formed through digen's rendezvous and Redis store
  (:func:`digen.parallel.comm.join_process_group`, the embedded Redis) with digen's NCCL
  settings and timeout; the algorithm and bus bandwidth (nccl-tests' definitions), the
  backend, the timeout, each rank's visible GPU. Every GPU visible to every rank would let
  NCCL use paths (and a TCP store) no digen trainer has: it would not measure digen.
- ``weight_fetch``: the data plane's bucketed fetch (:func:`digen.dataplane.weights.fetch_version`)
  of a 684 MiB adapter, from a process holding it on one GPU (copied to host memory and served
  by its blob server, as a trainer does) to a process on another GPU (each bucket copied to its
  device as it lands, as a rollout worker does); one GPU: both processes on it.
- ``rollout_train``: the reference loop (:func:`digen.reference.run_reference`) on one GPU, two
  iterations of one prompt group of 4 images at 512 px, 10 steps, bfloat16 with LoRA 32/64,
  staleness 0, on a random-weight transformer at SD3.5-Medium's dimensions (24 MMDiT blocks,
  24 heads of 64; :func:`digen.models.make_tiny_model`, with the tiny text encoders and VAE):
  images/s of generation and of training on the second iteration (the first one warms up),
  the process's peak GPU memory, and the on-policy PPO ratio's max |ratio - 1| and clipped
  fraction in bfloat16 (exactly on policy: any deviation is numerics).

It writes ``gpu-bench.json`` and ``gpu-bench.md`` (one table) to its folder.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import queue as queue_mod
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from digen.core import blobnames

ADAPTER_MIB = 684
ALLREDUCE_MIB = 256
PART_TIMEOUT_S = {"allreduce": 120.0, "weight_fetch": 180.0, "rollout_train": 420.0}
SD35_MEDIUM = {"layers": 24, "heads": 24, "head_dim": 64}
"""SD3.5-Medium's transformer: 24 MMDiT blocks, 24 heads of 64 (width 1536)."""


def cuda_devices() -> tuple[int, str | None]:
    """(number of CUDA devices torch sees, why none when 0)."""
    try:
        import torch
    except ImportError:
        return 0, "torch is not installed"
    try:
        if not torch.cuda.is_available():
            return 0, "no GPU (torch.cuda.is_available() is false)"
        return torch.cuda.device_count(), None
    except RuntimeError as exc:
        return 0, f"CUDA is broken here ({exc})"


def run_gpu_bench(out: Path, log: Callable[[str], None] | None = None) -> dict:
    """Run every part that this machine allows; write and return the results."""
    say = log or (lambda line: None)
    n, why = cuda_devices()
    result: dict = {"gpus": n, "parts": {}, "skipped": {}}
    parts: list[tuple[str, Callable, tuple]] = []
    if n == 0:
        for name in PART_TIMEOUT_S:
            result["skipped"][name] = why
    else:
        result["device"] = _device_names(n)
        if n >= 2:
            parts.append(("allreduce", _allreduce_part, (n,)))
        else:
            result["skipped"]["allreduce"] = "one GPU: an NCCL all-reduce needs two"
        parts.append(("weight_fetch", _fetch_part, ("cuda:0", "cuda:1" if n >= 2 else "cuda:0")))
        parts.append(("rollout_train", _rollout_train_part, (str(out / "model"), str(out / "run"))))
    for name, fn, args in parts:
        say(f"gpu-bench: {name}...")
        result["parts"][name] = _in_child(fn, args, PART_TIMEOUT_S[name])
        say(f"gpu-bench: {name}: {_short(result['parts'][name])}")
    for name, reason in result["skipped"].items():
        say(f"gpu-bench: {name} skipped: {reason}")
    result["summary"] = summary_lines(result)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-bench.json").write_text(json.dumps(result, indent=1))
    (out / "gpu-bench.md").write_text("\n".join(markdown(result)) + "\n")
    result["files"] = [str(out / "gpu-bench.json"), str(out / "gpu-bench.md")]
    return result


def _device_names(n: int) -> list[str]:
    import torch

    return [torch.cuda.get_device_name(i) for i in range(n)]


def _short(part: dict) -> str:
    if "error" in part:
        return "failed: " + part["error"].splitlines()[0][:200]
    return ", ".join(f"{k} {v}" for k, v in part.items() if not isinstance(v, (dict, list)))


def summary_lines(result: dict) -> list[str]:
    lines = [f"{name}: {_short(p)}" for name, p in result["parts"].items()]
    lines += [f"{name}: skipped ({why})" for name, why in result["skipped"].items()]
    return lines


def markdown(result: dict) -> list[str]:
    """One Markdown table: part, result, value."""
    devices = ", ".join(result.get("device", [])) or "no GPU"
    lines = [f"GPU benchmark ({devices})", "", "| part | measure | value |", "|---|---|---|"]
    for name, p in result["parts"].items():
        if "error" in p:
            lines.append(f"| {name} | failed | {p['error'].splitlines()[0][:120]} |")
            continue
        for k, v in p.items():
            if not isinstance(v, (dict, list)):
                lines.append(f"| {name} | {k} | {v} |")
    for name, why in result["skipped"].items():
        lines.append(f"| {name} | skipped | {why} |")
    return lines


# ------------------------------------------------------------------------------------------
# running a part in a child process


def _in_child(fn: Callable, args: tuple, timeout_s: float) -> dict:
    """``fn(*args)``'s dict from a spawned child, or ``{"error": ...}`` (raised, died, timed out)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q, fn, args))  # not a daemon: a part starts processes
    p.start()
    try:
        return q.get(timeout=timeout_s)
    except queue_mod.Empty:
        return {"error": f"no result within {timeout_s:.0f} s (exit code {p.exitcode})"}
    finally:
        p.join(5)
        if p.is_alive():
            p.terminate()
            p.join(5)


def _child(q, fn: Callable, args: tuple) -> None:
    try:
        q.put(fn(*args))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which goes on
        q.put({"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"})


# ------------------------------------------------------------------------------------------
# NCCL all-reduce


def allreduce_ranks(n: int) -> list[dict[str, str]]:
    """The environment of each of ``n`` trainer ranks as digen places them on this machine
    (:func:`digen.cluster.placement.place` over :func:`~digen.cluster.placement.discover`'s
    GPUs): each pinned to its own GPU by ``CUDA_VISIBLE_DEVICES`` and computing on
    ``DIGEN_DEVICE`` (``cuda:0``), as a trainer worker does."""
    from digen.cluster.placement import discover, place

    gpus = discover()
    placed = place([(f"trainer-{i}", "trainer") for i in range(n)], gpus)
    if any(not slot.gpus for slot in placed.slots):
        raise RuntimeError(
            f"digen's placement sees {len(gpus)} GPU(s) (nvidia-smi), torch {n}: "
            "it cannot pin one rank to each GPU as it pins trainers"
        )
    return [slot.env() for slot in placed.slots]


def _allreduce_part(
    n: int, redis_url: str | None = None, envs: list[dict[str, str]] | None = None, mib: int = ALLREDUCE_MIB
) -> dict:
    """The trainer group's all-reduce as digen runs it: ``n`` ranks placed by digen's placement
    (one GPU each, :func:`allreduce_ranks`), the group formed by digen's rendezvous and store
    (:func:`digen.parallel.comm.join_process_group` over a
    :class:`~digen.parallel.store.RedisStore` in the embedded Redis, or ``redis_url``), with its
    NCCL settings and collective timeout; ``mib`` MiB of bfloat16. ``envs``: each rank's
    environment instead of the placement's (the tests pin them to the CPU: gloo, same path)."""
    import secrets

    from digen.controlplane.redis_conn import connect, embedded_url

    r = connect(redis_url)
    url = redis_url or embedded_url(r)
    job = f"gpu-bench-{secrets.token_hex(4)}"
    envs = envs if envs is not None else allreduce_ranks(n)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_allreduce_rank, args=(i, n, envs[i], url, job, mib, q), daemon=True)
        for i in range(n)
    ]
    try:
        for p in procs:
            p.start()
        got = [q.get(timeout=PART_TIMEOUT_S["allreduce"] - 10) for _ in range(n)]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
        for key in r.scan_iter(f"digen:{job}:*"):
            r.delete(key)
        r.close()
    errors = [g["error"] for g in got if "error" in g]
    if errors:
        return {"error": errors[0]}
    s = max(g["s"] for g in got)
    nbytes = mib * 2**20
    ranks = sorted(got, key=lambda g: g["rank"])
    return {
        "ranks": n,
        "size_mib": mib,
        "ms": round(s * 1e3, 2),
        "algbw_gb_s": round(nbytes / s / 1e9, 1),
        "busbw_gb_s": round(nbytes / s / 1e9 * 2 * (n - 1) / n, 1),
        "backend": ranks[0]["backend"],
        "store": "redis",
        "timeout_s": ranks[0]["timeout_s"],
        "visible": [g["visible"] for g in ranks],
        "nccl_env": ranks[0]["nccl_env"],
    }


ALLREDUCE_LEASE_S = 120.0
"""The lease the bench's group takes its collective timeout from (``schedule.lease_s``'s default)."""


def _allreduce_rank(rank: int, world: int, env: dict[str, str], url: str, job: str, mib: int, q) -> None:
    try:
        import os

        os.environ.update(env)  # the placement's pinning, before torch sees CUDA
        import torch
        import torch.distributed as dist

        from digen.controlplane.jsonkeys import JsonKeys, Rendezvous
        from digen.controlplane.redis_conn import connect
        from digen.parallel.comm import NCCL_ENV, collective_timeout_s, join_process_group

        r = connect(url)
        rdv = Rendezvous(JsonKeys(r, job, "bench"), "allreduce", "the bench's all-reduce group")
        device = torch.device(os.environ.get("DIGEN_DEVICE", "cuda:0"))
        deadline = time.monotonic() + 60

        def await_address() -> dict | None:
            while time.monotonic() < deadline:
                if (found := rdv.poll()) is not None:
                    return found
                time.sleep(0.05)  # polling the leader's key, as a worker's rendezvous does
            return None

        addr = join_process_group(
            leader=rank == 0,
            host="127.0.0.1",
            rank=rank,
            world=world,
            device=device,
            timeout_s=ALLREDUCE_LEASE_S,
            publish=rdv.publish,
            await_address=await_address,
            store=rdv.store,
        )
        if addr is None:
            raise RuntimeError("rank 0 never published the group's address")
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        x = torch.ones(mib * 2**19, dtype=torch.bfloat16, device=device)
        for _ in range(3):
            dist.all_reduce(x)
        sync()
        iters = 10
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        sync()
        s = (time.perf_counter() - t0) / iters
        dist.destroy_process_group()
        q.put(
            {
                "rank": rank,
                "s": s,
                "backend": addr["backend"],
                "timeout_s": collective_timeout_s(addr["backend"], ALLREDUCE_LEASE_S),
                "visible": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                "nccl_env": {v: os.environ.get(v) for v in NCCL_ENV},
            }
        )
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        q.put({"error": f"rank {rank}: {type(exc).__name__}: {exc}"})


# ------------------------------------------------------------------------------------------
# bucketed weight fetch, GPU to GPU through the blob servers


def _fetch_part(src: str, dst: str, mib: int = ADAPTER_MIB) -> dict:
    """The weight fetch of ``mib`` MiB from a process on device ``src`` to one on ``dst``
    (``cuda:N``; ``cpu`` runs the same code without a GPU, as the tests do)."""
    import secrets

    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    key = secrets.token_hex(32)  # the bench job's blob key: both processes hold it, as a job's do
    holder = ctx.Process(target=_hold_adapter, args=(src, mib, q, done, key), daemon=True)
    holder.start()
    try:
        ready = q.get(timeout=120)
        if "error" in ready:
            return ready
        got = _in_child(_fetch_adapter, (ready["address"], ready["blob"], dst, key), 120)
    finally:
        done.set()
        holder.join(10)
        if holder.is_alive():
            holder.terminate()
    if "error" in got:
        return got
    size = got["bytes"] / 2**20
    return {
        "from": src,
        "to": dst,
        "size_mib": round(size),
        "publish_s": round(ready["publish_s"], 3),
        "fetch_s": round(got["s"], 3),
        "fetch_gib_s": round(size / 1024 / got["s"], 2),
        "holder_peak_gib": ready.get("peak_gib"),
        "fetcher_peak_gib": got.get("peak_gib"),
    }


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _peak_gib(device: str) -> float | None:
    """Peak GPU memory this process allocated on ``device`` (None on CPU)."""
    import torch

    if not device.startswith("cuda"):
        return None
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2)


def _hold_adapter(device: str, mib: int, q, done, key: str) -> None:
    """Hold a ``mib`` MiB float32 adapter on ``device``, publish it (to host memory, into
    this process's blob store, as a trainer publishes a version) and serve it until ``done``
    (to requests signed with the bench job's ``key``)."""
    try:
        import torch

        from digen.dataplane.auth import keyring
        from digen.dataplane.blobs import local_server, local_store

        keyring().add("bench", bytes.fromhex(key))
        n_tensors = max(1, mib // 4)  # about 4 MiB per tensor, as LoRA factors come
        per = mib * 2**20 // n_tensors // 4
        weights = {f"lora.{i}.weight": torch.randn(per, device=device) for i in range(n_tensors)}
        _sync(device)
        t0 = time.perf_counter()
        host = {k: v.to("cpu") for k, v in weights.items()}
        local_store().put(blobnames.weights("bench", 1), host)
        publish_s = time.perf_counter() - t0
        server = local_server()
        q.put(
            {
                "address": server.address,
                "blob": blobnames.weights("bench", 1),
                "publish_s": publish_s,
                "peak_gib": _peak_gib(device),
            }
        )
        done.wait(180)
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        q.put({"error": f"{type(exc).__name__}: {exc}"})


def _fetch_adapter(address: str, blob: str, device: str, key: str) -> dict:
    """Fetch ``blob`` bucket by bucket (signed with the bench job's ``key``), each bucket
    copied to ``device`` as it lands."""
    import torch

    from digen.dataplane.auth import keyring
    from digen.dataplane.weights import fetch_version

    keyring().add("bench", bytes.fromhex(key))
    torch.ones(1, device=device)  # the CUDA context first: not part of the fetch
    landed: dict = {}

    def to_device(tensors: dict) -> None:
        for k, v in tensors.items():
            landed[k] = v.to(device)

    t0 = time.perf_counter()
    fetch_version([address], blob, on_bucket=to_device)
    _sync(device)
    return {
        "s": time.perf_counter() - t0,
        "bytes": sum(v.numel() * v.element_size() for v in landed.values()),
        "peak_gib": _peak_gib(device),
    }


# ------------------------------------------------------------------------------------------
# one bf16 rollout and train step at SD3.5-Medium's size


def bench_config(model: str, device: str = "cuda:0", resolution: int = 512):
    """The reference run of the ``rollout_train`` part (see the module docstring)."""
    from digen.config import build_config

    return build_config(
        {
            "seed": 0,
            "iterations": 2,
            "model": {
                "path": model,
                "resolution": resolution,
                "dtype": "bfloat16",
                "device": device,
                "lora": {"enabled": True, "rank": 32, "alpha": 64},
            },
            "prompts": {"items": ["a photo of a cat", "a red car", "a bowl of fruit", "a mountain lake"]},
            "rollout": {"batch_size": 4, "group_size": 4, "num_steps": 10},
            "train": {"timesteps": {"strategy": "prefix", "fraction": 0.99}, "clip_range": 1e-4},
            "reward": [{"name": "brightness"}],
            "schedule": {"mode": "reference", "max_staleness": 0},
            "output": {"plots": False, "sample_grid_every": 0, "checkpoint_every": 100},
        },
        check_paths=False,
    )


def _rollout_train_part(
    model_dir: str, run_dir: str, device: str = "cuda:0", resolution: int = 512, size: dict | None = None
) -> dict:
    """Two reference iterations (bf16, staleness 0) on a random-weight SD3 transformer of
    ``size`` (default :data:`SD35_MEDIUM`) built into ``model_dir`` once; the second one timed."""
    import torch

    from digen.models import make_tiny_model
    from digen.reference import run_reference

    t0 = time.perf_counter()
    if not (Path(model_dir) / "model_index.json").exists():
        make_tiny_model(model_dir, "sd3", seed=0, resolution=resolution, **(size or SD35_MEDIUM))
    build_s = time.perf_counter() - t0
    cfg = bench_config(model_dir, device, resolution)
    clear_bench_run(Path(run_dir), model_dir)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    run_reference(cfg, Path(run_dir))
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]
    trained = [r for r in rows if "event" not in r and "ratio_max_dev" in r]
    m = trained[-1] if trained else {}
    spans = _spans(Path(run_dir) / "timeline.jsonl", iteration=1)
    images = cfg.rollout.group_size
    return {
        "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else device,
        "model_build_s": round(build_s, 1),
        "gen_images_per_s": round(images / spans["gen"], 2) if spans.get("gen") else None,
        "train_images_per_s": round(images / spans["train"], 2) if spans.get("train") else None,
        "peak_memory_gib": _peak_gib(device),
        "ratio_max_dev_bf16": max((r["ratio_max_dev"] for r in trained), default=None),
        "clipfrac_bf16": max((r.get("clipfrac", 0.0) for r in trained), default=None),
        "iterations": len(trained),
        "last_loss": m.get("loss"),
    }


def clear_bench_run(run_dir: Path, model_dir: str) -> None:
    """Remove the run a previous ``--gpu-bench`` into the same ``--out`` left in ``run_dir``
    (a run directory that holds a run is refused to a fresh one); a folder there that is not
    the bench's own run (its ``config.yaml`` does not name ``model_dir``) is left alone, and the
    run then fails naming it."""
    import shutil

    import yaml

    cfg = run_dir / "config.yaml"
    if not cfg.exists():
        return
    try:
        path = (yaml.safe_load(cfg.read_text()) or {}).get("model", {}).get("path")
    except (OSError, yaml.YAMLError, AttributeError):
        return
    if path is not None and Path(str(path)).resolve() == Path(model_dir).resolve():
        shutil.rmtree(run_dir)


def _spans(timeline: Path, iteration: int) -> dict[str, float]:
    """Seconds of ``gen`` and ``train`` task parts of ``iteration`` in a run's timeline."""
    out: dict[str, float] = {}
    if not timeline.exists():
        return out
    for line in timeline.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        if r.get("iteration") == iteration and r.get("kind") in ("gen", "train"):
            out[r["kind"]] = out.get(r["kind"], 0.0) + float(r["end"]) - float(r["start"])
    return out
