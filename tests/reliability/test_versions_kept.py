"""The trainers keep serving every weights version that generation not yet done will load.

With mini-batches at staleness 1, an iteration's first optimizer step may run while its last
groups still generate (GAP trains mini-batch 0 as soon as its groups are scored). Those groups
generate with the version the iteration started generating with, two steps older than the
one the trainers then hold; a rollout worker that has to fetch it again (restarted, or one
that loaded another version meanwhile) must still find a trainer serving it."""

from __future__ import annotations

from pathlib import Path

import pytest

from digen.testing.faults import Fault
from tests.reliability.conftest import assert_exactly_once, fault_config, run_job

# a job on its own local cluster with faults in its workers
pytestmark = pytest.mark.slow


def test_a_group_still_generating_after_its_iterations_first_step_can_fetch_its_version(
    tiny_sd3: Path, tmp_path: Path
):
    cfg = fault_config(
        tiny_sd3,
        iterations=4,
        schedule__mode="digen",
        schedule__tag=False,
        schedule__rat=False,
        schedule__max_staleness=1,
        train__mini_batches=2,
        train__global_std=False,
        cluster__local={"rollout_workers": 1, "trainer_workers": 1},
    )
    # iteration 2 generates with version 2 (M = 2: the version iteration 1 started from);
    # rollout-0 holds its group 1 until iteration 2's first step (version 4 -> 5) has been
    # reported, then dies: its restarted process fetches version 2 again to generate group 1
    fired = run_job(
        cfg,
        tmp_path / "run",
        "versions-kept",
        Fault("reported", "signal", worker="trainer-0", task="step:2:0", flag="stepped"),
        Fault("gen", "hold", worker="rollout-0", task="gen:2:1", flag="stepped", seconds=300),
        Fault("gen", "kill", worker="rollout-0", task="gen:2:1"),
    )
    actions = [(f["action"], f["task"]) for f in fired]
    assert ("hold_expired", "gen:2:1") not in actions, fired
    assert {("signal", "step:2:0"), ("hold", "gen:2:1"), ("kill", "gen:2:1")} <= set(actions), fired
    assert_exactly_once(tmp_path / "run")
