"""The rows of a train task: one (sample, timestep) pair each, flattened, as a loss reads them.

A task's rows are independent given the stored trajectories, so they can be packed into
forwards in any way (:func:`digen.training.forward_chunks`); every row type has ``sample``
(index into the task's samples, for the prompt embeddings), ``step`` (the denoising step it
trains), ``take`` and ``len``.

- :class:`TrainRows`: a stored SDE transition ``x_j -> x_{j+1}`` (the GRPO family: Flow-GRPO,
  its Fast/CPS/DanceGRPO variants, MixGRPO, GRPO-Guard).
- :class:`NoisedRows`: a clean final latent noised forward to one sigma (DiffusionNFT).

Rows live on the host. An algorithm moves what a forward needs with ``non_blocking=True``: a
blocking host-to-device copy waits for the device's stream, i.e. for the previous backward,
so the host could not queue the next forward meanwhile (from pageable memory the copy is
staged at once, so the rows may be freed after it). Checks on the rows' sigmas read the host
copy (:func:`digen.algos.sde.sde_step`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from digen.errors import AlgorithmError


@dataclass
class TrainRows:
    """Stored transitions, one per row.

    x, x_next: ``[R, *latent]``; sigma, sigma_next, old_log_prob, advantage: ``[R]``;
    sample: ``[R]`` index into the task's samples (for prompt embeddings); step: ``[R]``.
    old_mean: ``[R, *latent]`` the behaviour policy's transition mean (GRPO-Guard), else None.
    """

    x: torch.Tensor
    x_next: torch.Tensor
    sigma: torch.Tensor
    sigma_next: torch.Tensor
    old_log_prob: torch.Tensor
    advantage: torch.Tensor
    sample: torch.Tensor
    step: torch.Tensor
    old_mean: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.sample.shape[0])

    def take(self, idx: torch.Tensor) -> TrainRows:
        return TrainRows(**_take(self, idx))


@dataclass
class NoisedRows:
    """Clean latents to noise forward, one (sample, sigma) per row (DiffusionNFT).

    x0: ``[R, *latent]`` the sample's final latent; noise: ``[R, *latent]`` standard normal;
    sigma, advantage: ``[R]``; sample, step: ``[R]`` (step: the index of ``sigma`` in the
    rollout schedule). ``x`` is ``x0`` (the shape the FSDP trainer's padding reads).
    """

    x0: torch.Tensor
    noise: torch.Tensor
    sigma: torch.Tensor
    advantage: torch.Tensor
    sample: torch.Tensor
    step: torch.Tensor

    @property
    def x(self) -> torch.Tensor:
        return self.x0

    def __len__(self) -> int:
        return int(self.sample.shape[0])

    def take(self, idx: torch.Tensor) -> NoisedRows:
        return NoisedRows(**_take(self, idx))


def concat_rows(parts: list[TrainRows] | list[NoisedRows], samples: list[int]) -> TrainRows | NoisedRows:
    """The rows of several groups as one task's (``train.groups_per_task``): ``parts`` (one
    row type) one after another, each part's ``sample`` shifted past the samples of the parts
    before it (``samples``: each part's sample count), so it indexes the task's samples in
    order. One part comes back as it is."""
    if len(parts) == 1:
        return parts[0]
    kinds = {type(p) for p in parts}
    if len(kinds) != 1:
        raise AlgorithmError(
            f"a train task's groups built rows of different kinds: {sorted(k.__name__ for k in kinds)}"
        )
    offsets = [sum(samples[:i]) for i in range(len(parts))]
    out: dict = {}  # field name -> tensor (None: a field no part holds)
    for f in fields(parts[0]):
        values = [getattr(p, f.name) for p in parts]
        if f.name == "sample":
            values = [v + o for v, o in zip(values, offsets, strict=True)]
        if any(v is None for v in values):
            if not all(v is None for v in values):
                raise AlgorithmError(f"a train task's groups disagree on whether rows hold {f.name}")
            out[f.name] = None
        else:
            out[f.name] = torch.cat(values)
    return type(parts[0])(**out)


def _take(rows: TrainRows | NoisedRows, idx: torch.Tensor) -> dict:
    out = {}
    for f in fields(rows):
        value = getattr(rows, f.name)
        out[f.name] = None if value is None else value.index_select(0, idx.to(value.device))
    return out


def flat_index(steps: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(b [R], j [R])``: sample-major rows of samples ``b`` and their steps ``steps[b]``."""
    b_idx = torch.tensor([b for b, s in enumerate(steps) for _ in s], dtype=torch.long)
    j_idx = torch.tensor([j for s in steps for j in s], dtype=torch.long)
    return b_idx, j_idx


def transition_rows(
    latents: torch.Tensor,
    log_probs: torch.Tensor,
    sigmas: torch.Tensor,
    advantages: torch.Tensor,
    steps: list[list[int]],
    *,
    first_step: int = 0,
    means: torch.Tensor | None = None,
) -> TrainRows:
    """Rows for samples ``b`` and their steps ``steps[b]`` (samples with no steps: none).

    latents ``[B, S+1, *latent]`` hold ``x_first .. x_{first+S}``, log_probs ``[B, S]`` and
    means ``[B, S, *latent]`` (optional) the stored steps ``first .. first+S-1``; sigmas
    ``[T+1]`` the whole schedule; advantages ``[B]``. Rows are sample-major, then by step.
    """
    b_idx, j_idx = flat_index(steps)
    stored = log_probs.shape[1]
    local = j_idx - first_step
    if len(local) and (int(local.min()) < 0 or int(local.max()) >= stored):
        bad = sorted({int(j) for j, k in zip(j_idx, local, strict=True) if not 0 <= int(k) < stored})
        raise AlgorithmError(
            f"steps {bad[:8]} are not stored in these trajectories (they keep steps {first_step} to "
            f"{first_step + stored - 1}); the algorithm's trained steps and its rollout plan disagree"
        )
    return TrainRows(
        x=latents[b_idx, local],
        x_next=latents[b_idx, local + 1],
        sigma=sigmas[j_idx],
        sigma_next=sigmas[j_idx + 1],
        old_log_prob=log_probs[b_idx, local],
        advantage=advantages[b_idx],
        sample=b_idx,
        step=j_idx,
        old_mean=None if means is None else means[b_idx, local],
    )
