"""Imported last by the fork server (:data:`digen.cluster.cluster.FORKSERVER_PRELOAD`): the
code a worker's policy load and loop import, imported once for every worker forked from it,
then frozen so the forked workers keep sharing those pages.

- :func:`import_model_code` imports every supported family's diffusers pipeline class (and,
  through them, the models, schedulers, LoRA loaders and scipy/onnxruntime that diffusers pulls
  in on a pipeline's first use), and digen's rewards. Without it each worker imports them
  itself after the fork, about 55 MiB of private memory per worker on the quickstart
  (measured with psutil's USS); all five families cost 4 MiB more than one.
- :func:`freeze` moves every object made so far into the garbage collector's permanent
  generation (``gc.freeze``): a collection in a forked worker then never writes to those
  objects' headers, so the pages stay shared copy-on-write instead of being copied into
  every worker.

Importing this module anywhere but in the fork server does nothing beyond the imports.
"""

from __future__ import annotations

import gc
import importlib
import logging
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)


def import_model_code() -> None:
    """Import the pipeline classes of :data:`digen.models.registry.FAMILIES` and the rewards
    (a family whose pipeline this diffusers lacks is skipped: its load names the problem)."""
    import diffusers

    from digen.models.registry import FAMILIES

    for family in FAMILIES.values():
        for name in family.pipelines:
            try:
                getattr(diffusers, name)
            except (AttributeError, ImportError) as exc:
                log.debug("fork server: pipeline %s not imported (%s)", name, exc)
    importlib.import_module("digen.rewards")
    importlib.import_module("digen.assembly")


def freeze() -> None:
    """Collect once, then freeze what is left (see the module docstring)."""
    gc.collect()
    gc.freeze()


def in_fork_server() -> bool:
    """True in the process :mod:`multiprocessing.forkserver` runs (its ``main`` is on the stack)."""
    import sys
    from types import FrameType

    frame: FrameType | None = sys._getframe()
    while frame is not None:
        if frame.f_globals.get("__name__") == "multiprocessing.forkserver" and frame.f_code.co_name == "main":
            return True
        frame = frame.f_back
    return False


# ---------------------------------------------------------------------------------------
# the fork server as a fork of the controller

_kept: list[object] = []
"""What the forked server detached from the controller (log handlers, streams): kept alive so
that no finalizer closes a file descriptor number the server has reused since."""


_FORK_UNSAFE = ("onnxruntime",)
"""Modules whose import starts native thread pools that a forked child inherits broken (the
OCR reward's onnxruntime): loaded before the fork, the server is spawned instead."""


def start_forked_server(preload: Sequence[str], shared: Sequence[str] = ()) -> int | None:
    """Start :mod:`multiprocessing`'s fork server as a fork of this process; its pid, or
    ``None`` where it cannot be done safely (no ``os.fork``; CUDA initialised here; a second
    thread running or a :data:`_FORK_UNSAFE` module loaded), in which
    case multiprocessing spawns its own server on first use, as it always does.

    Why: a spawned server imports Dask again, memory that this process also holds; forked,
    the server and every worker it forks share this process's pages copy-on-write, and the
    workers share the torch and diffusers the server imports once. Python 3.11's ``ForkServer.ensure_running`` spawns
    ``python -c 'from multiprocessing.forkserver import main; main(...)'``; this does what
    that does (listener socket, "alive" pipe, the server's fields) but forks instead of
    spawning, then runs the same ``main``.

    Call it before this process computes anything with torch: the OpenMP runtime of torch's
    CPU build keeps a thread pool that a forked child cannot use (a parallel op on the thread
    that forked hangs; seen here with one matmul on the parent's main thread before
    ``os.fork``, then one on the child's main thread, where a Dask worker runs
    ``client.run``; its task threads start pools of their own). The CLI calls it first
    thing in ``digen train`` and ``digen bench``, the test session before it collects; any
    other caller gets the spawned server. ``shared`` is imported here first (what this
    process shares with the server: Dask); ``preload`` (the workers' code, torch with it) and
    the families' pipeline code (:func:`import_model_code`) are imported by the server after
    the fork: the controller imports no torch."""
    import multiprocessing.forkserver as mpfs
    import os
    import socket
    import sys
    import threading
    from multiprocessing import connection, resource_tracker, util

    if not hasattr(os, "fork") or not sys.platform.startswith("linux"):
        return None
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return None  # CUDA cannot be used in a forked child
    # the server's private fields (pid, address, alive fd, lock), which typeshed leaves out:
    # this sets them as ensure_running does
    srv: Any = mpfs._forkserver
    if srv._forkserver_pid is not None:
        return srv._forkserver_pid  # running already (ensure_running restarts one that died)
    unsafe = [m for m in _FORK_UNSAFE if m in sys.modules]
    if threading.active_count() > 1 or unsafe:
        log.debug("fork server spawned, not forked: threads %s, loaded %s", threading.enumerate(), unsafe)
        return None  # a fork copies no thread, only the locks they held
    _import_all(shared)
    resource_tracker.ensure_running()
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]  # private: not in typeshed
    listener.bind(address)
    if not util.is_abstract_socket_namespace(address):
        os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    freeze()  # the pages this process holds now stay shared: no collection here writes to them
    pid = os.fork()
    if pid == 0:  # the server
        code = 1
        try:
            srv._lock = threading.Lock()  # another thread of the parent may have held it
            fd = listener.detach()
            _become_server(keep={0, 1, 2, fd, alive_r})
            _import_all(preload)
            import_model_code()
            freeze()
            code = 0
            mpfs.main(fd, alive_r, [])
        except SystemExit:
            pass  # main's way out: every holder of the "alive" pipe closed it
        except BaseException:  # noqa: BLE001 - reported on the server's stderr, then it exits
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)  # never the parent's atexit hooks (embedded Redis, run files)
    os.close(alive_r)
    listener.close()
    srv._forkserver_address = address
    srv._forkserver_alive_fd = alive_w
    srv._forkserver_pid = pid
    log.debug("fork server %d forked from this process", pid)
    return pid


def _import_all(names: Sequence[str]) -> None:
    """Import ``names`` (a missing one is skipped; never this module: it is the server's)."""
    for name in names:
        if name != __name__:
            try:
                importlib.import_module(name)
            except ImportError:
                pass


def _become_server(keep: set[int]) -> None:
    """In the forked server: leave the parent's state a spawned server would not have: file
    descriptors (all but ``keep``), signal handlers, fault handler, redirected streams and log
    handlers (Dask's stderr handlers installed afresh, as its import does in a new process)."""
    import faulthandler
    import os
    import signal
    import sys

    import dask
    from distributed.config import initialize_logging

    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    refault = faulthandler.is_enabled()
    faulthandler.disable()
    _kept.extend([sys.stdout, sys.stderr, sys.stdin])
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    for lg in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        if isinstance(lg, logging.Logger):
            _drop_parent_handlers(lg)
    logging.getLogger().setLevel(logging.WARNING)
    fds = sorted(int(f) for f in os.listdir("/proc/self/fd") if int(f) not in keep)
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass  # the listing's own descriptor, closed already
    initialize_logging(dask.config.config)
    if refault:
        faulthandler.enable()


FRESH_LOGGERS = (
    "root",
    "distributed",
    "distributed.client",
    "distributed.gc",
    "bokeh",
    "tornado",
    "tornado.application",
)
"""Loggers whose handlers the server drops whatever they write to (Dask installs its own afresh)."""


def _drop_parent_handlers(lg: logging.Logger) -> None:
    """Drop a logger's handlers that write anywhere but the standard streams: the descriptors
    they write to are closed in the server, and the numbers are reused there and in every
    worker it forks (for the fork server's alive pipe, the resource tracker's pipe...), so a
    log record would land in one of those (a test runner's log file handler, copied by torch
    onto its loggers, once wrote a torch.distributed error into the alive pipe and the server
    exited). Root's and Dask's handlers all go: Dask installs its own afresh."""
    import sys

    fresh = lg.name in FRESH_LOGGERS
    keep: list[logging.Handler] = []
    for h in lg.handlers:
        stream = getattr(h, "stream", None)
        try:
            fd = stream.fileno() if stream is not None else None
        except (OSError, ValueError, AttributeError):
            fd = None  # no descriptor (an in-memory stream): nothing to land elsewhere
        if fresh or isinstance(h, logging.FileHandler) or (fd is not None and fd not in (0, 1, 2)):
            _kept.append(h)
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler) and not fresh:
                keep.append(_stderr_twin(h, sys.__stderr__))
            continue
        keep.append(h)
    lg.handlers = keep


def _stderr_twin(h: logging.StreamHandler, stream) -> logging.StreamHandler:
    """A stream handler like ``h`` (level, formatter, filters) that writes to ``stream``."""
    twin = logging.StreamHandler(stream)
    twin.setLevel(h.level)
    twin.setFormatter(h.formatter)
    for f in h.filters:
        twin.addFilter(f)
    return twin


if in_fork_server():
    import_model_code()
    freeze()
