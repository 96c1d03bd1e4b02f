"""The generation-batching micro-benchmark: B groups of the config's workload generated as one
batch (``rollout.max_batch`` B: one forward per denoising step for all their samples,
:func:`digen.rollout.generate_groups`), per B; ms per sample, samples/s and the peak RSS of
one batch."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from digen.bench.memory import peak_rss_mb, reset_peak_rss
from digen.bench.stats import median
from digen.config import Config


def batching_microbench(cfg: Config, sizes: Sequence[int] = (1, 2, 4, 8), repeats: int = 3) -> list[dict]:
    """Time one batch of B groups (``group_size`` samples each, the config's sampler and
    scoring) per B in ``sizes``, in this process with the workers' thread count.

    Rounds are interleaved (every B once per round, after a warm-up round) and the time is
    the median over ``repeats`` rounds. ``peak_rss_mb``: this process's peak resident memory
    during one batch, its high-water mark reset before each (Linux ``clear_refs``; where that
    is refused, the peak so far, ``rss_reset`` false); ``rss_over_first_mb``: that peak minus
    the first B's, the memory a larger batch adds (its activations, its latents and images)."""
    import torch

    from digen.assembly import build_policy, build_reward
    from digen.prompt_cache import EmbedCache
    from digen.rollout import generate_groups
    from digen.task_records import GroupTask

    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.cluster.local.threads_per_worker)
    try:
        policy, reward = build_policy(cfg), build_reward(cfg)
        embed = EmbedCache.for_config(policy, cfg)
        prompts, g = cfg.prompt_list(), cfg.rollout.group_size
        most = max(sizes)
        tasks = [  # distinct groups of one iteration, each with its own samples' streams
            GroupTask(0, i, prompts[i % len(prompts)], tuple(range(i * g, (i + 1) * g)), 0)
            for i in range(most)
        ]
        times: dict[int, list[float]] = {b: [] for b in sizes}
        peaks: dict[int, float] = {}
        reset_ok = True
        for r in range(repeats + 1):
            for b in sizes:
                batch = tasks[:b]
                embeds = embed.many([t.prompt for t in batch])
                reset_ok = reset_peak_rss() and reset_ok
                t0 = time.perf_counter()
                generate_groups(policy, batch, cfg, reward, embeds)
                if r > 0:  # the first round warms up every size
                    times[b].append(time.perf_counter() - t0)
                peak = peak_rss_mb(os.getpid())
                if peak is not None:
                    peaks[b] = max(peaks.get(b, 0.0), peak)
        out = []
        for b in sizes:
            s = median(times[b])
            samples = b * g
            out.append(
                {
                    "max_batch": b,
                    "samples": samples,
                    "batch_s": s,
                    "ms_per_sample": 1e3 * s / samples,
                    "samples_per_s": samples / s if s > 0 else None,
                    "peak_rss_mb": peaks.get(b),
                    "rss_reset": reset_ok,
                }
            )
        base = out[0]
        for row in out:
            row["speedup_vs_first"] = (
                base["ms_per_sample"] / row["ms_per_sample"] if row["ms_per_sample"] else None
            )
            row["rss_over_first_mb"] = (
                row["peak_rss_mb"] - base["peak_rss_mb"]
                if row["peak_rss_mb"] is not None and base["peak_rss_mb"] is not None
                else None
            )
        return out
    finally:
        torch.set_num_threads(threads)
