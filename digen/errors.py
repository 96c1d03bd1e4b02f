"""digen's exceptions: one root, two exit codes.

The CLI turns a :class:`DigenError` into a one-line red message. ``exit_code`` 2 means the
user's input is wrong (config, paths, names); 1 means something failed at run time.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` naming the closest of ``choices`` to a mistyped ``name``, or ``""``."""
    close = difflib.get_close_matches(str(name), sorted(set(choices)), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


class DigenError(Exception):
    """Root of every error digen raises on purpose."""

    exit_code = 1


class ConfigError(DigenError):
    """Bad user input: config values, paths, names. Carries every problem found."""

    exit_code = 2

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


class ModelError(ConfigError):
    """A model folder that is missing or is not a diffusers pipeline."""


class RewardError(DigenError):
    """A reward that failed at run time (server down, scorer raised)."""


class ConnectionFailure(DigenError):
    """A service (Redis, Dask scheduler, reward server) that cannot be reached."""


class CheckpointError(DigenError):
    """A checkpoint that is missing or cannot be read."""

    exit_code = 2


class JobCancelled(DigenError):
    """A job stopped by ``digen cancel`` (or its ``cancelled`` check): the run directory keeps
    the last complete checkpoint, from which ``--resume`` continues."""


class TaskDropped(DigenError):
    """A task given up half-way because its job stopped (``digen cancel``): nothing is stored."""


class PayloadError(DigenError):
    """A payload read from Redis that is not a valid digen message (never unpickled)."""


class JobRefused(PayloadError):
    """An rq job in digen's queue that is not digen's job (another function, a payload that
    is not JSON or not a config and options): ``digen serve`` records it failed, never runs it."""


class AlgorithmError(DigenError, ValueError):
    """Bad arguments to a pure tensor algorithm (``digen.algos``): names the argument, value and fix.

    Also a ``ValueError``, so callers that treat algorithm inputs like ordinary Python
    arguments can catch it as one.
    """
