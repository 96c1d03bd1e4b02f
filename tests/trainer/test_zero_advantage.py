"""``train.zero_advantage``: which samples a train task trains, and the row count the
optimizer step divides by (the gradient itself against Flow-GRPO's filtered mean:
tests/trainer/test_gradient_oracle.py ``test_zero_advantage_samples_as_the_peers``)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from digen.errors import RewardError
from digen.iteration import IterationBook
from digen.reference import run_reference
from digen.rewards.base import Reward, check_batch
from digen.rewards.server import make_server
from digen.runtime.controller import run_distributed
from digen.task_records import GroupTask, TrainStats
from digen.training import drawn_steps

REWARDS = [
    [0.0, 0.5, 0.5, 1.0],  # samples 1 and 2 sit at the group mean: advantage exactly 0
    [0.25, 0.25, 0.25, 0.25],  # a flat group
    [0.1, float("nan"), 0.7, 0.3],  # a non-finite reward: dropped in either mode
]


def book_of(cfg, rewards: list[list[float]]) -> IterationBook:
    g = cfg.rollout.group_size
    groups = [
        GroupTask(0, i, "a red square", tuple(range(i * g, (i + 1) * g)), 0) for i in range(len(rewards))
    ]
    book = IterationBook(cfg, 0, groups)
    for i, r in enumerate(rewards):
        book.add_rewards(i, torch.tensor(r))
    return book


@pytest.mark.parametrize("global_std", [False, True])
def test_drop_leaves_out_exactly_the_zero_advantage_samples(small_config, global_std: bool) -> None:
    """Flow-GRPO's mask is per sample (``advantages.abs().sum(dim=1) != 0``): a flat group's
    samples and a sample at its group's mean alike."""
    keep = book_of(small_config(train__global_std=global_std, rollout__batch_size=12), REWARDS)
    drop = book_of(
        small_config(train__global_std=global_std, train__zero_advantage="drop", rollout__batch_size=12),
        REWARDS,
    )
    assert [keep.train_spec(g).samples for g in range(3)] == [[0, 1, 2, 3], [0, 1, 2, 3], [0, 2, 3]]
    assert [drop.train_spec(g).samples for g in range(3)] == [[0, 3], [], [0, 2, 3]]
    assert all(a != 0 for g in range(3) for a in drop.train_spec(g).advantages)
    assert keep.train_spec(1).advantages == [0.0] * 4
    assert (keep.zero_advantage_dropped, drop.zero_advantage_dropped) == (0, 2 + 4)
    # the released rows are what the step divides by
    for book in (keep, drop):
        for g in range(3):
            rows = sum(len(s) for s in drawn_steps(book.train_spec(g), book.cfg).steps)
            book.add_gradient(g, {"w": torch.ones(1) * rows}, TrainStats(rows=rows))
    assert keep.gradient()[1] == 2 * (4 + 4 + 3)  # prefix 0.5 of 4 steps: 2 rows per sample
    assert drop.gradient()[1] == 2 * (2 + 0 + 3)
    assert drop.metrics()["zero_advantage_dropped"] == 6


def test_drop_with_every_group_flat_fails_naming_the_setting(small_config) -> None:
    book = book_of(small_config(train__zero_advantage="drop"), [[0.5] * 4, [0.25] * 4])
    for g in range(2):
        assert book.train_spec(g).samples == []
        book.add_gradient(g, {"w": torch.zeros(1)}, TrainStats())
    with pytest.raises(RewardError, match="zero_advantage"):
        book.gradient()


# --- a whole run: every mode trains the same rows --------------------------------------------
FLAT_PROMPT = "a red square"


class FlatForOnePrompt(Reward):
    """Mean pixel value, except a constant for ``FLAT_PROMPT``: that prompt's group is flat."""

    name = "flat_for_one_prompt"

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata=None) -> torch.Tensor:
        check_batch(images, prompts)
        score = images.detach().float().cpu().reshape(len(prompts), -1).mean(dim=1)
        flat = torch.tensor([p == FLAT_PROMPT for p in prompts])
        return torch.where(flat, torch.full_like(score, 0.5), score)


@pytest.fixture
def flat_reward_url():
    """The reward served over HTTP (``digen.rewards.server``), so that worker processes score
    with it too."""
    server = make_server(FlatForOnePrompt(), port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.url
    server.shutdown()
    server.server_close()
    thread.join()


def metrics_of(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_drop_trains_the_same_rows_in_the_reference_and_disaggregated_modes(
    small_config, flat_reward_url, tmp_path
) -> None:
    """Two prompts, two groups per iteration (a permutation: each prompt every iteration), one
    of them flat: with ``drop`` both the reference and the disaggregated controller train the
    other group's rows only and take the same step, bit for bit."""
    sections = {
        "iterations": 2,
        "prompts": {"items": [FLAT_PROMPT, "a blue circle"]},
        "reward": [{"name": "http", "kwargs": {"url": flat_reward_url}}],
        "train__zero_advantage": "drop",
    }
    ref, dis = tmp_path / "ref", tmp_path / "dis"
    run_reference(small_config(**sections), ref)
    run_distributed(
        small_config(
            **sections,
            schedule__mode="disaggregated",
            schedule__max_staleness=0,
            cluster__local={"rollout_workers": 1, "trainer_workers": 2},
        ),
        dis,
    )
    m_ref, m_dis = metrics_of(ref), metrics_of(dis)
    assert len(m_ref) == len(m_dis) == 2
    for a, b in zip(m_ref, m_dis, strict=True):
        assert a["zero_advantage_dropped"] == b["zero_advantage_dropped"] == 4  # the flat group
        assert a["trained_rows"] == b["trained_rows"] == 4 * 2  # the other group: 4 samples x 2 steps
        assert (a["loss"], a["kl"], a["grad_norm"]) == (b["loss"], b["kl"], b["grad_norm"])
    last = [sorted((run / "checkpoints").glob("iter_*"))[-1] for run in (ref, dis)]
    w_ref, w_dis = (load_file(str(folder / "weights.safetensors")) for folder in last)
    assert w_ref.keys() == w_dis.keys() and all(torch.equal(w_ref[k], w_dis[k]) for k in w_ref)
