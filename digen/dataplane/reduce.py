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

Both refuse a gradient that is not shaped as the trained tensors (:func:`check_gradient`):
other names, another shape (PyTorch's ``+=`` would broadcast a shape-[1] tensor into every
row), another dtype (a float64 gradient would be rounded silently). The trained tensors are
``like`` when given (the trainer's parameters), else the first gradient summed, which must be
float32 (the trainers' gradients are: :func:`~digen.training.task_gradient`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

from digen.errors import DigenError


class GradientMismatch(DigenError):
    """A gradient whose names, shapes or dtypes are not the trained tensors'."""


def check_gradient(grads: Mapping[str, torch.Tensor], like: Mapping[str, torch.Tensor], what: str) -> None:
    """Refuse ``grads`` unless it has exactly ``like``'s names, and each tensor its shape and dtype."""
    if set(grads) != set(like):
        extra, missing = sorted(set(grads) - set(like)), sorted(set(like) - set(grads))
        raise GradientMismatch(
            f"{what}: not the trained tensors (extra {extra[:3]}, missing {missing[:3]})"[:300]
        )
    for k, g in grads.items():
        want = like[k]
        if tuple(g.shape) != tuple(want.shape) or g.dtype != want.dtype:
            raise GradientMismatch(
                f"{what}: tensor {k[:120]} is {g.dtype} {list(g.shape)[:8]}, "
                f"the trained one {want.dtype} {list(want.shape)[:8]}"
            )


def _check_first(grads: Mapping[str, torch.Tensor], what: str) -> None:
    if not grads:
        raise GradientMismatch(f"{what}: an empty gradient")
    odd = next((k for k, g in grads.items() if g.dtype != torch.float32), None)
    if odd is not None:
        raise GradientMismatch(f"{what}: tensor {odd[:120]} is {grads[odd].dtype}, not float32")


def ordered_sum(
    parts: Iterable[dict[str, torch.Tensor]], like: Mapping[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """``parts[0] + parts[1] + ...`` tensor by tensor, left to right (the first part cloned):
    the reference's summation order. Every part must be shaped as ``like`` (else as the first
    part, float32): :class:`GradientMismatch`."""
    total: dict[str, torch.Tensor] | None = None
    for i, part in enumerate(parts):
        if like is not None:
            check_gradient(part, like, f"gradient {i} of the sum")
        elif total is None:
            _check_first(part, f"gradient {i} of the sum")
        else:
            check_gradient(part, total, f"gradient {i} of the sum")
        if total is None:
            total = {k: v.clone() for k, v in part.items()}
        else:
            for k, v in part.items():
                total[k] += v.to(total[k].device)  # a fetched part on the host, an own one on a GPU
    if total is None:
        raise ValueError("ordered_sum of no gradient")
    return total


class TaskSum:
    """A trainer's running sum of the task gradients it holds for the next step, and which
    tasks they are (the controller checks the set before the step counts it).

    The sum lives in one flat float32 buffer (:attr:`flat`; :attr:`total` views it per
    tensor, names sorted as the optimizer's), so the step all-reduces it in place, in one call,
    with no copy: at a FLUX LoRA r64's 684 MiB, one buffer instead of three. The buffer is on
    the trained tensors' device (``like``'s; else the first gradient's): on a GPU trainer the
    tasks' gradients are added there, by the GPU, and one fetched from a peer (a rollout
    worker's, under RAT) is copied there first."""

    def __init__(self, like: Mapping[str, torch.Tensor] | None = None) -> None:
        self.flat: torch.Tensor | None = None
        self.total: dict[str, torch.Tensor] | None = None
        self.tasks: list[str] = []
        self.like = like
        """The trained tensors every gradient must match (None: the first gradient added)."""

    def add(self, task_id: str, grads: dict[str, torch.Tensor]) -> None:
        """Add one task's gradient (the first is copied in: ``0 + g`` is not computed); one
        not shaped as the trained tensors is refused (:class:`GradientMismatch`) and changes
        nothing."""
        what = f"the gradient of task {task_id[:120]}"
        if self.like is not None:
            check_gradient(grads, self.like, what)
        elif self.total is None:
            _check_first(grads, what)
        else:
            check_gradient(grads, self.total, what)
        if self.total is None:
            names = sorted(grads)
            device = next(iter(self.like.values())).device if self.like else grads[names[0]].device
            self.flat = torch.empty(sum(grads[n].numel() for n in names), dtype=torch.float32, device=device)
            self.total = unflatten(self.flat, names, grads)
            for k in names:
                self.total[k].copy_(grads[k])
        else:
            for k, v in grads.items():
                self.total[k] += v.to(self.total[k].device)
        self.tasks.append(task_id)

    def clear(self) -> None:
        self.flat, self.total, self.tasks = None, None, []


def flatten(
    grads: dict[str, torch.Tensor] | None, names: list[str], like: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """One float32 vector of ``grads`` in ``names`` order (zeros where ``grads`` is None: a
    trainer that ran no task this step), shaped after ``like``."""
    if grads is None:
        return torch.zeros(
            sum(like[n].numel() for n in names), dtype=torch.float32, device=like[names[0]].device
        )
    return torch.cat([grads[n].reshape(-1).to(torch.float32) for n in names])


def unflatten(
    flat: torch.Tensor, names: list[str], like: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
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
