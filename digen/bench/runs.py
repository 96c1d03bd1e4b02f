"""Running the bench: every mode's training run, interleaved and repeated
(:func:`run_bench`), each in its own run directory with its peak memory and start-up profile
(:func:`run_one`), on an embedded Redis of the bench's own."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from digen.bench.batching import batching_microbench
from digen.bench.memory import MemorySampler, reset_peak_rss
from digen.bench.modes import mode_config
from digen.bench.stats import RatePool, RunRecord, median, worker_stats
from digen.bench.summary import add_speedups, add_startup_ratios, summarize
from digen.bench.tsp import tsp_microbench
from digen.config import Config
from digen.errors import ConfigError
from digen.rundir import _read_jsonl

Notify = Callable[[str], None]


def run_one(
    cfg: Config, out: Path, mode: str, round_: int, *, redis_url: str | None = None, plots: bool = False
) -> RunRecord:
    """One training run of ``cfg`` in ``out`` (wiped first), with its peak memory per process;
    ``plots`` draws its timeline.png and rewards.png afterwards."""
    from digen.startup import StartupProfile, TreeMemorySampler, profiling

    if out.exists():
        shutil.rmtree(out)
    reset_peak_rss()
    profile = StartupProfile(t0=time.time())
    with MemorySampler() as mem, TreeMemorySampler() as tree, profiling(profile):
        mem.watch("controller", os.getpid())
        if cfg.schedule.mode == "reference":
            _run_reference(cfg, out)
        else:
            from digen.runtime.controller import run_distributed

            def on_start(ctl) -> None:
                pids = ctl.client.run(os.getpid)  # {address: pid}
                for name, w in ctl.workers.items():
                    if w.address in pids:
                        mem.watch(name, int(pids[w.address]))
                        tree.name(int(pids[w.address]), name)

            run_distributed(cfg, out, redis_url=redis_url, on_start=on_start)
    peaks = dict(mem.peaks)
    if plots:
        from digen.plots import write_run_plots

        write_run_plots(out)
    if cfg.schedule.mode == "reference":  # the trainer is this process
        peaks["reference"] = peaks["controller"]
    timeline = _read_jsonl(out / "timeline.jsonl")
    return RunRecord(
        mode,
        round_,
        out,
        _read_jsonl(out / "metrics.jsonl"),
        timeline,
        bool(cfg.schedule.resolved().tsp),
        peaks,
        profile.to_json(timeline, tree.peak_mb, tree.peak_pss_mb, tree.peak_breakdown()),
    )


def _run_reference(cfg: Config, out: Path) -> None:
    """The reference loop with the thread count of one worker (it is one worker)."""
    import torch

    from digen.reference import run_reference

    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.cluster.local.threads_per_worker)
    try:
        run_reference(cfg, out)
    finally:
        torch.set_num_threads(threads)


@contextmanager
def _private_redis(out: Path, needed: bool) -> Iterator[str | None]:
    """An embedded Redis of the bench's own (``OUT/redis``), so no other digen process on
    the machine shares, slows or stops the server the runs use; None when not needed."""
    if not needed:
        yield None
        return
    from digen.controlplane.redis_conn import connect, embedded_url, stop_embedded

    db = (out / "redis" / "bench.db").resolve()
    try:
        yield embedded_url(connect(None, db_path=db))
    finally:
        stop_embedded(db)


@dataclass
class BenchResult:
    """What :func:`run_bench` measured: bench.json's rows (one per mode), the TSP
    micro-benchmark's rows, and every run read back."""

    rows: list[dict]
    tsp: list[dict]
    records: list[RunRecord]
    batching: list[dict] = field(default_factory=list)
    """The generation-batching micro-benchmark's rows (:func:`batching_microbench`)."""


def run_bench(
    cfg: Config,
    modes: list[str],
    out: Path,
    *,
    rounds: int = 2,
    warmup: int = 1,
    workers: tuple[int, int] | None = None,
    tsp_ks: Sequence[int] = (1, 2, 4, 8),
    batch_sizes: Sequence[int] = (),
    notify: Notify | None = None,
    started: Notify | None = None,
) -> BenchResult:
    """Run every mode ``rounds`` times, interleaved; summarize; run the TSP micro-benchmark
    and, for ``batch_sizes``, the generation-batching one.
    ``started`` is told each step (``round 1/2 digen``, then the micro-benchmark) as it
    starts, ``notify`` what a run measured once it ends.

    Writes nothing but the runs' directories under ``out/runs``; see :func:`write_outputs`.
    """
    if rounds < 1:
        raise ConfigError(f"--rounds ({rounds}) must be at least 1")
    if warmup < 0 or warmup >= cfg.iterations:
        raise ConfigError(f"--warmup ({warmup}) must lie in [0, iterations) = [0, {cfg.iterations})")
    notify = notify or (lambda _msg: None)
    started = started or (lambda _msg: None)
    configs = {m: mode_config(cfg, m, workers) for m in modes}
    records: list[RunRecord] = []
    with _private_redis(out, any(c.schedule.mode != "reference" for c in configs.values())) as redis_url:
        for r in range(rounds):
            order = modes if r % 2 == 0 else list(reversed(modes))
            for m in order:
                started(f"round {r + 1}/{rounds} {m}")
                t0 = time.time()
                rec = run_one(
                    configs[m],
                    out / "runs" / m / f"round_{r}",
                    m,
                    r,
                    redis_url=redis_url,
                    plots=cfg.output.plots and r == rounds - 1,
                )
                records.append(rec)
                sps = median(
                    [float(x["samples_per_s"]) for x in rec.metrics if int(x["iteration"]) >= warmup]
                )
                notify(f"round {r + 1}/{rounds} {m}: {time.time() - t0:.1f} s, {sps:.2f} samples/s (median)")
    pool = RatePool()
    for rec in records:
        for st in worker_stats(rec.timeline, warmup).values():
            pool.add_worker(st, rec.tsp, cfg.rollout.group_size)
    rows = [
        summarize(m, [rec for rec in records if rec.mode == m], pool, cfg.rollout.group_size, warmup)
        for m in modes
    ]
    add_speedups(rows)
    add_startup_ratios(rows)
    tsp = []
    if tsp_ks:
        started(f"TSP micro-benchmark, K in {list(tsp_ks)}")
        tsp = tsp_microbench(cfg, tsp_ks)
    batching = []
    if batch_sizes:
        started(f"generation-batching micro-benchmark, max_batch in {list(batch_sizes)}")
        batching = batching_microbench(cfg, batch_sizes)
    return BenchResult(rows, tsp, records, batching)
