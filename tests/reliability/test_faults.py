"""The fault suite: workers die, stall and lose Redis mid-job; the job completes with exactly the
samples and weights of a fault-free run (max_staleness 0, compared with the reference trainer).

Faults are injected inside the worker processes at named points (digen.testing.faults)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from digen.testing.faults import Fault, arm, clear, fired, point
from tests.reliability.conftest import (
    assert_equals_reference,
    assert_exactly_once,
    fault_config,
    run_job,
    timeline,
)

pytestmark = pytest.mark.slow


def test_workers_killed_mid_training_mid_generation_before_ack_and_mid_weight_sync(
    tiny_sd3: Path, reference: Path, tmp_path: Path
):
    cfg = fault_config(
        tiny_sd3,
        schedule={"mode": "disaggregated", "gap": True, "max_staleness": 0},
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
    )
    out = tmp_path / "run"
    fired = run_job(
        cfg,
        out,
        "faults-kill",
        Fault("train", "kill", worker="trainer-0", iteration=0),
        Fault("gen", "kill", worker="rollout-0", iteration=1),
        Fault(
            "sync", "kill", worker="rollout-0", iteration=2
        ),  # taking in version 2, fetched from the trainer
        Fault("ack", "kill", worker="rollout-0", iteration=2),  # its data stored, not acknowledged
    )
    assert [(f["point"], f["worker"], f["iteration"]) for f in fired] == [
        ("train", "trainer-0", 0),
        ("gen", "rollout-0", 1),
        ("sync", "rollout-0", 2),
        ("ack", "rollout-0", 2),
    ]
    assert len({f["pid"] for f in fired}) == 4  # four different processes died
    assert_exactly_once(out)
    assert_equals_reference(out, reference)


def test_a_worker_killed_mid_batch_has_every_task_of_the_batch_run_again_and_counted_once(
    tiny_sd3: Path, reference: Path, tmp_path: Path
):
    cfg = fault_config(
        tiny_sd3,
        schedule={"mode": "disaggregated", "gap": True, "max_staleness": 0},
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
        rollout__max_batch=2,  # an iteration's two groups: one batch
    )
    out = tmp_path / "run"
    # the batch's first group generated, nothing of it stored or acknowledged
    kill = Fault("gen", "kill", worker="rollout-0", iteration=1)
    (hit,) = run_job(cfg, out, "faults-batch", kill)
    gens = [e for e in timeline(out) if e["kind"] == "gen"]
    assert [e.get("batch") for e in gens] == [2] * 6  # every iteration ran as one batch of two
    again = [e for e in gens if e["iteration"] == 1]
    assert len(again) == 2 and all(e["start"] > hit["t"] for e in again)  # both run after the kill
    assert_exactly_once(out)
    assert_equals_reference(
        out, reference
    )  # within float32 round-off (tests/trainer/test_batched_generation.py)


def test_loop_crash_worker_stalled_past_its_lease_and_worker_cut_off_from_redis(
    tiny_sd3: Path, reference: Path, tmp_path: Path
):
    # colocated: both workers take every kind of task, so a re-delivered task finds a taker
    cfg = fault_config(
        tiny_sd3,
        schedule={"mode": "colocated", "max_staleness": 0, "lease_s": 4.0},
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
    )
    out = tmp_path / "run"
    fired = run_job(
        cfg,
        out,
        "faults-stall",
        Fault("start", "raise", worker="trainer-0"),  # a crashed loop: its process restarts
        Fault("gen", "stall", iteration=1, seconds=9.0),  # its lease expires; the other worker runs it
        Fault("train", "drop_redis", iteration=2, seconds=3.0),  # connections closed, refused for 3 s
    )
    assert [(f["point"], f["action"]) for f in fired] == [
        ("start", "raise"),
        ("gen", "stall"),
        ("train", "drop_redis"),
    ]
    assert_exactly_once(out)
    assert_equals_reference(out, reference)


def test_a_worker_loop_that_keeps_crashing_fails_the_job_with_its_error(tiny_sd3: Path, tmp_path: Path):
    from digen.errors import DigenError

    cfg = fault_config(
        tiny_sd3,
        schedule={"mode": "disaggregated", "gap": True, "max_staleness": 0, "max_attempts": 2},
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
    )
    with pytest.raises(DigenError) as err:  # a model that never loads on that node, say
        run_job(cfg, tmp_path / "run", "faults-crash", Fault("start", "raise", worker="trainer-0", times=10))
    msg = str(err.value)
    assert msg.startswith(
        "the worker loop on trainer-0 failed 2 times in a row (InjectedFault: injected fault"
    )
    assert "--resume" in msg and "\n" not in msg and err.value.exit_code == 1


def test_hold_waits_for_the_signal_of_another_worker():
    from digen.controlplane.jobstate import JobState
    from digen.controlplane.redis_conn import connect

    r = connect(None)
    job = JobState(r, "faults-hold")
    clear(r, "faults-hold")
    try:
        arm(
            r,
            "faults-hold",
            Fault("train", "hold", worker="t0", flag="helped", seconds=300),
            Fault("train", "signal", worker="r0", flag="helped"),
            Fault("gen", "hold", worker="t0", flag="never", seconds=0.05),
        )
        went_on: list[bool] = []

        def hold() -> None:
            point("train", job, "t0", task="a")
            went_on.append(True)

        held = threading.Thread(target=hold, daemon=True)
        held.start()
        # a hold is recorded before it waits: signalled only once it is, whatever the speeds
        deadline = time.monotonic() + 60  # guards against a hang only
        while not fired(r, "faults-hold"):
            assert time.monotonic() < deadline, "the thread never reached its hold"
            time.sleep(0.01)
        assert held.is_alive() and not went_on  # no signal yet: it waits (for up to 300 s)
        point("train", job, "r0", task="b")
        held.join(timeout=60)
        assert went_on == [True], fired(r, "faults-hold")  # the task goes on once signalled
        point("gen", job, "t0", task="c")  # never signalled: goes on after its guard
        got = [(f["action"], f["worker"], f["task"]) for f in fired(r, "faults-hold")]
        assert got == [
            ("hold", "t0", "a"),
            ("signal", "r0", "b"),
            ("hold", "t0", "c"),
            ("hold_expired", "t0", "c"),
        ]
        with pytest.raises(ValueError, match="needs a flag"):
            arm(r, "faults-hold", Fault("gen", "hold"))
    finally:
        clear(r, "faults-hold")
        r.close()
