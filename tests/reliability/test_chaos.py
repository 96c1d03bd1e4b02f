"""Chaos against a fault-free twin: a trainer SIGKILLed the moment the other trainer reported
its step's reduction, in ``digen`` mode with two trainers and two rollout workers.

The interleaving is made deterministic with the fault harness (digen.testing.faults): each
trainer trains one group of iteration 1 (trainer-1 holds its gradient until trainer-0 has
taken the other group, trainer-0 holds its own until trainer-1 has computed one), then
trainer-1 holds right after its reduction until trainer-0 has reported its own (``SADD
...tg:ok:step:1:<epoch>``) and is killed there. The step is aborted
(trainer-1 never reported); every gradient it took with it (its running sum, or its blob with
``train.reduce: exact``) is trained again, and the step is asked for anew only once its
members hold every train task of the iteration again. A third case kills trainer-1 so at
two steps of one run (the second kill hits the restarted trainer-1).

The twin is the reference loop on the same config (``schedule.tsp: true``: the same packing of
a task's rows into one forward; ``max_staleness: 0``; RAT off, so no group is split into halves
and the sum's order is the reference's): with ``exact`` the run must equal it bit for bit
(``torch.equal``), with the all-reduce within its float32 round-off (1e-5, as the data plane's
other fault tests). Each iteration's trained rows and samples must be the twin's."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from digen.errors import JobCancelled
from digen.testing.faults import Fault
from tests.reliability.conftest import fault_config, max_diff, metrics, one_thread, run_job, timeline, weights

pytestmark = pytest.mark.slow

HANG_S = 300.0
"""A job still running then is cancelled (the test fails naming the hang): a fault-free run of
this job takes well under a minute."""

TWIN_ATOL = 1e-5
"""Max |weight - twin weight| with ``train.reduce: allreduce`` (a ring all-reduce adds the two
members' sums in another order than the reference: float32 round-off, as the data plane's
other fault tests bound it)."""


def chaos_config(model_dir: Path, reduce: str):
    return fault_config(
        model_dir,
        schedule={
            "mode": "digen",
            "max_staleness": 0,
            "tsp": True,
            "rat": False,
            # TAG decides from these, not from the measured speeds: the same roles every run
            "task_seconds": {"gen": 1.0, "train": 1.0},
        },
        cluster__local={"rollout_workers": 2, "trainer_workers": 2},
        train__reduce=reduce,
    )


@pytest.fixture(scope="module")
def twin(tiny_sd3: Path, tmp_path_factory) -> Path:
    """The fault-free twin: the reference loop with the chaos run's packing (``tsp``)."""
    from digen.reference import run_reference

    out = tmp_path_factory.mktemp("twin") / "run"
    cfg = fault_config(tiny_sd3, schedule={"mode": "reference", "tsp": True, "max_staleness": 0})
    with one_thread():
        run_reference(cfg, out)
    return out


def kill_after_other_reported(i: int) -> tuple[Fault, ...]:
    """Trainer-1 SIGKILLed the moment trainer-0 reported its reduction of step ``i``."""
    return (
        # each trainer trains one group of iteration i, whatever the speeds: trainer-1 keeps
        # its gradient until trainer-0 has leased the other group (a trainer-0 slow to come
        # back to the queue would leave both to trainer-1), and trainer-0 keeps its own until
        # trainer-1 computed one (so trainer-1 holds a gradient the step needs)
        Fault("fetch", "signal", worker="trainer-0", iteration=i, flag=f"t0-leased-{i}"),
        Fault("train", "hold", worker="trainer-1", iteration=i, flag=f"t0-leased-{i}", seconds=120),
        Fault("train", "signal", worker="trainer-1", iteration=i, flag=f"t1-trained-{i}"),
        Fault("train", "hold", worker="trainer-0", iteration=i, flag=f"t1-trained-{i}", seconds=120),
        # the step: trainer-0 reports its reduction; trainer-1, reduced too, dies right then
        Fault("reported", "signal", worker="trainer-0", iteration=i, flag=f"t0-reported-{i}"),
        Fault("reduced", "hold", worker="trainer-1", iteration=i, flag=f"t0-reported-{i}", seconds=120),
        Fault("reduced", "kill", worker="trainer-1", iteration=i),
    )


@pytest.mark.parametrize(
    ("reduce", "kill_at"),
    [("exact", (1,)), ("allreduce", (1,)), ("exact", (1, 2))],
    ids=["exact", "allreduce", "exact-twice"],
)
def test_a_trainer_killed_right_after_the_other_reported_its_reduction_loses_no_task(
    tiny_sd3: Path, twin: Path, tmp_path: Path, reduce: str, kill_at: tuple[int, ...]
):
    from digen.controlplane.redis_conn import connect
    from digen.controlplane.trainer_group import TrainerGroup

    cfg = chaos_config(tiny_sd3, reduce)
    out, job_id = tmp_path / "run", f"chaos-{reduce}-{len(kill_at)}"
    reasons: dict[str, str] = {}

    def progress(row: dict) -> None:
        # why any member aborted a step (written by the member); a restarted trainer that
        # acted on its predecessor's step command would leave a StateLost or a BlobLost here
        if "iteration" in row and "event" not in row:  # an iteration's row
            r = connect(None)
            group = TrainerGroup(r, job_id)
            for i in range(cfg.iterations):
                reasons.update({f"step:{i}/{w}": why for w, why in group.abort_reasons(f"step:{i}").items()})
            r.close()

    ctl = {}
    guard = threading.Timer(HANG_S, lambda: ctl["c"].job.set_status("cancel"))  # a hang fails, never waits
    guard.start()
    faults = [f for i in kill_at for f in kill_after_other_reported(i)]
    try:
        fired = run_job(cfg, out, job_id, *faults, progress=progress, on_start=lambda c: ctl.update(c=c))
    except JobCancelled:
        pytest.fail(f"the job hung: cancelled after {HANG_S:g} s; aborts: {ctl['c'].group.aborts}")
    finally:
        guard.cancel()
    got = sorted((f["iteration"], f["point"], f["action"], f["worker"]) for f in fired)
    who = [(e["task"], e["worker"]) for e in timeline(out) if e["kind"] == "train"]
    assert got == sorted((f.iteration, f.point, f.action, f.worker) for f in faults), (got, who)
    rows, want = metrics(out), metrics(twin)
    assert [m["iteration"] for m in rows] == [0, 1, 2]
    for field in ("samples", "dropped_samples", "trained_rows", "rewards"):
        assert [m[field] for m in rows] == [m[field] for m in want], field
    assert not any("dead_tasks" in m for m in rows)
    # a killed step's groups were trained again after the abort (both with the all-reduce:
    # trainer-0's sum is dropped too; with exact, trainer-1's blob only), generated once
    for i in kill_at:
        trains = sorted(e["task"] for e in timeline(out) if e["kind"] == "train" and e["iteration"] == i)
        assert sorted(set(trains)) == [f"train:{i}:0", f"train:{i}:1"], trains
        assert len(trains) == (4 if reduce == "allreduce" else 3), trains
    a, b = weights(out), weights(twin)
    if reduce == "exact":
        assert all(torch.equal(a[k], b[k]) for k in b), max_diff(a, b)
    else:
        assert max_diff(a, b) <= TWIN_ATOL
    steps = ctl["c"].group
    # one abort per kill, with trainer-1 gone; each restart formed a new epoch
    assert [(a["step"], a["gone"]) for a in steps.aborts] == [(f"step:{i}", ["trainer-1"]) for i in kill_at]
    assert steps.epoch >= 1 + len(kill_at)
    reasons.update({f"{a['step']}/{w}": why for a in steps.aborts for w, why in a["why"].items()})
    assert not any("StateLost" in why for why in reasons.values()), reasons
