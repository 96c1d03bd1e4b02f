"""The version rule: which weights version an iteration's work uses, one function of iteration,
mini-batch and M.

Version v is the weights after v optimizer steps. An iteration takes ``M = train.mini_batches``
steps, one per mini-batch, so mini-batch m of iteration i steps from version ``M i + m``
(:func:`version`); every other version the scheduler, the controller, the workers and the
evaluation name is that rule at some (i, m):

- :func:`published_after`: the weights after iteration i's last step, ``M (i + 1)`` (what an
  evaluation after iteration i scores);
- :func:`generation_version`: iteration i generates with ``M max(0, i - s)`` (staleness s,
  counted in iterations);
- :func:`kept_version`: at staleness s > 0 the trainers keep serving the version the next
  iteration generates with while the current iteration's steps run;
- :func:`iteration_of`: the iteration whose steps made version v (-1 for version 0).
"""

from __future__ import annotations


def version(iteration: int, mini_batch: int, mini_batches: int) -> int:
    """The version mini-batch ``mini_batch`` of iteration ``iteration`` steps from: ``M i + m``."""
    return mini_batches * iteration + mini_batch


def published_after(iteration: int, mini_batches: int) -> int:
    """The version after iteration ``iteration``'s last optimizer step."""
    return version(iteration + 1, 0, mini_batches)


def generation_version(iteration: int, mini_batches: int, max_staleness: int) -> int:
    """The version iteration ``iteration`` generates with (``max_staleness`` in iterations)."""
    return version(max(0, iteration - max_staleness), 0, mini_batches)


def kept_version(iteration: int, mini_batches: int, max_staleness: int | None) -> int | None:
    """The older version the trainers keep serving while iteration ``iteration`` steps: the one
    the next iteration generates with (None at staleness 0: no rollout runs ahead)."""
    return generation_version(iteration + 1, mini_batches, max_staleness) if max_staleness else None


def iteration_of(v: int, mini_batches: int) -> int:
    """The iteration whose optimizer steps made version ``v`` (-1 for version 0)."""
    return (v - 1) // mini_batches


def iterations_behind(iteration: int, v: int, mini_batches: int) -> int:
    """How many iterations behind ``iteration`` the generation version ``v`` is."""
    return iteration - v // mini_batches
