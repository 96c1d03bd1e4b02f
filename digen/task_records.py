"""What the tasks of an iteration say, as plain records: no torch.

The controller plans and books an iteration with these alone (it holds no tensor), the
reference loop with the same code, and the workers read them from their payloads:

- :func:`plan_groups`: the iteration's generation tasks (:class:`GroupTask`), one per prompt
  group, the prompts a seeded shuffle of the list (:func:`digen.seeding.permutation`);
- :class:`TrainSpec`: what a train task says (its samples and their advantages); the steps
  each sample trains are drawn by the trainer, where the algorithm is
  (:func:`digen.training.drawn_steps`);
- :class:`TrainStats`: the sums a train task reports back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from digen.config import Config
from digen.records import Record
from digen.seeding import permutation

if TYPE_CHECKING:
    from digen.algos.loss import LossTerms


@dataclass(frozen=True)
class GroupTask(Record):
    """What a generation task says: which samples of which iteration, with which weights."""

    iteration: int
    group: int
    prompt: str
    sample_ids: tuple[int, ...]
    version: int


def iteration_prompts(prompts: list[str], seed: int, iteration: int, count: int) -> list[str]:
    """The ``count`` prompts of an iteration: a seeded shuffle of the list, cycled (the
    shuffle ``torch.randperm`` draws from the iteration's ``"prompts"`` stream,
    :func:`digen.seeding.iteration_generator`)."""
    order = permutation(len(prompts), seed, iteration, "prompts")
    return [prompts[order[i % len(order)]] for i in range(count)]


def plan_groups(cfg: Config, prompts: list[str], iteration: int, version: int) -> list[GroupTask]:
    """The generation tasks of one iteration, in group order."""
    g = cfg.rollout.group_size
    chosen = iteration_prompts(prompts, cfg.seed, iteration, cfg.rollout.prompts_per_iteration)
    return [
        GroupTask(iteration, i, p, tuple(range(i * g, (i + 1) * g)), version) for i, p in enumerate(chosen)
    ]


@dataclass
class TrainSpec(Record):
    """What a train task says: the group, and per trained sample its id and advantage.

    ``samples`` indexes the group's samples (positions 0..G-1) that train; dropped samples
    (non-finite reward) are absent. ``sample_ids`` are their ids in the iteration
    (:attr:`GroupTask.sample_ids`): each sample's random streams. ``steps``, per sample the
    denoising steps it trains, is empty in a released task: the trainer draws them from the
    sample's stream (:func:`digen.training.drawn_steps`; a test may set them).
    """

    iteration: int
    group: int
    gen_version: int
    samples: list[int]
    sample_ids: list[int]
    advantages: list[float]
    steps: list[list[int]] = field(default_factory=list)

    def half(self, part: int) -> TrainSpec:
        """The first (``part`` 0) or second (1) half of the samples: a group's train task
        split in two (the first half gets the odd sample). The halves' gradient sums add
        up to the whole group's (up to float summation order)."""
        h = (len(self.samples) + 1) // 2
        return self.select(range(h) if part == 0 else range(h, len(self.samples)))

    def select(self, rows: Iterable[int]) -> TrainSpec:
        """The spec of some of its samples (``rows``: indices into :attr:`samples`, in order):
        a half (:meth:`half`) or the samples of one mini-batch (``train.mini_batch_split:
        samples``)."""
        keep = list(rows)
        return TrainSpec(
            self.iteration,
            self.group,
            self.gen_version,
            [self.samples[j] for j in keep],
            [self.sample_ids[j] for j in keep],
            [self.advantages[j] for j in keep],
            [self.steps[j] for j in keep] if self.steps else [],
        )


@dataclass
class TrainStats(Record):
    """Sums over rows (divide by ``rows`` for means), and the forward passes that trained them
    (``forwards``: a sharded trainer's weight all-gathers; summed over tasks)."""

    rows: int = 0
    loss: float = 0.0
    approx_kl: float = 0.0
    clipped: float = 0.0
    kl: float = 0.0
    ratio_max_dev: float = 0.0
    forwards: int = 0

    def add(self, other: TrainStats) -> None:
        self.rows += other.rows
        self.loss += other.loss
        self.approx_kl += other.approx_kl
        self.clipped += other.clipped
        self.kl += other.kl
        self.ratio_max_dev = max(self.ratio_max_dev, other.ratio_max_dev)
        self.forwards += other.forwards

    @staticmethod
    def chunk_sums(loss, terms: LossTerms, kl):
        """One forward's sums as a ``[5]`` tensor left on the device (``loss``, ``kl``: ``[R]``
        tensors; each sum in its own dtype first, so the same values as summing it alone): what
        :meth:`add_chunks` reads back. It holds no autograd graph."""
        import torch

        sums = [
            loss.detach().sum(),
            terms.approx_kl.detach().sum(),
            terms.clipped.float().sum(),
            kl.detach().sum(),
            (terms.ratio.detach() - 1).abs().max(),
        ]
        wide = torch.float64 if any(t.dtype == torch.float64 for t in sums) else torch.float32
        return torch.stack([t.to(wide) for t in sums])

    def add_chunks(self, rows: list[int], sums: list) -> None:
        """Add the forwards of one task (``rows[i]`` rows, ``sums[i]`` from :meth:`chunk_sums`),
        read back from the device in one transfer after the task's last backward: a read-back
        per forward would make the host wait for each backward before it could queue the next
        forward. The values are added in forward order, as Python floats, so the totals are the
        bits a read-back per forward gave (a float32 sum widened to float64 is exact)."""
        import torch

        if not sums:
            return
        wide = torch.float64 if any(t.dtype == torch.float64 for t in sums) else torch.float32
        for n, (loss_s, approx_kl, clipped, kl_s, dev) in zip(
            rows, torch.stack([t.to(wide) for t in sums]).tolist(), strict=True
        ):
            self.rows += n
            self.forwards += 1
            self.loss += loss_s
            self.approx_kl += approx_kl
            self.clipped += clipped
            self.kl += kl_s
            self.ratio_max_dev = max(self.ratio_max_dev, dev)
