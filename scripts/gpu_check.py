"""The device check: what a session lent a GPU runs, in under 8 minutes, to see digen's CUDA
paths work on that machine and to take the numbers for docs/benchmarks.md.

    python scripts/gpu_check.py [--out DIR] [--dry-run] [--budget-s 470]
    scripts/gpu_check.sh [--out DIR] ...   (picks the machine's python, a carried wheelhouse)

It uses the machine's own torch (the device machine may have no package registry) and the
checkout's digen (``PYTHONPATH`` = the repository). Every step runs in its own process with a
time limit (:data:`STEPS`; their limits sum to :data:`TOTAL_S`, and a step never gets more than
what is left of ``--budget-s``); a failed or timed-out step is recorded and the next one runs.
Without CUDA the steps that need it are skipped, naming why (so the script can be tried on a
laptop); ``--dry-run`` only writes the plan. It writes ``gpu-check.json`` and ``gpu-check.md``
(one table, the numbers to copy) to ``--out``.

Steps: ``env`` (torch, CUDA, the GPUs), ``probes`` (the first-contact fixes on real CUDA: a
fused-AdamW restore steps, placement of NCCL groups, indexed devices and a one-rank NCCL
group, CPU pinning, deterministic kernels, pinned host copies on a side stream, the device
waits of a group's generation, the trainer group as digen forms it on NCCL), ``quickstart`` (2 iterations of
configs/quickstart.yaml on CUDA), ``tiny_model`` + ``bf16_tsp`` (a tiny SD3 in bfloat16 in
``digen`` mode: TSP, GAP, staleness 1) + ``resume`` (one more iteration with ``--resume``),
``bench`` (``digen doctor --gpu-bench``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Step:
    name: str
    limit_s: float
    cuda: bool
    """Needs a CUDA device (skipped without one)."""
    what: str


STEPS = [
    Step("env", 20, False, "torch, CUDA and the GPUs this python sees"),
    Step("probes", 90, True, "A1-A3, C1, C5-C7, D1-D2, E1 on real CUDA (see probes())"),
    Step("quickstart", 90, True, "configs/quickstart.yaml, 2 iterations, on CUDA"),
    Step("tiny_model", 20, False, "a tiny random-weight SD3 (32 px)"),
    Step("bf16_tsp", 70, True, "the tiny SD3 in bfloat16, digen mode (TSP, GAP, staleness 1), 2 iterations"),
    Step("resume", 50, True, "one more iteration of it with --resume"),
    Step("bench", 130, True, "digen doctor --gpu-bench"),
]
TOTAL_S = sum(s.limit_s for s in STEPS)
"""Every step's limit together: under 8 minutes."""


def has_cuda(python: str = sys.executable) -> tuple[bool, str]:
    """Whether ``python``'s torch sees a CUDA device, and why not (in a child: this process
    imports no torch)."""
    code = "import torch; print(int(torch.cuda.is_available() and torch.cuda.device_count() > 0))"
    try:
        res = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, env=_env())
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"torch could not be asked ({type(exc).__name__})"
    if res.returncode != 0:
        return False, "torch does not import: " + (res.stderr.strip().splitlines() or ["?"])[-1][:200]
    if res.stdout.strip().endswith("1"):
        return True, ""
    return False, "no CUDA device (torch.cuda.is_available() is false)"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def _digen(*args: str) -> list[str]:
    return [sys.executable, "-m", "digen.cli.main", *args]


def tiny_config(out: Path) -> Path:
    """The bf16 TSP run's config (written into ``out``)."""
    import yaml

    data = {
        "seed": 0,
        "iterations": 2,
        "model": {
            "path": str(out / "tiny"),
            "resolution": 32,
            "max_sequence_length": 32,
            "dtype": "bfloat16",
            "lora": {"enabled": True, "rank": 4, "alpha": 8},
        },
        "prompts": {"items": ["a red square", "a blue circle", "a green tree"]},
        "rollout": {"batch_size": 8, "group_size": 4, "num_steps": 4},
        "reward": [{"name": "brightness"}],
        "schedule": {"mode": "digen"},
        "cluster": {"local": {"rollout_workers": 1, "trainer_workers": 1, "workers_per_gpu": 2}},
        "output": {"plots": False, "sample_grid_every": 0},
    }
    path = out / "tiny.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def command(step: Step, out: Path) -> list[str]:
    """The command a step runs."""
    if step.name == "env":
        return [sys.executable, str(Path(__file__).resolve()), "--env", "--out", str(out)]
    if step.name == "probes":
        return [sys.executable, str(Path(__file__).resolve()), "--probes", "--out", str(out)]
    if step.name == "quickstart":
        return _digen(
            "train",
            str(ROOT / "configs" / "quickstart.yaml"),
            "--out",
            str(out / "quickstart"),
            "--set",
            "iterations=2",
            "--set",
            "cluster.local.workers_per_gpu=2",  # a one-GPU machine: its rollout worker and trainer share it
        )
    if step.name == "tiny_model":
        return _digen("make-tiny-model", str(out / "tiny"), "--arch", "sd3", "--resolution", "32")
    if step.name == "bf16_tsp":
        return _digen("train", str(out / "tiny.yaml"), "--out", str(out / "bf16_tsp"))
    if step.name == "resume":
        return _digen(
            "train",
            str(out / "tiny.yaml"),
            "--out",
            str(out / "bf16_tsp"),
            "--resume",
            "--set",
            "iterations=3",
        )
    if step.name == "bench":
        return _digen("doctor", "--gpu-bench", "--out", str(out / "bench"))
    raise ValueError(step.name)


def run_steps(out: Path, budget_s: float, cuda: tuple[bool, str], steps: list[Step] = STEPS) -> dict:
    """Run ``steps`` in order (a CUDA step skipped without ``cuda``), each within its limit and
    what is left of ``budget_s``; returns the results (also written to ``out``)."""
    out.mkdir(parents=True, exist_ok=True)
    ok_cuda, why = cuda
    start = time.monotonic()
    results: dict = {"budget_s": budget_s, "limits_total_s": sum(s.limit_s for s in steps), "steps": {}}
    for step in steps:
        left = budget_s - (time.monotonic() - start)
        if step.cuda and not ok_cuda:
            results["steps"][step.name] = {"status": "skipped", "why": why}
            continue
        if left < 5:
            results["steps"][step.name] = {
                "status": "skipped",
                "why": f"the budget ({budget_s:.0f} s) is spent",
            }
            continue
        if step.name == "bf16_tsp":
            tiny_config(out)
        results["steps"][step.name] = run_one(step, command(step, out), min(step.limit_s, left), out)
        write(out, results)
    results["wall_s"] = round(time.monotonic() - start, 1)
    results["numbers"] = numbers(out, results)
    write(out, results)
    return results


def run_one(step: Step, argv: list[str], limit_s: float, out: Path) -> dict:
    """Run one step's command within ``limit_s``; its output goes to ``out/<step>.log``."""
    t0 = time.monotonic()
    log = out / f"{step.name}.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(
            argv, stdout=fh, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return {"status": "timed out", "limit_s": round(limit_s, 1), "s": round(time.monotonic() - t0, 1)}
    res = {"status": "ok" if rc == 0 else "failed", "rc": rc, "s": round(time.monotonic() - t0, 1)}
    if rc != 0:
        res["tail"] = log.read_text(errors="replace").strip().splitlines()[-5:]
    return res


def _kill_group(proc: subprocess.Popen) -> None:
    """End a timed-out step and the processes it started (its own session: nothing else)."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def numbers(out: Path, results: dict) -> dict:
    """The measured numbers: each run's summary.json, the bench's parts, the probes."""
    got: dict = {}
    for run in ("quickstart", "bf16_tsp"):
        summary = out / run / "summary.json"
        if summary.exists():
            s = json.loads(summary.read_text())
            got[run] = {
                k: s.get(k) for k in ("iterations", "samples", "wall_s", "samples_per_s", "bubble_ratio")
            }
    for name in ("env.json", "probes.json", "bench/gpu-bench.json"):
        path = out / name
        if path.exists():
            got[name.split("/")[-1].removesuffix(".json")] = json.loads(path.read_text())
    return got


def write(out: Path, results: dict) -> None:
    (out / "gpu-check.json").write_text(json.dumps(results, indent=1))
    (out / "gpu-check.md").write_text("\n".join(markdown(results)) + "\n")


def markdown(results: dict) -> list[str]:
    """One table of the steps, then the runs' numbers."""
    lines = ["| step | status | seconds | note |", "|---|---|---|---|"]
    for name, r in results["steps"].items():
        note = r.get("why") or (r.get("tail") or [""])[-1] or ""
        lines.append(f"| {name} | {r['status']} | {r.get('s', '')} | {str(note)[:160]} |")
    for run, s in results.get("numbers", {}).items():
        if run in ("quickstart", "bf16_tsp"):
            lines.append("")
            lines.append(f"{run}: " + ", ".join(f"{k} {v}" for k, v in s.items()))
    probes = results.get("numbers", {}).get("probes")
    if probes:
        lines += ["", "| probe | ok | detail |", "|---|---|---|"]
        lines += [f"| {k} | {v.get('ok')} | {str(v.get('detail', ''))[:160]} |" for k, v in probes.items()]
    return lines


# --- the steps that run in this script's own child process ----------------------------
def env_report(out: Path) -> None:
    import torch

    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else [],
    }
    (out / "env.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info))


def probes(out: Path) -> dict:
    """The first-contact fixes, on real CUDA; each probe reports ok and what it saw."""
    results: dict = {}
    for name, fn in PROBES.items():
        try:
            results[name] = {"ok": True, "detail": fn()}
        except Exception as exc:  # noqa: BLE001 - every probe is reported
            results[name] = {"ok": False, "detail": f"{type(exc).__name__}: {exc}"[:500]}
    (out / "probes.json").write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    return results


def _probe_fused_adamw_restore() -> str:
    """A1: a fused-AdamW state restored on cuda:0 steps, and equals the step without the trip."""
    import torch

    from digen.config import TrainConfig
    from digen.optim import ParameterStore

    train = TrainConfig()
    g = torch.Generator().manual_seed(0)
    w = {"a": torch.randn(64, 32, generator=g), "b": torch.randn(32, 64, generator=g)}
    grads = [{k: torch.randn(v.shape, generator=g) for k, v in w.items()} for _ in range(2)]
    kept = ParameterStore(w, train, device="cuda:0")
    kept.step({k: v.clone() for k, v in grads[0].items()}, rows=2)
    restored = ParameterStore.restore(*kept.state_parts(), train, device="cuda:0")
    devices = {t.device.type for st in restored.optimizer.state.values() for t in st.values()}
    assert devices == {"cuda"}, devices
    for s in (kept, restored):
        s.step({k: v.clone() for k, v in grads[1].items()}, rows=2)
    assert all(torch.equal(kept.params[k], restored.params[k]) for k in kept.names)
    return f"state on {sorted(devices)}; the step after the restore equals the step without it"


def _probe_placement() -> str:
    """A2: the issue's plan on this machine's GPUs: two trainers never on one GPU over NCCL."""
    from digen.cluster.placement import discover, plan_local
    from digen.config import load_config

    cfg = load_config(
        ROOT / "configs" / "quickstart.yaml",
        [
            "cluster.local.workers_per_gpu=2",
            "cluster.local.trainer_workers=2",
            "cluster.local.rollout_workers=2",
        ],
        check_paths=False,
        algorithms=False,
    )
    gpus = discover()
    p = plan_local(cfg, gpus)
    trainers = [s for s in p.slots if s.role == "trainer"]
    shared = len({s.gpus for s in trainers}) < len(trainers)
    assert not shared or all(s.env().get("DIGEN_TRAINER_BACKEND") == "gloo" for s in trainers), p.lines()
    return " / ".join(p.lines())


def _probe_devices_and_nccl() -> str:
    """A3: auto is cuda:0, and a one-rank NCCL group forms on it and all-reduces."""
    import torch
    import torch.distributed as dist

    from digen.assembly import resolve_device
    from digen.parallel.comm import join_process_group

    device = resolve_device("auto")
    assert device == "cuda:0", device
    addr = join_process_group(
        leader=True,
        host="127.0.0.1",
        rank=0,
        world=1,
        device=torch.device(device),
        timeout_s=60,
        publish=lambda a: None,
        await_address=lambda: None,
        store=lambda name, timeout: dist.HashStore(),
    )
    try:
        t = torch.ones(4, device=device)
        dist.all_reduce(t)
        torch.cuda.synchronize()
        assert t.tolist() == [1.0] * 4
    finally:
        dist.destroy_process_group()
    return f"{device}, {addr['backend']} group of one formed and all-reduced"


def _probe_cpu_pinning() -> str:
    """C1: a worker placed with ``cluster.local.gpus: []`` sees no GPU."""
    from digen.cluster.placement import parse_spec, plan_local
    from digen.config import load_config

    cfg = load_config(
        ROOT / "configs" / "quickstart.yaml", ["cluster.local.gpus=[]"], check_paths=False, algorithms=False
    )
    env = {**_env(), **plan_local(cfg, parse_spec("1xh100")).slots[0].env()}
    code = "import torch; print(torch.cuda.is_available())"
    seen = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert seen.stdout.strip() == "False", (seen.stdout, seen.stderr[-300:])
    return f"env {dict((k, env[k]) for k in ('CUDA_VISIBLE_DEVICES', 'DIGEN_DEVICE'))}: no GPU visible"


def _probe_deterministic() -> str:
    """C7: deterministic kernels on, and a bf16 matmul's backward gives the same bits twice."""
    import torch

    from digen.assembly import deterministic_kernels
    from digen.config import build_config

    cfg = build_config(
        {"model": {"path": "none"}, "prompts": {"items": ["x"]}, "reward": [{"name": "brightness"}]},
        check_paths=False,
        algorithms=False,
    )
    assert deterministic_kernels(cfg, "cuda:0")
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(512, 512, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(512, 512, device="cuda", generator=g, dtype=torch.bfloat16)
    grads = []
    for _ in range(2):
        a.grad = None
        (a @ b).float().square().sum().backward()
        grads.append(a.grad.clone())
    assert torch.equal(grads[0], grads[1])
    return f"CUBLAS_WORKSPACE_CONFIG={os.environ.get('CUBLAS_WORKSPACE_CONFIG')}, same bits twice"


def _probe_pinned_snapshot() -> str:
    """E1 (C5): a served snapshot of a CUDA tensor is a pinned host copy that a step does not change."""
    import torch

    from digen.dataplane.wire import host_copy

    live = torch.ones(1024, device="cuda")
    snap = host_copy({"w": live}, torch.bfloat16)["w"]
    live.add_(1)
    torch.cuda.synchronize()
    assert snap.is_pinned() and snap.device.type == "cpu" and bool((snap == 1).all())
    return "pinned host copy, unchanged by a later write"


def _probe_side_stream_copy() -> str:
    """C5: a version's host copy runs on a side stream that waits for the step: a host copy
    taken right after in-place writes still queued on the default stream holds their result,
    pinned; a store's served copy equals its weights in the served dtype."""
    import torch

    from digen.config import TrainConfig
    from digen.dataplane.wire import copy_stream, host_copy
    from digen.optim import ParameterStore

    dev = torch.device("cuda", 0)
    side = copy_stream(dev)
    assert side is not None and side != torch.cuda.default_stream(dev), side
    live = torch.zeros(64 * 2**20, device=dev)  # 256 MiB: the writes are still running when the copy is asked
    for _ in range(20):
        live.add_(1.0)
    snap = host_copy({"w": live})["w"]
    assert snap.is_pinned() and bool((snap == 20.0).all()), float(snap.min())
    g = torch.Generator().manual_seed(0)
    store = ParameterStore({"a": torch.randn(256, 64, generator=g)}, TrainConfig(), device="cuda:0")
    served = store.weights_copy(lambda w: host_copy(w, torch.bfloat16))
    assert torch.equal(served["a"], store.weights()["a"].to(torch.bfloat16).cpu()) and served["a"].is_pinned()
    return f"side stream {side.stream_id} (default {torch.cuda.default_stream(dev).stream_id}); pinned, final bytes"


def _probe_load_memory() -> str:
    """Loading a store's version into a policy on CUDA allocates no copy of the model there
    (ParameterStore.load_into copies the live tensors in place), and the version a trainer keeps
    serving is held in host memory."""
    import torch

    from digen.config import TrainConfig
    from digen.dataplane.wire import host_copy
    from digen.models import lora
    from digen.optim import ParameterStore

    class Policy:
        module = torch.nn.Linear(4096, 4096, device="cuda")  # 64 MiB of float32

        def load_trainable_state_dict(self, state: dict) -> None:
            lora.load_full_state_dict(self.module, state)

    policy = Policy()
    store = ParameterStore(
        {k: p.detach().clone() for k, p in policy.module.named_parameters()}, TrainConfig(), device="cuda:0"
    )
    model = sum(p.numel() * p.element_size() for p in store.params.values())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    store.load_into(policy)
    torch.cuda.synchronize()
    grew = torch.cuda.max_memory_allocated() - before
    kept = store.weights_copy(host_copy)
    assert grew < model / 10, f"a load allocated {grew} bytes on the device for a {model}-byte model"
    assert all(t.device.type == "cpu" for t in kept.values())
    return f"load: {grew} bytes on the device for a {model}-byte model; kept version on the host"


def _probe_rollout_syncs() -> str:
    """C6: how often a group's generation waits for the device, counted by torch's sync debug
    mode: the sampling loop queues every copy; what is left is each group's decode and reward
    (and one wait after the loop)."""
    import tempfile
    import warnings

    import torch

    from digen.assembly import build_policy
    from digen.config import build_config
    from digen.models import make_tiny_model
    from digen.rollout import generate_groups
    from digen.task_records import GroupTask

    folder = Path(tempfile.mkdtemp(prefix="digen-syncs-"))
    model = make_tiny_model(folder / "sd3", "sd3", seed=0, resolution=32)
    cfg = build_config(
        {
            "model": {"path": str(model), "resolution": 32, "max_sequence_length": 32, "device": "cuda:0"},
            "prompts": {"items": ["a red square", "a blue circle"]},
            "reward": [{"name": "brightness"}],
            "rollout": {"group_size": 4, "batch_size": 8, "num_steps": 6},
        }
    )
    policy = build_policy(cfg)
    tasks = [GroupTask(0, g, p, tuple(range(4 * g, 4 * g + 4)), 0) for g, p in enumerate(cfg.prompts.items)]
    embeds = [policy.encode_prompts([t.prompt], with_uncond=cfg.rollout.guidance_scale > 1.0) for t in tasks]
    reward = lambda images, *_: images.float().mean(dim=(1, 2, 3))  # noqa: E731 - on the device, as a model's
    generate_groups(policy, tasks, cfg, reward, embeds=embeds)  # warm-up: kernels, allocator
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            generate_groups(policy, tasks, cfg, reward, embeds=embeds)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in seen if "synchroniz" in str(w.message)]
    allowed = 2 * len(tasks) + 1  # each group's decode and reward, one wait after the loop
    assert len(syncs) <= allowed, [str(w.message)[:120] for w in syncs[:5]]
    return f"{len(syncs)} device waits for {len(tasks)} groups of 4 x {cfg.rollout.num_steps} steps (at most {allowed})"


def _probe_train_syncs() -> str:
    """C6: how often a train task waits for the device (sync debug mode, as for generation):
    its rows cross with queued copies and its loss statistics come back once, after the last
    backward (tests/trainer/test_host_syncs.py counts the same on the meta device)."""
    import tempfile
    import warnings

    import torch

    from digen.algos.registry import algorithm_for
    from digen.assembly import build_policy
    from digen.config import build_config
    from digen.models import make_tiny_model
    from digen.rollout import generate_groups
    from digen.task_records import GroupTask, TrainSpec
    from digen.training import task_gradient

    folder = Path(tempfile.mkdtemp(prefix="digen-train-syncs-"))
    model = make_tiny_model(folder / "sd3", "sd3", seed=0, resolution=32)
    cfg = build_config(
        {
            "model": {"path": str(model), "resolution": 32, "max_sequence_length": 32, "device": "cuda:0"},
            "prompts": {"items": ["a red square"]},
            "reward": [{"name": "brightness"}],
            "rollout": {"group_size": 4, "batch_size": 4, "num_steps": 6},
            "train": {"algorithm": "grpo-guard"},
        }
    )
    policy = build_policy(cfg)
    task = GroupTask(0, 0, "a red square", (0, 1, 2, 3), 0)
    embeds = policy.encode_prompts([task.prompt], with_uncond=cfg.rollout.guidance_scale > 1.0)
    reward = lambda images, *_: images.float().mean(dim=(1, 2, 3))  # noqa: E731
    (traj,) = generate_groups(policy, [task], cfg, reward, embeds=[embeds])
    steps = list(range(cfg.rollout.num_steps))
    spec = TrainSpec(0, 0, 0, [0, 1, 2, 3], [0, 1, 2, 3], [1.0, -1.0, 0.5, -0.5], [steps] * 4)
    rows = algorithm_for(cfg).rows(spec, traj.tensors(), cfg)
    train_embeds = embeds.repeat_rows(4)
    sigma_max = float(traj.sigmas[1])
    task_gradient(policy, rows, train_embeds, cfg, tsp=False, sigma_max=sigma_max)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            _, stats = task_gradient(policy, rows, train_embeds, cfg, tsp=False, sigma_max=sigma_max)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in seen if "synchroniz" in str(w.message)]
    assert len(syncs) <= 1, [str(w.message)[:120] for w in syncs[:5]]
    return f"{len(syncs)} device waits for a train task of {stats.forwards} forwards ({stats.rows} rows)"


def _probe_trainer_group_settings() -> str:
    """D1, D2: the trainer group as digen forms it on CUDA (the bench's all-reduce part with one
    rank: digen's placement pins it to its GPU, digen's Redis store, NCCL): the collective
    timeout is inside the lease and the settings that make a dead peer raise are in effect.
    A dead peer on NCCL needs two GPUs (tests/parallel/test_dead_peer.py runs it on gloo)."""
    from digen.bench.gpu import ALLREDUCE_LEASE_S, _allreduce_part

    got = _allreduce_part(1)
    assert "error" not in got, got.get("error")
    assert got["backend"] == "nccl" and got["store"] == "redis", got
    assert got["timeout_s"] < ALLREDUCE_LEASE_S, got
    assert got["nccl_env"] == {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}, got
    return f"nccl over the Redis store, visible {got['visible']}, timeout {got['timeout_s']} s, {got['nccl_env']}"


PROBES = {
    "a1_fused_adamw_restore": _probe_fused_adamw_restore,
    "a2_placement": _probe_placement,
    "a3_devices_nccl": _probe_devices_and_nccl,
    "c1_cpu_pinning": _probe_cpu_pinning,
    "c7_deterministic": _probe_deterministic,
    "e1_pinned_snapshot": _probe_pinned_snapshot,
    "c5_side_stream_copy": _probe_side_stream_copy,
    "c4_load_memory": _probe_load_memory,
    "c6_rollout_syncs": _probe_rollout_syncs,
    "c6_train_syncs": _probe_train_syncs,
    "d1_d2_trainer_group": _probe_trainer_group_settings,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("gpu-check"))
    ap.add_argument("--budget-s", type=float, default=TOTAL_S)
    ap.add_argument("--dry-run", action="store_true", help="write the plan (steps, commands, limits) only")
    ap.add_argument("--env", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--probes", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.env:
        env_report(out)
        return 0
    if args.probes:
        return 0 if all(r["ok"] for r in probes(out).values()) else 1
    if args.dry_run:
        plan = {
            "limits_total_s": TOTAL_S,
            "steps": [
                {
                    "name": s.name,
                    "limit_s": s.limit_s,
                    "cuda": s.cuda,
                    "what": s.what,
                    "argv": command(s, out),
                }
                for s in STEPS
            ],
        }
        (out / "gpu-check-plan.json").write_text(json.dumps(plan, indent=1))
        print(json.dumps(plan, indent=1))
        return 0
    results = run_steps(out, args.budget_s, has_cuda())
    print("\n".join(markdown(results)))
    bad = [n for n, r in results["steps"].items() if r["status"] in ("failed", "timed out")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
