"""Train tasks of several groups (``train.groups_per_task``) in the reference loop: the loss
and gradient do not depend on how the rows are grouped into tasks.

Two cases, from what the float sums do:

- the forwards are the same (``rows_per_forward`` = one group's rows, TSP): a batched task's
  forwards accumulate into ``.grad`` in the order :meth:`digen.iteration.IterationBook.gradient`
  adds the unbatched tasks' gradients, so a batch of *every* group of the step equals one
  group per task bit for bit (``torch.equal``). (Two tasks of two groups each are summed
  ``(g0 + g1) + (g2 + g3)``, not ``((g0 + g1) + g2) + g3``: one reassociation, hence the
  tolerance below.)
- the forwards merge groups (the point of batching: fewer, fuller passes): one backward sums
  rows of several groups inside its matmuls, another association of the same float32 sum;
  the weights then agree within :data:`WEIGHTS_ATOL`.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from digen.reference import run_reference

WEIGHTS_ATOL = 1e-5
"""Max |weight difference| after 2 iterations at lr 1e-3 (tiny SD3, LoRA r4) between a
batching that merges groups into one forward and one group per task: the task gradients
differ by float32 reassociation (a few ulps, ~1e-7 relative); AdamW scales an update to about
lr * g / sqrt(v), so a coordinate whose gradient is near 0 moves by more, and the second
iteration samples from weights that differ by that much. Measured: 1.2e-7 (2 groups per task)
and 1.6e-7 (4) with one mini-batch, 6.5e-7 with two (the second trains off-policy, where the
PPO clip acts), 1.2e-7 with the samples split; the bound leaves 15x for other CPUs/BLAS (as
tests/runtime/test_equivalence.py's ``DIGEN_WEIGHTS_ATOL``)."""

FOUR_GROUPS = {"rollout__batch_size": 16}  # 4 groups of 4 samples; 2 trained steps: 8 rows a group


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def weights(run: Path, name: str = "weights") -> dict[str, torch.Tensor]:
    last = sorted((run / "checkpoints").glob("iter_*"))[-1]
    return load_file(str(last / f"{name}.safetensors"))


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def train(small_config, out: Path, per_task: int, iterations: int = 2, **kw) -> Path:
    cfg = small_config(iterations=iterations, train__groups_per_task=per_task, schedule__tsp=True, **kw)
    run_reference(cfg, out)
    return out


def test_a_batch_of_every_group_with_the_same_forwards_equals_one_group_per_task_bit_for_bit(
    small_config, tmp_path
):
    same = {**FOUR_GROUPS, "train__rows_per_forward": 8}
    one = train(small_config, tmp_path / "one", 1, **same)
    four = train(small_config, tmp_path / "four", 4, **same)
    assert (
        [r["train_forwards"] for r in metrics(one)] == [r["train_forwards"] for r in metrics(four)] == [4, 4]
    )
    keep = ("rewards", "loss", "approx_kl", "clipfrac", "grad_norm", "trained_rows")
    assert [{k: r[k] for k in keep} for r in metrics(one)] == [{k: r[k] for k in keep} for r in metrics(four)]
    for name in ("weights", "optimizer"):
        a, b = weights(one, name), weights(four, name)
        assert all(torch.equal(a[k], b[k]) for k in a), max_diff(a, b)


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_merged_forwards_change_the_weights_only_by_float_reassociation(small_config, tmp_path, mini_batches):
    kw = {**FOUR_GROUPS, "train__mini_batches": mini_batches}
    one = train(small_config, tmp_path / "one", 1, **kw)
    runs = {n: train(small_config, tmp_path / f"g{n}", n, **kw) for n in (2, 4)}
    base = metrics(one)
    for n, run in runs.items():
        got = metrics(run)
        assert got[0]["rewards"] == base[0]["rewards"]  # version 0: the same samples
        assert got[1]["rewards"] == pytest.approx(base[1]["rewards"], abs=1e-5)  # weights ~1e-7 apart
        assert [r["trained_rows"] for r in got] == [r["trained_rows"] for r in base] == [32, 32]
        for a, b in zip(base, got, strict=True):
            assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)  # a mean of ~0: cancellation
        diff = max_diff(weights(one), weights(run))
        assert diff <= WEIGHTS_ATOL, (n, diff)
    # 8 rows a group, 64 a forward: one forward per task (its groups together) instead of per group
    per_step = 4 // mini_batches
    assert [r["train_forwards"] for r in base] == [4, 4]
    assert [r["train_forwards"] for r in metrics(runs[2])] == [2, 2]
    assert [r["train_forwards"] for r in metrics(runs[4])] == [mini_batches, mini_batches]
    assert per_step * mini_batches == 4


def test_the_samples_split_batches_too(small_config, tmp_path):
    kw = {**FOUR_GROUPS, "train__mini_batches": 2, "train__mini_batch_split": "samples"}
    one = train(small_config, tmp_path / "one", 1, **kw)
    two = train(small_config, tmp_path / "two", 2, **kw)
    assert [r["trained_rows"] for r in metrics(one)] == [r["trained_rows"] for r in metrics(two)]
    # a task per group and mini-batch (4 x 2) against a task per 2 groups and mini-batch (2 x 2)
    assert [r["train_forwards"] for r in metrics(one)] == [8, 8]
    assert [r["train_forwards"] for r in metrics(two)] == [4, 4]
    assert max_diff(weights(one), weights(two)) <= WEIGHTS_ATOL


def test_without_tsp_a_batched_task_runs_one_forward_per_step_for_all_its_groups(small_config, tmp_path):
    cfg = small_config(iterations=1, train__groups_per_task=2, schedule__tsp=False, **FOUR_GROUPS)
    run_reference(cfg, tmp_path / "run")
    assert metrics(tmp_path / "run")[0]["train_forwards"] == 2 * 2  # 2 tasks x 2 trained steps


def test_a_worker_refuses_a_batch_that_is_not_the_tasks_own_consecutive_groups():
    from digen.controlplane.payloads import TrainPayload
    from digen.errors import PayloadError
    from digen.task_records import TrainSpec
    from digen.workers.tasks import batch_specs

    def entry(it, g):
        spec = TrainSpec(it, g, 0, [0], [4 * g], [1.0]).to_json()
        return {"spec": spec, "prompt": "p", "source": None}

    def task(it, g, **more):  # the payload: its first group's entry and the version it trains
        return {**entry(it, g), "version": 0, **more}

    def groups(task_id, raw):
        return [e.spec.group for e in batch_specs(task_id, TrainPayload.read(raw))]

    ok = task(3, 2, batch=[entry(3, 3), entry(3, 4)])
    assert groups("train:3:2", ok) == [2, 3, 4]
    assert groups("train:3:2:1", task(3, 2)) == [2]  # unbatched: as before
    for bad in (
        task(3, 2, batch=[entry(3, 4)]),  # a gap
        task(3, 2, batch=[entry(2, 3)]),  # another iteration
        task(3, 1, batch=[entry(3, 2)]),  # not named by its first group
        task(3, 2, batch="nope"),
        task(3, 2, batch=[{"spec": entry(3, 3)["spec"]}]),  # no prompt
        task(3, 2, batch=[{**entry(3, 3), "version": 0}]),  # a key an entry does not have
    ):
        with pytest.raises(PayloadError):  # the payload does not read, or names other groups
            groups("train:3:2", bad)
