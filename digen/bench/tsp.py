"""The TSP micro-benchmark: one train task of K timesteps per sample as one batched
forward/backward (``tsp=True``) vs K sequential forwards (``tsp=False``), per K."""

from __future__ import annotations

import time
from collections.abc import Sequence

from digen.bench.stats import median
from digen.config import Config


def tsp_microbench(cfg: Config, ks: Sequence[int] = (1, 2, 4, 8), repeats: int = 5) -> list[dict]:
    """Time one train task (a group x K timesteps per sample) batched vs sequential, per K.

    The rows come from one real generated group of ``cfg``'s model; K is capped at
    ``rollout.num_steps``. Times are medians of ``repeats`` alternating runs after a warm-up.
    """
    import torch

    from digen.assembly import build_policy, build_reward
    from digen.prompt_cache import EmbedCache
    from digen.rollout import generate_group
    from digen.task_records import plan_groups
    from digen.training import build_rows, task_gradient

    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.cluster.local.threads_per_worker)
    try:
        policy = build_policy(cfg)
        embed = EmbedCache.for_config(policy, cfg)
        task = plan_groups(cfg, cfg.prompt_list(), 0, 0)[0]
        traj = generate_group(policy, task, cfg, build_reward(cfg), embeds=embed(task.prompt))
        n = len(task.sample_ids)
        embeds = embed(task.prompt).repeat_rows(n)
        adv = torch.linspace(-1, 1, n)
        out = []
        for k_req in ks:
            k = min(int(k_req), cfg.rollout.num_steps)
            rows = build_rows(
                traj.latents, torch.nan_to_num(traj.log_probs), traj.sigmas, adv, [list(range(k))] * n
            )
            data = cfg.model_dump(mode="json")
            data["train"]["rows_per_forward"] = max(cfg.train.rows_per_forward, len(rows))
            cfg_k = Config.model_validate(data)
            times: dict[bool, list[float]] = {True: [], False: []}
            for i in range(repeats + 1):
                for tsp in (True, False):
                    t0 = time.perf_counter()
                    task_gradient(policy, rows, embeds, cfg_k, tsp=tsp, sigma_max=float(traj.sigmas[1]))
                    if i > 0:  # the first round warms up both paths
                        times[tsp].append(time.perf_counter() - t0)
            batched, sequential = median(times[True]), median(times[False])
            out.append(
                {
                    "K": k,
                    "rows": len(rows),
                    "batched_s": batched,
                    "sequential_s": sequential,
                    "batched_ms_per_row": 1e3 * batched / len(rows),
                    "sequential_ms_per_row": 1e3 * sequential / len(rows),
                    "speedup": sequential / batched if batched > 0 else None,
                }
            )
        return out
    finally:
        torch.set_num_threads(threads)
