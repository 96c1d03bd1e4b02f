"""A collective whose peer is gone raises in the survivor: the failure the trainer's step abort
(:meth:`digen.workers.trainer.Member.run_step`) is built on.

Two real processes form a gloo group as digen's groups form; once both have all-reduced,
rank 1 is SIGKILLed (its sockets close: gloo sees it at once) or SIGSTOPped (alive, silent: what
a dead GPU or a hung NCCL peer looks like; only the group's timeout ends the wait) while rank 0
is in, or entering, a second all-reduce. Rank 0 must raise, not hang, and then leave the broken
group (``destroy_process_group``, as the member's ``leave_group`` does). NCCL cannot run here:
``tests/parallel/test_group_settings.py`` checks the settings that make an NCCL group fail the
same way (a timeout inside the lease, ``TORCH_NCCL_BLOCKING_WAIT``,
``TORCH_NCCL_ASYNC_ERROR_HANDLING``), and the trainer-group fault tests
(``tests/reliability/test_dataplane_faults.py``) run the whole step abort.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from tests.parallel import _dead_peer_worker as w

pytestmark = pytest.mark.slow

TIMEOUT_S = 5.0
"""The group's collective timeout (the lease a gloo group takes as its timeout)."""
GUARD_S = 180.0
"""Only against a hang: process start-up on a loaded machine, then the collective."""


def _wait_for(path: Path, ctx, deadline: float, killed=None) -> dict:
    """Wait for the file ``path`` a rank writes; fail at once if a rank other than ``killed``
    (the one the test killed on purpose) died."""
    while not path.exists():
        dead = [p.exitcode for p in ctx.processes if p.exitcode is not None and p is not killed]
        if dead or time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"no {path.name} (exit codes {dead}, or past {GUARD_S:.0f} s)")
        time.sleep(0.05)  # polling a file the rank writes
    return json.loads(path.read_text())


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_collective_with_a_dead_peer_raises_in_the_survivor(tmp_path: Path, how: str):
    ctx = mp.start_processes(
        w.run_rank, args=(2, str(tmp_path), TIMEOUT_S), nprocs=2, join=False, start_method="spawn"
    )
    survivor, peer = ctx.processes
    deadline = time.monotonic() + GUARD_S
    try:
        assert _wait_for(tmp_path / "ready-1", ctx, deadline) == {"sum": [2.0] * 4}
        assert _wait_for(tmp_path / "entering", ctx, deadline) == {"sum": [2.0] * 4}
        os.kill(peer.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        result = _wait_for(tmp_path / "result", ctx, deadline, killed=peer)
        survivor.join(GUARD_S)
        assert survivor.exitcode == 0
        assert result["raised"] is not None, result  # the collective did not complete without its peer
        # and the survivor leaves the broken group, free to form the next one
        assert result["destroyed"] == "ok" and result["initialized_after"] is False, result
        if how == "stop":  # only the timeout could end it: the peer's sockets stayed open
            assert result["elapsed_s"] >= TIMEOUT_S * 0.9, result
    finally:
        for p in ctx.processes:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(10)
