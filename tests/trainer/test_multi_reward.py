"""``train.multi_reward: per_reward``: DanceGRPO's per-reward advantages, from the rewards'
scores to the iteration book's train specs, in the reference loop and the distributed modes.

The peer's function is restated in tests/algos/test_peer_selection.py
(``dance_grpo_per_reward_advantages``: XueZeyue/DanceGRPO 15cc71d
fastvideo/train_grpo_hunyuan.py l.370-392 and the clamps of l.449-468); here the book's
advantages are compared with it tensor by tensor, and the peer's sum of per-reward clipped
losses with digen's clipped loss on the summed advantage.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from digen.algos.loss import ppo_clip_loss
from digen.errors import RewardError
from digen.iteration import IterationBook
from digen.task_records import GroupTask
from tests.algos.test_peer_selection import dance_grpo_per_reward_advantages

VQ = [[0.31, 0.92, 0.47, 0.05], [1.7, -0.4, 2.2, 0.9], [0.5, 0.5, 0.5, 0.5]]
MQ = [[5.0, 5.1, 4.9, 5.0], [90.0, 10.0, 50.0, 70.0], [3.0, 3.0, 3.0, 3.0]]  # group 2 flat in both
TWO = [{"name": "brightness", "weight": 0.7}, {"name": "jpeg_compressibility", "weight": 0.3}]


def dance_config(small_config, **more):
    return small_config(
        rollout__batch_size=12,
        reward=TWO,
        train__multi_reward="per_reward",
        train__unbiased_std=True,
        train__std_eps=1e-8,
        **more,
    )


def book_of(cfg, vq=VQ, mq=MQ) -> IterationBook:
    g = cfg.rollout.group_size
    groups = [GroupTask(0, i, "a red square", tuple(range(i * g, (i + 1) * g)), 0) for i in range(len(vq))]
    book = IterationBook(cfg, 0, groups)
    w = [spec.weight for spec in cfg.reward]
    for i, (a, b) in enumerate(zip(vq, mq, strict=True)):
        book.add_rewards(
            i,
            [w[0] * x + w[1] * y for x, y in zip(a, b, strict=True)],
            [list(p) for p in zip(a, b, strict=True)],
        )
    return book


def advantages(book: IterationBook) -> torch.Tensor:
    return torch.tensor([a for g in range(len(book.groups)) for a in book.train_spec(g).advantages])


def test_the_books_advantages_equal_dance_grpos(small_config) -> None:
    book = book_of(dance_config(small_config))
    vq, mq = sum(VQ, []), sum(MQ, [])
    theirs = dance_grpo_per_reward_advantages(vq, mq, 4, 0.7, 0.3)
    torch.testing.assert_close(advantages(book), theirs, rtol=1e-6, atol=1e-6)
    assert book.zero_std_groups == 1 and advantages(book)[8:].abs().max() == 0
    # the default, the weighted reward sum normalised once, is another advantage
    summed = book_of(
        small_config(rollout__batch_size=12, reward=TWO, train__unbiased_std=True, train__std_eps=1e-8)
    )
    assert not summed.reward_parts
    assert (advantages(summed) - theirs).abs().max() > 0.1


def test_the_loss_on_the_summed_advantage_is_dance_grpos_sum_of_losses_inside_the_clip_range() -> None:
    """The peer sums one clipped loss per reward (l.449-477); digen trains one on the summed
    advantage: the same value and gradient wherever the ratio is inside ``clip_range`` or the
    weighted per-reward advantages share a sign, another outside the range where they do not."""
    clip = 1e-4
    a_vq = torch.tensor([1.5, -0.5, 0.8, -1.2], dtype=torch.float64)
    a_mq = torch.tensor([0.4, -2.0, -0.9, 1.1], dtype=torch.float64)  # signs: agree, agree, differ, differ
    w_vq, w_mq = 0.7, 0.3
    old = torch.zeros(4, dtype=torch.float64)

    def peer(logp: torch.Tensor) -> torch.Tensor:
        ratio = torch.exp(logp - old)
        term = lambda a: torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip, 1 + clip))  # noqa: E731
        return w_vq * term(a_vq) + w_mq * term(a_mq)

    for shift, equal in ((0.5 * clip, [True] * 4), (5 * clip, [True, True, False, False])):
        logp = torch.full((4,), shift, dtype=torch.float64, requires_grad=True)
        ours = ppo_clip_loss(logp, old, w_vq * a_vq + w_mq * a_mq, clip).loss
        theirs = peer(logp)
        (g_ours,) = torch.autograd.grad(ours.sum(), logp)
        logp2 = logp.detach().clone().requires_grad_(True)
        (g_theirs,) = torch.autograd.grad(peer(logp2).sum(), logp2)
        same = [
            bool(
                torch.isclose(ours[i], theirs[i], rtol=1e-12)
                and torch.isclose(g_ours[i], g_theirs[i], rtol=1e-12)
            )
            for i in range(4)
        ]
        assert same == equal, (shift, same)


def test_a_sample_with_a_non_finite_score_in_any_reward_is_dropped(small_config) -> None:
    vq = [[0.31, float("nan"), 0.47, 0.05], *VQ[1:]]
    book = book_of(dance_config(small_config), vq=vq)
    assert book.train_spec(0).samples == [0, 2, 3]  # the total is NaN too: dropped as with sum
    book = book_of(dance_config(small_config))
    book.rewards[0][1] = 1.0  # a finite total with a NaN part (a worker's bytes): dropped all the same
    book.reward_parts[0][1][1] = float("inf")
    assert book.train_spec(0).samples == [0, 2, 3]


@pytest.mark.parametrize(
    "parts, why",
    [
        (None, "got none"),
        ([[0.1, 0.2]] * 3, "4 rows of 2"),
        ([[0.1]] * 4, "4 rows of 2"),
        ([[0.1, True]] * 4, "4 rows of 2"),
        ([[0.1, "0.2"]] * 4, "4 rows of 2"),
        ({"a": 1}, "dict"),
    ],
)
def test_per_reward_scores_are_checked_when_read(small_config, parts, why) -> None:
    book = book_of(dance_config(small_config))
    with pytest.raises(RewardError, match=why):
        book.add_rewards(1, [0.1, 0.2, 0.3, 0.4], parts)


def test_a_group_without_a_finite_reward_needs_no_scores(small_config) -> None:
    """A lost or dropped group is booked with NaN rewards (digen.runtime.results) and nothing else."""
    book = book_of(dance_config(small_config))
    book.add_rewards(1, [float("nan")] * 4)
    book._adv.clear()
    book.zero_std_groups = 0
    assert book.train_spec(1).samples == []


def test_generation_carries_each_rewards_score_beside_the_weighted_sum(small_config) -> None:
    """A generated group's ``reward_parts`` are its rewards' own scores, whose weighted sum is
    the reward the sum mode computes, bit for bit; without ``per_reward`` none are kept."""
    from digen.assembly import build_policy, build_reward
    from digen.rewards import build_reward as build_one
    from digen.rollout import generate_group

    per = dance_config(small_config)
    policy = build_policy(per)
    task = GroupTask(0, 0, "a red square", (0, 1, 2, 3), 0)
    traj = generate_group(policy, task, per, build_reward(per))
    plain = generate_group(policy, task, small_config(reward=TWO), build_reward(per))
    assert plain.reward_parts is None and torch.equal(plain.rewards, traj.rewards)
    assert traj.reward_parts is not None and traj.reward_parts.shape == (4, 2)
    images = traj.images.float() / 255  # the decoded images the rewards scored, to uint8 rounding
    for k, spec in enumerate(TWO):
        ours = build_one(spec["name"])(images, [task.prompt] * 4)
        torch.testing.assert_close(traj.reward_parts[:, k], ours, rtol=1e-2, atol=1e-2)
    total = torch.zeros(4) + 0.7 * traj.reward_parts[:, 0] + 0.3 * traj.reward_parts[:, 1]
    assert torch.equal(total, traj.rewards)


def flow_factory_gdpo(rewards: dict[str, list[float]], groups: list[int], weights: dict[str, float]):
    """X-GenGroup/Flow-Factory a0b2bc5 src/flow_factory/advantage/advantage_processor.py
    ``compute_gdpo`` and ``_global_mean_std`` (the gathered, one-process branch), restated."""
    group_indices = np.asarray(groups)
    all_reward_advantages = []
    for key, reward_array in rewards.items():
        reward_array = np.asarray(reward_array, dtype=np.float64)
        reward_adv = np.zeros_like(reward_array, dtype=np.float64)
        for group_id in np.unique(group_indices):
            mask = group_indices == group_id
            group_rewards = reward_array[mask]
            mean = np.mean(group_rewards)
            std = max(np.std(group_rewards), 1e-6)
            reward_adv[mask] = (group_rewards - mean) / std
        all_reward_advantages.append(reward_adv * weights[key])
    combined = np.sum(all_reward_advantages, axis=0)
    bn_mean, bn_std = float(np.mean(combined)), max(float(np.std(combined)), 1e-6)
    return (combined - bn_mean) / bn_std


def test_gdpo_is_flow_factorys_and_waits_for_the_whole_batch(small_config) -> None:
    """``train.multi_reward: gdpo``: the book's advantages equal Flow-Factory's compute_gdpo
    (then clamped to adv_clip, as its loss clamps to adv_clip_range); no group is trainable
    before the last is scored (the batch normalisation), and the scheduler is told so."""
    cfg = small_config(rollout__batch_size=12, reward=TWO, train__multi_reward="gdpo")
    assert not cfg.train.group_local_advantages and small_config().train.group_local_advantages
    g = cfg.rollout.group_size
    groups = [GroupTask(0, i, "a red square", tuple(range(i * g, (i + 1) * g)), 0) for i in range(3)]
    book = IterationBook(cfg, 0, groups)
    for i in range(3):
        assert book.trainable_groups() == []
        book.add_rewards(i, [0.7 * x + 0.3 * y for x, y in zip(VQ[i], MQ[i], strict=True)],
                         [list(p) for p in zip(VQ[i], MQ[i], strict=True)])  # fmt: skip
    assert book.trainable_groups() == [0, 1, 2]
    theirs = flow_factory_gdpo(
        {"vq": sum(VQ, []), "mq": sum(MQ, [])}, [0] * 4 + [1] * 4 + [2] * 4, {"vq": 0.7, "mq": 0.3}
    )
    theirs = torch.from_numpy(np.clip(theirs, -5.0, 5.0)).float()
    torch.testing.assert_close(advantages(book), theirs, rtol=1e-6, atol=1e-6)
    # every group's sum is centred, so the batch mean is 0 to round-off: the flat group stays at ~0
    assert book.zero_std_groups == 1 and advantages(book)[8:].abs().max() < 1e-12
    per_reward = book_of(small_config(rollout__batch_size=12, reward=TWO, train__multi_reward="per_reward"))
    assert (advantages(per_reward) - theirs).abs().max() > 0.1


def metrics_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_per_reward_trains_the_same_in_the_reference_and_disaggregated_modes(small_config, tmp_path) -> None:
    """The per-reward scores travel with the generation results (and, with a reward worker,
    with the ``reward`` tasks' results) to the controller's book: with ``train.reduce: exact``
    the disaggregated runs equal the reference bit for bit, and train another update than the
    weighted reward sum."""
    from safetensors.torch import load_file

    from digen.reference import run_reference
    from digen.runtime.controller import run_distributed

    sections = {"iterations": 1, "reward": TWO, "train__reduce": "exact"}
    ref, summed = tmp_path / "ref", tmp_path / "sum"
    run_reference(small_config(**sections, train__multi_reward="per_reward"), ref)
    run_reference(small_config(**sections), summed)
    (m_ref,), (m_sum,) = metrics_of(ref), metrics_of(summed)
    assert m_sum["rewards"] == m_ref["rewards"] and m_sum["grad_norm"] != m_ref["grad_norm"]
    keys = ("rewards", "loss", "approx_kl", "grad_norm")
    w_ref = load_file(str(sorted((ref / "checkpoints").glob("iter_*"))[-1] / "weights.safetensors"))
    for scorers in (0, 1):  # inline scoring, then a reward worker
        dis = tmp_path / f"dis{scorers}"
        run_distributed(
            small_config(
                **sections,
                train__multi_reward="per_reward",
                schedule__mode="disaggregated",
                schedule__max_staleness=0,
                cluster__local={"rollout_workers": 1, "trainer_workers": 1, "reward_workers": scorers},
            ),
            dis,
        )
        (m_dis,) = metrics_of(dis)
        w_dis = load_file(str(sorted((dis / "checkpoints").glob("iter_*"))[-1] / "weights.safetensors"))
        assert w_ref.keys() == w_dis.keys()
        if not scorers:  # bit for bit
            assert {k: m_ref[k] for k in keys} == {k: m_dis[k] for k in keys}
            assert all(torch.equal(w_ref[k], w_dis[k]) for k in w_ref)
            continue
        # a reward worker scores the decoded tensor read back from its blob: the rewards have
        # differed from the inline ones by float32 round-off (tests/runtime/test_eval_and_reward_tasks.py)
        assert m_dis["rewards"] == pytest.approx(m_ref["rewards"], abs=1e-6)
        assert m_dis["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=1e-4)
        assert abs(m_dis["grad_norm"] - m_sum["grad_norm"]) > 100 * abs(
            m_dis["grad_norm"] - m_ref["grad_norm"]
        )
        assert max(float((w_ref[k] - w_dis[k]).abs().max()) for k in w_ref) <= 1e-5
        events = [json.loads(line) for line in (dis / "timeline.jsonl").read_text().splitlines()]
        assert {e["worker"] for e in events if e["kind"] == "reward"} == {"reward-0"}
