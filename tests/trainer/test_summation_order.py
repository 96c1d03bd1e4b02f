"""What makes the synchronous modes bit-identical to the reference, checked without a cluster:
one thread count for every computing process, a task gradient that depends only on its rows,
and task gradients summed in group order whatever order they arrive in."""

from __future__ import annotations

import torch

from digen.assembly import build_policy, build_reward, compute_threads
from digen.iteration import IterationBook
from digen.prompt_cache import EmbedCache
from digen.rollout import generate_group
from digen.task_records import plan_groups
from digen.training import train_group


def test_compute_threads_sets_the_worker_thread_count_and_restores_it(small_config):
    before = torch.get_num_threads()
    cfg = small_config(cluster__local={"threads_per_worker": before + 1})
    with compute_threads(cfg):
        assert torch.get_num_threads() == before + 1
    assert torch.get_num_threads() == before


def test_task_gradients_sum_in_group_order_whatever_order_they_arrive(small_config):
    cfg = small_config(rollout__batch_size=12, rollout__group_size=4)  # 3 groups
    torch.manual_seed(cfg.seed)
    policy, reward = build_policy(cfg), build_reward(cfg)
    embed = EmbedCache.for_config(policy, cfg)
    groups = plan_groups(cfg, cfg.prompt_list(), 0, 0)
    trajs = [generate_group(policy, t, cfg, reward, embeds=embed(t.prompt)) for t in groups]

    def book_with(order: list[int]) -> IterationBook:
        book = IterationBook(cfg, 0, groups)
        for t, traj in zip(groups, trajs, strict=True):
            book.add_rewards(t.group, traj.rewards)
        for g in order:  # a trainer that finished group g: its gradient arrives now
            traj = trajs[g]
            grads, stats = train_group(
                policy,
                book.train_spec(g),
                traj.tensors(),
                embed(groups[g].prompt),
                cfg,
                tsp=False,
            )
            book.add_gradient(g, grads, stats)
        return book

    in_order, reversed_ = book_with([0, 1, 2]), book_with([2, 0, 1])
    for g in range(3):  # a task's gradient is a function of its rows alone (no state carried over)
        assert all(
            torch.equal(in_order.grads[(g, 0)][k], reversed_.grads[(g, 0)][k]) for k in in_order.grads[(g, 0)]
        )
    (a, rows_a), (b, rows_b) = in_order.gradient(), reversed_.gradient()
    assert rows_a == rows_b > 0
    assert any(v.abs().max() > 0 for v in a.values())
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert in_order.metrics()["loss"] == reversed_.metrics()["loss"]
