"""``train.mini_batch_split: samples`` (Flow-GRPO's split): the iteration's trained samples in
a seeded order cut into ``train.mini_batches`` equal parts, zero-advantage samples dropped and
switched back on as Flow-GRPO does; each train task (group, part m) trains its samples of
mini-batch m, in the reference loop as in the distributed modes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from digen.config import build_config
from digen.iteration import IterationBook
from digen.reference import run_reference
from digen.seeding import permutation
from digen.task_records import GroupTask

G = 4


def book(small_config, rewards: list[list[float]], mini_batches: int, **train) -> IterationBook:
    keys = {f"train__{k}": v for k, v in train.items()}
    cfg = small_config(
        rollout__batch_size=G * len(rewards),
        train__mini_batches=mini_batches,
        train__mini_batch_split="samples",
        **keys,
    )
    groups = [GroupTask(5, g, "p", tuple(range(g * G, (g + 1) * G)), 0) for g in range(len(rewards))]
    b = IterationBook(cfg, 5, groups)
    for g, r in enumerate(rewards):
        b.add_rewards(g, r)
    return b


def sizes(split: dict, m_total: int) -> list[int]:
    return [sum(1 for m in split.values() if m == k) for k in range(m_total)]


def test_the_split_is_the_seeded_shuffle_of_the_samples_cut_in_equal_parts(small_config):
    b = book(small_config, [[0.1, 0.9, 0.5, 0.3], [0.2, 0.4, 0.8, 0.6], [0.7, 0.1, 0.3, 0.2]], 3)
    assert b.trainable_groups() == [0, 1, 2]
    split = b.sample_split()
    rows = [(g, i) for g in range(3) for i in range(G)]
    order = [rows[j] for j in permutation(12, b.cfg.seed, 5, "mini_batches")]
    assert split == {key: n // 4 for n, key in enumerate(order)}
    assert len({split[(g, i)] for g in range(3) for i in range(G)}) == 3  # groups straddle parts
    for g in range(3):  # a group's parts are its spec's samples, each once, in sample order
        pieces = [b.task_spec(g, m) for m in range(3)]
        assert sorted(i for p in pieces for i in p.samples) == list(range(G))
        for m, p in enumerate(pieces):
            assert p.samples == sorted(i for i in range(G) if split[(g, i)] == m)
            assert p.advantages == [b.train_spec(g).advantages[i] for i in p.samples]


def test_no_part_is_released_before_every_group_is_scored(small_config):
    b = book(small_config, [[0.1, 0.9, 0.5, 0.3]], 2)
    b.groups.append(GroupTask(5, 1, "p", (4, 5, 6, 7), 0))
    assert b.trainable_groups() == []  # group-local advantages, yet the shuffle needs group 1
    b.add_rewards(1, [0.3, 0.2, 0.1, 0.0])
    assert b.trainable_groups() == [0, 1]


def test_zero_advantage_samples_are_dropped_and_switched_back_on_to_divide(small_config):
    """Flow-GRPO: 8 kept samples (a flat group dropped) do not divide 3 mini-batches, so one
    random zero-advantage sample is switched back on: 3 steps of 3 samples."""
    flat = [0.5, 0.5, 0.5, 0.5]
    b = book(small_config, [[0.1, 0.9, 0.5, 0.3], flat, [0.2, 0.4, 0.8, 0.6]], 3, zero_advantage="drop")
    split = b.sample_split()
    assert sizes(split, 3) == [3, 3, 3]
    back = [key for key in split if key[0] == 1]
    assert back == [(1, permutation(4, b.cfg.seed, 5, "zero_advantage")[0])]
    assert b.train_spec(1).advantages == [0.0]
    assert b.zero_advantage_dropped == 3
    # divisible already: nothing switched on (Flow-GRPO's 6/6 of 12 kept samples)
    b2 = book(small_config, [[0.1, 0.9, 0.5, 0.3], flat, [0.2, 0.4, 0.8, 0.6]], 2, zero_advantage="drop")
    assert sizes(b2.sample_split(), 2) == [4, 4] and b2.train_spec(1).samples == []


def test_a_count_that_does_not_divide_gives_the_first_parts_one_more(small_config):
    b = book(small_config, [[0.1, float("nan"), 0.5, 0.3], [0.2, 0.4, 0.8, 0.6]], 2)
    assert sizes(b.sample_split(), 2) == [4, 3]


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


SAMPLES = {"mini_batches": 2, "mini_batch_split": "samples"}


def test_reference_runs_the_samples_split_and_it_differs_from_the_groups_split(small_config, tmp_path):
    cfgs = {
        split: small_config(iterations=1, train__mini_batches=2, train__mini_batch_split=split)
        for split in ("groups", "samples")
    }
    for split, cfg in cfgs.items():
        run_reference(cfg, tmp_path / split)
    a, b = rows(tmp_path / "groups")[0], rows(tmp_path / "samples")[0]
    assert a["rewards"] == b["rewards"] and b["policy_version"] == 2 and len(b["grad_norms"]) == 2
    assert a["trained_rows"] == b["trained_rows"] == 16  # 8 samples, 2 steps each
    wa = load_file(str(tmp_path / "groups/checkpoints/iter_0000/weights.safetensors"))
    wb = load_file(str(tmp_path / "samples/checkpoints/iter_0000/weights.safetensors"))
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) > 1e-6
    assert all(math.isfinite(x) for x in b["grad_norms"])


def config(tiny_sd3: Path, reduce: str = "allreduce", mini_batches: int = 2, **sections):
    from tests.conftest import small_config_data

    d = small_config_data(tiny_sd3, **{"iterations": 2, "rollout__num_steps": 3, **sections})
    d["train"].update({**SAMPLES, "zero_advantage": "drop", "reduce": reduce, "mini_batches": mini_batches})
    return build_config(d)


KEYS = (
    "rewards",
    "reward_mean",
    "loss",
    "grad_norm",
    "grad_norms",
    "trained_rows",
    "policy_version",
    "clipfrac",
)


@pytest.mark.slow
def test_the_samples_split_equals_the_reference_bit_for_bit_in_the_synchronous_modes(
    tiny_sd3, tmp_path, warm_cluster
):
    """4 mini-batches of 2 samples (task ids train:<i>:<g>:0..3): a group's samples in several."""
    from digen.runtime.controller import run_distributed

    run_reference(config(tiny_sd3, mini_batches=4), tmp_path / "ref")
    assert [len(r["grad_norms"]) for r in rows(tmp_path / "ref")] == [4, 4]
    for mode, trainers in (("colocated", 1), ("disaggregated", 2)):
        cfg = config(
            tiny_sd3,
            "exact",
            4,
            schedule={"mode": mode, "max_staleness": 0},
            cluster={"local": {"rollout_workers": 1, "trainer_workers": trainers}},
        )
        run_distributed(cfg, tmp_path / mode, scheduler=warm_cluster(1, trainers))
        for a, b in zip(rows(tmp_path / "ref"), rows(tmp_path / mode), strict=True):
            assert {k: b[k] for k in KEYS} == {k: a[k] for k in KEYS}, mode
        for name in ("weights", "optimizer"):
            w_ref = load_file(str(tmp_path / f"ref/checkpoints/iter_0001/{name}.safetensors"))
            w_got = load_file(str(tmp_path / mode / f"checkpoints/iter_0001/{name}.safetensors"))
            assert w_ref.keys() == w_got.keys() and all(torch.equal(w_ref[k], w_got[k]) for k in w_ref), mode


@pytest.mark.slow
def test_digen_mode_runs_the_samples_split_to_the_end(tiny_sd3, tmp_path, warm_cluster):
    from digen.runtime.controller import run_distributed

    cfg = config(
        tiny_sd3, schedule={"mode": "digen"}, cluster={"local": {"rollout_workers": 1, "trainer_workers": 2}}
    )
    run_distributed(cfg, tmp_path / "digen", scheduler=warm_cluster(1, 2))
    metrics = rows(tmp_path / "digen")
    assert [r["policy_version"] for r in metrics] == [2, 4]
    assert all(r["samples"] == 8 and len(r["grad_norms"]) == 2 and r["grad_norm"] > 0 for r in metrics)
    timeline = [json.loads(x) for x in (tmp_path / "digen/timeline.jsonl").read_text().splitlines()]
    for k in range(2):  # no train task of an iteration starts before its last generation ends
        gen_end = max(e["end"] for e in timeline if e["kind"] == "gen" and e["iteration"] == k)
        assert min(e["start"] for e in timeline if e["kind"] == "train" and e["iteration"] == k) >= gen_end
