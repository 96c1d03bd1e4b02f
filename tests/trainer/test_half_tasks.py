"""A group's train task split in two halves (RAT's unit) trains the same update."""

from __future__ import annotations

import torch

from digen.assembly import build_policy, build_reward
from digen.iteration import IterationBook
from digen.prompt_cache import EmbedCache
from digen.rollout import generate_group
from digen.task_records import TrainStats, plan_groups
from digen.training import drawn_steps, sum_gradients, train_group


def test_halves_sum_to_the_whole_group(small_config):
    cfg = small_config(rollout__group_size=5, rollout__batch_size=5)  # odd: halves of 3 and 2
    torch.manual_seed(cfg.seed)
    policy, reward = build_policy(cfg), build_reward(cfg)
    embed = EmbedCache.for_config(policy, cfg)
    task = plan_groups(cfg, cfg.prompt_list(), 0, 0)[0]
    traj = generate_group(policy, task, cfg, reward, embeds=embed(task.prompt))
    book = IterationBook(cfg, 0, [task])
    book.add_rewards(0, traj.rewards)
    whole = book.train_spec(0)
    halves = [book.task_spec(0, p) for p in (0, 1)]
    assert [h.samples for h in halves] == [whole.samples[:3], whole.samples[3:]]
    assert book.task_spec(0, None) is whole  # one spec per group, however often asked

    def grad(spec):
        return train_group(policy, spec, traj.tensors(), embed(task.prompt), cfg, tsp=True)

    g_whole, s_whole = grad(whole)
    parts = [grad(h) for h in halves]
    g_sum = sum_gradients([g for g, _ in parts])
    rows = sum(len(s) for s in drawn_steps(whole, cfg).steps)  # the steps the trainer draws
    assert sum(s.rows for _, s in parts) == s_whole.rows == rows
    assert any(v.abs().max() > 0 for v in g_whole.values())
    for k in g_whole:
        torch.testing.assert_close(g_sum[k], g_whole[k], rtol=1e-5, atol=1e-7)
    # the book sums halves in part order, keyed (group, part)
    for p, (g, s) in enumerate(parts):
        book.add_gradient(0, g, s, p)
    total, _ = book.gradient()
    assert book.gradient()[1] == rows and set(book.grads) == {(0, 0), (0, 1)}
    assert all(torch.equal(total[k], g_sum[k]) for k in total)
    assert isinstance(parts[0][1], TrainStats)
