"""Summing gradients: a trainer's running sum of its tasks, and the two ways a step sums them.

``train.reduce: allreduce`` (default): each trainer adds every train task it ran (and whose
acknowledgement won) into one running sum as it finishes (:class:`TaskSum`); at the step the
trainers all-reduce their sums (``torch.distributed``: NCCL on GPU, gloo on CPU), a ring that
moves ``2 (N-1)/N`` times the gradient's bytes per trainer whatever the task count. The float
result depends on which trainer ran which task, in which order: it equals the reference's up to
float32 re-association (the tolerance of ``docs/guarantees.md``).

``train.reduce: exact``: every task's gradient is kept whole where it was computed; at the step
each trainer fetches them all and folds them in (group, part) order (:func:`ordered_sum`), the
order of the reference loop's :meth:`~digen.iteration.IterationBook.gradient`, so the result is
the reference's bit for bit. It moves every task's gradient to every trainer: for tests and
checks, not for speed.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def ordered_sum(parts: Iterable[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """``parts[0] + parts[1] + ...`` tensor by tensor, left to right (the first part cloned):
    the reference's summation order."""
    total: dict[str, torch.Tensor] | None = None
    for part in parts:
        if total is None:
            total = {k: v.clone() for k, v in part.items()}
        else:
            for k, v in part.items():
                total[k] += v
    if total is None:
        raise ValueError("ordered_sum of no gradient")
    return total


class TaskSum:
    """A trainer's running sum of the task gradients it holds for the next step, and which
    tasks they are (the controller checks the set before the step counts it).

    The sum lives in one flat float32 buffer (:attr:`flat`; :attr:`total` views it per
    tensor, names sorted as the optimizer's), so the step all-reduces it in place, in one call,
    with no copy: at a FLUX LoRA r64's 684 MiB, one buffer instead of three."""

    def __init__(self) -> None:
        self.flat: torch.Tensor | None = None
        self.total: dict[str, torch.Tensor] | None = None
        self.tasks: list[str] = []

    def add(self, task_id: str, grads: dict[str, torch.Tensor]) -> None:
        """Add one task's gradient (the first is copied in: ``0 + g`` is not computed)."""
        if self.total is None:
            names = sorted(grads)
            first = grads[names[0]]
            self.flat = torch.empty(
                sum(grads[n].numel() for n in names), dtype=torch.float32, device=first.device
            )
            self.total = unflatten(self.flat, names, grads)
            for k in names:
                self.total[k].copy_(grads[k])
        else:
            for k, v in grads.items():
                self.total[k] += v
        self.tasks.append(task_id)

    def clear(self) -> None:
        self.flat, self.total, self.tasks = None, None, []


def flatten(
    grads: dict[str, torch.Tensor] | None, names: list[str], like: dict[str, torch.Tensor]
) -> torch.Tensor:
    """One float32 vector of ``grads`` in ``names`` order (zeros where ``grads`` is None: a
    trainer that ran no task this step), shaped after ``like``."""
    if grads is None:
        return torch.zeros(
            sum(like[n].numel() for n in names), dtype=torch.float32, device=like[names[0]].device
        )
    return torch.cat([grads[n].reshape(-1).to(torch.float32) for n in names])


def unflatten(flat: torch.Tensor, names: list[str], like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`flatten`: views of ``flat`` shaped as ``like``'s tensors."""
    out, pos = {}, 0
    for n in names:
        k = like[n].numel()
        out[n] = flat[pos : pos + k].view(like[n].shape)
        pos += k
    return out


def all_reduce_sum(flat: torch.Tensor, group=None) -> torch.Tensor:
    """Sum ``flat`` over the group's ranks in place (a ring all-reduce); returns it. Every rank
    ends with the same bits (each chunk is summed once, then broadcast)."""
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    return flat
