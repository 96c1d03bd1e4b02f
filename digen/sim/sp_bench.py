"""Micro-benchmark of Ulysses sequence parallelism: tiny-Wan generation at d=1 and d=``degree``.

``degree`` processes (``torch.multiprocessing.spawn``) form one gloo group, each with
``threads`` CPU threads (the stand-in for one GPU each). Rank 0 alone first generates the
group with the plain model (d=1) while the other ranks wait at a barrier; then every rank
generates it together under :func:`digen.parallel.ulysses.sequence_parallel`. Both go
through :func:`digen.rollout.generate_group` (digen's SDE sampler, true CFG) with the prompt
encoded beforehand, and time its ``gen`` phase (the denoising loop, the part the cost model
scales by the efficiency); each is run ``warmup`` times untimed, then ``repeats`` times, and
the median counts. ``efficiency = t1 / (degree * t_d)`` per sample (:mod:`digen.sim.sp_calibration`).

The d=``degree`` latents are compared with the d=1 ones (max abs difference, in the result's
``setup``): the timed computation is the one the exactness tests check.

What it measures: the mechanism (all-to-all cost against per-rank compute) on this machine's
CPUs over gloo, for a 2-block, 2-head tiny Wan. It is not a GPU number: on GPUs with NCCL and
a 14B model the compute per token is larger and the all-to-all faster, so the efficiency is
different (the catalog's cited constants, ``configs/sim/catalog.yaml``).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

from digen.errors import DigenError
from digen.parallel.ulysses import check_divisible
from digen.sim.sp_calibration import SpCalibration, efficiency

TINY_WAN_HEADS = 2
"""Attention heads of the tiny Wan (:func:`digen.models.wan.build_tiny_wan`): the degree must divide it."""
PROMPT = "a red square"


class SpBenchError(DigenError):
    """A benchmark rank that failed."""


@dataclass(frozen=True)
class SpBenchSpec:
    degree: int = 2
    """Sequence-parallel degree (ranks); must divide the tiny Wan's 2 heads."""
    resolution: int = 128
    """Height and width in pixels (multiple of 16)."""
    num_frames: int = 17
    """Video frames (4k + 1): latent frames ``(num_frames - 1) / 4 + 1``."""
    steps: int = 4
    """Denoising steps per generation."""
    group_size: int = 2
    """Samples generated together (one task)."""
    repeats: int = 3
    """Timed generations per degree (the median counts)."""
    warmup: int = 1
    """Untimed generations per degree before the timed ones."""
    threads: int = 1
    """CPU threads per rank."""

    @property
    def tokens(self) -> int:
        """Video tokens of one sample: latent frames x (resolution / 8 / 2)^2 (patch 1x2x2)."""
        return ((self.num_frames - 1) // 4 + 1) * (self.resolution // 16) ** 2

    def check(self) -> None:
        from digen.errors import ConfigError

        problems = []
        for name, value, low in (
            ("degree", self.degree, 2),
            ("steps", self.steps, 1),
            ("group_size", self.group_size, 2),
            ("repeats", self.repeats, 1),
            ("warmup", self.warmup, 0),
            ("threads", self.threads, 1),
        ):
            if value < low:
                problems.append(f"{name} ({value}) must be at least {low}")
        if self.resolution <= 0 or self.resolution % 16:
            problems.append(f"resolution ({self.resolution}) must be a positive multiple of 16")
        if self.num_frames < 1 or (self.num_frames - 1) % 4:
            problems.append(f"num_frames ({self.num_frames}) must be 4k + 1 (Wan's VAE: 4x in time)")
        if problems:
            raise ConfigError(problems)
        check_divisible("attention heads of the tiny Wan", TINY_WAN_HEADS, self.degree)
        check_divisible("video tokens per sample", self.tokens, self.degree)


def _config(spec: SpBenchSpec):
    from digen.config import Config, RolloutConfig

    return Config(  # the model is built here, not read from model.path; the bench scores nothing
        model={"path": "tiny-wan (built in memory)", "max_sequence_length": 32},
        prompts={"items": [PROMPT]},
        reward=[{"name": "brightness"}],
        rollout=RolloutConfig(
            batch_size=spec.group_size, group_size=spec.group_size, num_steps=spec.steps, guidance_scale=2.0
        ),
    )


def _timed(policy, spec: SpBenchSpec, runs: int) -> tuple[list[float], object]:
    """``runs`` generations of one group; their ``gen`` seconds and the last latents."""
    from digen.rollout import generate_group
    from digen.task_records import GroupTask

    cfg = _config(spec)
    task = GroupTask(iteration=0, group=0, prompt=PROMPT, sample_ids=tuple(range(spec.group_size)), version=0)
    embeds = policy.encode_prompts([PROMPT], with_uncond=True)
    seconds: list[float] = []
    latents = None
    phases: dict[str, float] = {}
    for _ in range(runs):
        traj = generate_group(
            policy, task, cfg, None, embeds=embeds, timer=lambda k, s, e, _cpu: phases.__setitem__(k, e - s)
        )
        seconds.append(phases["gen"])
        latents = traj.latents
    return seconds, latents


def _rank(rank: int, spec: SpBenchSpec, model: str, rendezvous: str, out_dir: str) -> None:
    """One rank: d=1 on rank 0 alone, then d=``degree`` on all; rank 0 writes ``times.json``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import torch.distributed as dist

    from digen.models import load_policy
    from digen.parallel.ulysses import sequence_parallel

    torch.set_num_threads(spec.threads)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=spec.degree,
        timeout=timedelta(seconds=1800),
    )
    try:
        policy = load_policy(model, height=spec.resolution, width=spec.resolution, num_frames=spec.num_frames)
        one: list[float] = []
        ref = None
        if rank == 0:
            one, ref = _timed(policy, spec, spec.warmup + spec.repeats)
        dist.barrier()
        with sequence_parallel(policy, None):
            many, lat = _timed(policy, spec, spec.warmup + spec.repeats)
        if rank == 0:
            result = {
                "d1": one[spec.warmup :],
                "dn": many[spec.warmup :],
                "max_abs_latent_diff": float((lat - ref).abs().max()),  # type: ignore[operator]
            }
            Path(out_dir, "times.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def run_sp_bench(spec: SpBenchSpec, workdir: str | Path) -> SpCalibration:
    """Build a tiny Wan in ``workdir``, run the benchmark, return the measured calibration."""
    import torch.multiprocessing as mp

    from digen.models import make_tiny_model

    spec.check()
    root = Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    model = str(make_tiny_model(root / "tiny-wan", "wan", resolution=spec.resolution))
    rendezvous = root / "rendezvous"
    rendezvous.unlink(missing_ok=True)
    (root / "times.json").unlink(missing_ok=True)
    t0 = time.time()
    try:
        mp.spawn(_rank, args=(spec, model, str(rendezvous), str(root)), nprocs=spec.degree, join=True)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
        raise SpBenchError(f"a sequence-parallel benchmark rank failed: {exc}") from None
    wall = time.time() - t0
    times = json.loads((root / "times.json").read_text())
    n = spec.group_size
    t1 = statistics.median(times["d1"]) / n
    td = statistics.median(times["dn"]) / n
    d = spec.degree
    setup = {
        **asdict(spec),
        "tokens_per_sample": spec.tokens,
        "model": "tiny Wan (2 blocks, 2 heads, random weights)",
        "backend": "gloo",
        "device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} logical cores)",
        "gen_s_d1": times["d1"],
        f"gen_s_d{d}": times["dn"],
        "max_abs_latent_diff": times["max_abs_latent_diff"],
        "wall_s": wall,
    }
    return SpCalibration(
        efficiency={d: efficiency(t1, td, d)},
        gen_s_per_sample={1: t1, d: td},
        tasks={1: spec.repeats, d: spec.repeats},
        source=f"digen sp-bench (tiny Wan, {d} gloo ranks x {spec.threads} CPU thread on {platform.node()})",
        setup=setup,
    )
