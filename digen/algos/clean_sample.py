"""The clean-sample family: objectives that train on the final latents of any deterministic
sampler, with no SDE trajectory and no log-probs (DiffusionNFT, DGPO).

The parts its members share, here once:

- **The rollout** (:meth:`CleanSampleFamily.rollout_plan`): every one of the ``T`` steps
  of ``rollout.num_steps`` runs a deterministic solver (DPM-Solver++(2M), ``dpm2``, or
  Euler, ``ode``), and the trajectory keeps the clean final latent only
  (``keep = (T, 0)``): a generation task moves one latent per sample, whatever ``T``.
  CFG at rollout is the member's choice (DiffusionNFT: none; DGPO: ``rollout.guidance_scale``).
- **The rows** (:func:`noised_rows`): one row per (sample, trained step ``j``): the sample's
  clean latent ``x0``, a standard-normal ``noise`` from a seeded stream and ``sigma =
  sigmas[j]`` of the rollout schedule, with the sample's advantage.
- **The regression** (:func:`noised`, :func:`flow_target`): the clean latent noised forward
  on the rectified-flow path ``x_t = (1 - t) x0 + t noise``, whose velocity target is
  ``noise - x0``. A member's loss regresses the policy's velocity at ``x_t`` toward it,
  weighted by the advantage or a preference between samples.

What differs is the member's: which steps train, how the noise is drawn (per sample, or
shared by a group), and the loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch

from digen.algos.registry import Algorithm, RolloutPlan, StepKind
from digen.algos.rows import NoisedRows, flat_index
from digen.errors import AlgorithmError
from digen.seeding import sample_generator

if TYPE_CHECKING:
    from digen.config.schema import Config

CLEAN_TRAJECTORY = {
    "latents": "[B, 1, *latent] the clean final latent x_T only",
    "log_probs": "[B, 0] (none)",
    "first_step": "[] (int64) T",
    "sigmas": "[T+1] the rollout schedule (training noises x_T to sigmas[j])",
}


def strata_steps(start: int, end: int, count: int, gen: torch.Generator) -> list[int]:
    """One step in each of ``count`` strata of ``start .. end``, sorted: the strata cut at
    ``linspace(start, end, count + 1).long()``, stratum ``[a, b)`` drawing ``a + floor(u (b -
    a))`` (``a`` when ``b == a``), so ``end`` itself is never drawn (AWM's ``discrete_wo_init``;
    Flow-Factory's ``TimeSampler._stratified_sample``)."""
    bounds = torch.linspace(start, end, steps=count + 1)
    lower, upper = bounds[:-1].long(), bounds[1:].long()
    u = torch.rand(count, generator=gen)
    return sorted((lower + (u * (upper - lower)).long()).tolist())


def noised(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """``(1 - t) x0 + t noise`` per row: x0, noise ``[R, *latent]``, sigma ``[R]`` (cast to
    ``x0``'s dtype)."""
    s = sigma.to(x0.dtype).reshape(-1, *([1] * (x0.ndim - 1)))
    return (1 - s) * x0 + s * noise


def flow_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The rectified-flow velocity of :func:`noised`'s path, ``noise - x0`` ``[R, *latent]``."""
    return noise - x0


def sample_noises(spec: Any, shape: torch.Size, cfg: Config, purpose: str) -> list[torch.Tensor]:
    """Per trained sample of ``spec``, ``[len(steps), *shape]`` standard normal float32 from
    the sample's own stream (one draw per trained step, in order): a row's noise does not
    depend on how the task is packed or split."""
    out = []
    for pos, steps in zip(spec.samples, spec.steps, strict=True):
        sample_id = spec.group * cfg.rollout.group_size + pos
        gen = sample_generator(cfg.seed, spec.iteration, sample_id, purpose)
        out.append(torch.randn((len(steps), *shape), generator=gen, dtype=torch.float32))
    return out


def noised_rows(
    spec: Any, traj: dict[str, torch.Tensor], noises: list[torch.Tensor] | None = None, *, cfg: Config
) -> NoisedRows:
    """One row per (sample, trained step) of ``spec`` (sample-major, then by step) from a
    clean-sample trajectory dict; ``noises`` per trained sample ``[len(steps), *latent]``
    (default: :func:`sample_noises` of purpose ``nft-noise``)."""
    final = traj["latents"][:, -1]
    if noises is None:
        noises = sample_noises(spec, final.shape[1:], cfg, "nft-noise")
    b_idx, j_idx = flat_index(spec.steps)
    keep = torch.tensor(spec.samples, dtype=torch.long)
    x0 = final.index_select(0, keep)[b_idx]
    return NoisedRows(
        x0=x0,
        noise=torch.cat(noises).to(x0.dtype) if noises else torch.empty_like(x0),
        sigma=traj["sigmas"][j_idx],
        advantage=torch.tensor(spec.advantages, dtype=torch.float32)[b_idx],
        sample=b_idx,
        step=j_idx,
    )


class CleanSampleFamily(Algorithm):
    """A deterministic-solver rollout that keeps the clean final latents; rows noised forward."""

    trajectory = CLEAN_TRAJECTORY

    def solver(self, cfg: Config) -> StepKind:
        """The rollout's deterministic step kind (``dpm2`` or ``ode``)."""
        raise NotImplementedError

    def rollout_plan(self, cfg: Config, iteration: int) -> RolloutPlan:
        n = cfg.rollout.num_steps
        return RolloutPlan(kinds=(self.solver(cfg),) * n, keep=(n, 0))

    def rows(self, spec: Any, traj: dict[str, torch.Tensor], cfg: Config) -> NoisedRows:
        return noised_rows(spec, traj, cfg=cfg)

    def _lora_problems(self, cfg: Config) -> list[str]:
        """Every member keeps a second copy of the trained weights (its old or reference
        adapter) as a LoRA copy, as its peer does: full fine-tune is refused."""
        if cfg.model.lora.enabled:
            return []
        return [
            f"train.algorithm ({self.name}) keeps its old weights as a LoRA copy (as its peer); "
            "set model.lora.enabled=true"
        ]

    def _whole_group_problems(self, cfg: Config) -> list[str]:
        """A member whose loss reads a whole group (:data:`digen.config.WHOLE_GROUP_ALGORITHMS`)
        needs every sample of a group in one train task."""
        problems = []
        if cfg.train.mini_batch_split == "samples":
            problems.append(
                f"train.mini_batch_split (samples): {self.name} needs every sample of a group in one train "
                "task; set train.mini_batch_split=groups"
            )
        if cfg.schedule.rat:
            problems.append(
                f"schedule.rat (true): {self.name} needs every sample of a group in one train task, and RAT "
                f"splits groups in halves; leave schedule.rat unset (off for {self.name}) or set it to false"
            )
        if cfg.train.fsdp and not self.keeps_state:  # (a member with state is refused for that already)
            problems.append(
                f"train.fsdp (true): the FSDP trainer group splits a train task's rows over its ranks, and "
                f"{self.name}'s loss needs a whole group in one forward; set train.fsdp=false"
            )
        return problems

    def _kl_problems(self, cfg: Config) -> list[str]:
        """No member has an SDE transition mean: its KL is on the velocity."""
        if cfg.train.kl_target != "mean":
            return []
        return [
            f"train.kl_target (mean): {self.name} has no SDE transition mean; its KL is on the velocity "
            "(leave train.kl_target unset or set it to velocity)"
        ]


@dataclass
class GroupRows(NoisedRows):
    """:class:`NoisedRows` whose loss couples the rows of one prompt group at one step (a
    group preference weight): ``group [R]`` the row's group in the iteration. Its forwards
    are its own (:meth:`forward_chunks`): one per (group, step), all of the group's rows of
    that step, whatever ``train.rows_per_forward`` and TSP say, so a forward's loss can read
    the whole group (the peers' micro-batch is whole groups too)."""

    group: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))

    def take(self, idx: torch.Tensor) -> GroupRows:
        return GroupRows(**{f.name: getattr(self, f.name).index_select(0, idx) for f in fields(self)})

    def forward_chunks(self) -> list[torch.Tensor]:
        """Row index sets, one per (group, step), in (group, step) order."""
        keys = sorted({(int(g), int(j)) for g, j in zip(self.group, self.step, strict=True)})
        return [torch.nonzero((self.group == g) & (self.step == j)).flatten() for g, j in keys]

    def one_group_step(self) -> tuple[int, int]:
        """``(group, step)`` of rows that are one forward of :meth:`forward_chunks`; an
        :class:`AlgorithmError` when they are not (a loss that needs a whole group called on
        a mixed chunk)."""
        pairs = {(int(g), int(j)) for g, j in zip(self.group, self.step, strict=True)}
        if len(pairs) != 1:
            raise AlgorithmError(
                f"a group-coupled loss got rows of {len(pairs)} (group, step) pairs; it needs the rows of one "
                "group at one step per forward (GroupRows.forward_chunks)"
            )
        return pairs.pop()


def group_rows(
    spec: Any, traj: dict[str, torch.Tensor], noises: list[torch.Tensor], *, cfg: Config
) -> GroupRows:
    """:func:`noised_rows` of ``spec`` with each row's group (``spec.group``)."""
    rows = noised_rows(spec, traj, noises, cfg=cfg)
    return GroupRows(
        **{f.name: getattr(rows, f.name) for f in fields(rows)},
        group=torch.full((len(rows),), spec.group, dtype=torch.long),
    )
