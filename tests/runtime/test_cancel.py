"""Cancelling a running job mid-iteration (real embedded Redis, real Dask local cluster): the
controller notices it while waiting on tasks, releases nothing more, the worker loops stop,
the run directory keeps the last complete iteration's checkpoint and ``--resume`` finishes
the job. The cancel is triggered by an event (a task of iteration 1 acknowledged after
iteration 0's checkpoint), never by a sleep.

Both modes cancel and resume on the module's warm workers (``warm_cluster(1, 1)``): the
guarantee is about the controller and the worker loops, not the processes, and a resumed job
that finishes on the very workers the cancelled one ran on shows their loops stopped and
left nothing behind for the next job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from digen.core.events import TaskRef
from digen.errors import JobCancelled
from digen.runtime.controller import run_distributed

pytestmark = pytest.mark.slow


def iterations_logged(run: Path) -> list[int]:
    return [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


@pytest.mark.parametrize("mode", ["disaggregated", "digen"])
def test_cancel_mid_iteration_keeps_the_last_checkpoint_and_resumes(
    small_config, tmp_path, warm_cluster, mode
):
    cfg = small_config(
        iterations=3, schedule__mode=mode, output__keep_checkpoints=3, output__sample_grid_every=0
    )
    out = tmp_path / "run"
    scheduler = warm_cluster(1, 1)
    seen: dict = {}

    def cancelled() -> bool:
        ctl = seen["ctl"]
        if ctl.run.latest_checkpoint() is None:
            return False
        acked = [t for t in ctl.ledger.collected if TaskRef.parse(t).iteration == 1]
        if acked and "acked" not in seen:
            seen["acked"], seen["books"] = acked, sorted(ctl.ledger.books)
        return bool(acked)

    with pytest.raises(
        JobCancelled, match="cancelled during iteration 1; the checkpoint .*iter_0000 is kept"
    ):
        run_distributed(
            cfg,
            out,
            scheduler=scheduler,
            on_start=lambda ctl: seen.setdefault("ctl", ctl),
            cancelled=cancelled,
        )

    ctl = seen["ctl"]
    assert seen["books"][0] == 1  # cancelled with iteration 1 under way (digen: 2's generation too)
    assert 1 in ctl.ledger.books  # ... and it never completed: no step, no metrics row, no checkpoint
    assert iterations_logged(out) == [0]
    assert checkpoints(out) == ["iter_0000"]

    summary = run_distributed(cfg, out, scheduler=scheduler, resume=True)
    assert iterations_logged(out) == [0, 1, 2]
    assert checkpoints(out) == ["iter_0000", "iter_0001", "iter_0002"]
    assert summary["iterations"] == 3
