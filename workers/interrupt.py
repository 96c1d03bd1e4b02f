"""A Dask preload of the embedded cluster's worker processes: a Ctrl-C is the controller's.

A Ctrl-C at the terminal sends SIGINT to every process of ``digen train``'s process group, the
local cluster's worker processes included. Each one died of it (its asyncio runner turns
SIGINT into ``KeyboardInterrupt``), printing Dask's tracebacks, before its loop had seen the
job stop, and the controller waited for loops that would never answer. The workers ignore
SIGINT instead: the controller stops the job (its status leaves ``running``, the loops drop
their task and return) and closes the cluster, which ends them. ``digen worker`` on a node of
its own keeps its SIGINT (digen.cluster.node).
"""

from __future__ import annotations

import signal


def dask_setup(worker) -> None:  # noqa: ARG001 - Dask's preload hook
    """Ignore SIGINT in this worker process (Dask runs the hook in the process's main thread)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
