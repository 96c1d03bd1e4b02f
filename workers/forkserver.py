"""Imported last by the fork server (:data:`digen.runtime.cluster.FORKSERVER_PRELOAD`): the
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
    importlib.import_module("digen.trainer")


def freeze() -> None:
    """Collect once, then freeze what is left (see the module docstring)."""
    gc.collect()
    gc.freeze()


def in_fork_server() -> bool:
    """True in the process :mod:`multiprocessing.forkserver` runs (its ``main`` is on the stack)."""
    import sys

    frame = sys._getframe()
    while frame is not None:
        if frame.f_globals.get("__name__") == "multiprocessing.forkserver" and frame.f_code.co_name == "main":
            return True
        frame = frame.f_back
    return False


if in_fork_server():
    import_model_code()
    freeze()
