"""Training: the policy gradient of one train task, and the optimizer step.

A *train task* is one scored group x the timesteps each of its samples trains. Its rows
``(sample, step)`` are independent given the stored latents, so with TSP they are packed into
batched forwards of up to ``train.rows_per_forward`` rows (one weight read serves K steps);
without TSP each step is its own forward, as the sequential Flow-GRPO loop does.

What a row is and what its loss is belong to the configured algorithm (``train.algorithm``,
:mod:`digen.algos.registry`): :func:`train_group` draws each sample's trained steps
(:func:`drawn_steps`), builds the rows from the group's trajectory dict with the algorithm's
``rows`` and each forward calls its ``loss``; the rest (packing, backward, summing) is
shared. The task's description (:class:`~digen.task_records.TrainSpec`) and its stats are plain
records of :mod:`digen.task_records`, which the controller builds without torch.

A task returns the *sum* over its rows of the loss gradient. The optimizer step sums task
gradients in task order and divides by its mini-batch's row count (the iteration's, with one
mini-batch: ``train.mini_batches``), so the update equals the peers' mean over all trained
(sample, timestep) pairs of the step whichever worker computed which task, and the same code
serves the reference trainer and the distributed modes.

Float order, the reason the synchronous modes equal the reference bit for bit: a task's
gradient is a function of its rows and their packing alone (:func:`forward_chunks`, chosen by
``schedule.tsp`` in every mode, the reference included); its forwards' gradients accumulate
in ``.grad`` in chunk order; :meth:`digen.iteration.IterationBook.gradient` sums tasks in
(group, part) order whatever order they arrive in; every process computes with one thread
count (:func:`digen.assembly.compute_threads`). Two choices sum in another order, each
legitimately: TSP's packing against one forward per step, and a group trained as two half
tasks (RAT), whose two partial sums are added (tolerance: tests/runtime/test_equivalence.py).

A train task may carry several whole groups (``train.groups_per_task``, :func:`train_groups`):
their rows are put one after another (group order) and packed together, so a forward may mix
groups and a task of small groups makes ``ceil(rows / rows_per_forward)`` forwards, not one
per group at least (an FSDP trainer's weight all-gathers). The rows and the loss are the
same, so the step's mean is the same; only the summation order differs (the third such
choice: tests/trainer/test_batched_tasks.py bounds it).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from digen.algos.loss import LossTerms
from digen.algos.precision import at_least_float32
from digen.algos.registry import Rows, algorithm_for
from digen.algos.rows import TrainRows, concat_rows, transition_rows
from digen.config import Config
from digen.models.base import FlowPolicy, PromptEmbeds
from digen.task_records import TrainSpec, TrainStats


def build_rows(
    latents: torch.Tensor,
    log_probs: torch.Tensor,
    sigmas: torch.Tensor,
    advantages: torch.Tensor,
    steps: list[list[int]],
) -> TrainRows:
    """Rows for samples ``b`` and their steps ``steps[b]`` (samples with no steps: none).

    latents ``[B, T+1, *latent]``, log_probs ``[B, T]``, sigmas ``[T+1]``, advantages ``[B]``.
    Rows are ordered sample-major, then by step (:func:`digen.algos.rows.transition_rows`).
    """
    return transition_rows(latents, log_probs, sigmas, advantages, steps)


def forward_chunks(rows: Rows, tsp: bool, limit: int) -> list[torch.Tensor]:
    """Row index sets, one per forward, none of more than ``limit`` rows (``train.rows_per_forward``:
    what bounds a forward's activations in every mode): TSP packs up to ``limit`` rows of any
    steps; without TSP one forward per denoising step (the sequential loop), a step with more
    rows than ``limit`` cut into consecutive forwards of ``limit``. Rows whose loss couples rows
    (a group's preference weight: :class:`digen.algos.clean_sample.GroupRows`) name their own
    forwards, in every mode alike (one per group and step, whatever ``limit``)."""
    own = getattr(rows, "forward_chunks", None)
    if own is not None:
        return own()
    n = len(rows)
    if tsp:
        return [torch.arange(i, min(i + limit, n)) for i in range(0, n, limit)]
    per_step = (torch.nonzero(rows.step == j).flatten() for j in torch.unique(rows.step).tolist())
    return [part for idx in per_step for part in idx.split(limit)]


def chunk_loss(
    policy: FlowPolicy, chunk: Rows, embeds: PromptEmbeds, cfg: Config, sigma_max: float
) -> tuple[torch.Tensor, LossTerms, torch.Tensor]:
    """One forward over ``chunk``: the configured algorithm's per-row loss ``[R]``, its PPO
    terms and its KL ``[R]`` (zeros when ``train.kl_beta`` is 0). Differentiable.
    (:meth:`digen.algos.registry.Algorithm.loss`; Flow-GRPO's: PPO-clip + kl_beta * KL.)"""
    return algorithm_for(cfg).loss(policy, chunk, embeds, cfg, sigma_max)


def task_gradient(
    policy: FlowPolicy,
    rows: Rows,
    embeds: PromptEmbeds,
    cfg: Config,
    *,
    tsp: bool,
    sigma_max: float,
) -> tuple[dict[str, torch.Tensor], TrainStats]:
    """Sum over ``rows`` of d(loss)/d(trained params); the gradient and its stats.

    ``embeds`` has one row per sample of the task (``rows.sample`` indexes it). The gradient
    starts from zero (whatever ``.grad`` held is discarded) and comes back as float32 tensors
    (float64 for a float64 model) on the parameters' device, keyed like
    :meth:`FlowPolicy.trainable_state_dict` of the trained parameters: a trainer sums it there
    (:class:`~digen.dataplane.reduce.TaskSum`) and all-reduces the sum from there, with no
    copy to the host; what must leave the device (a gradient served as a blob) is copied by
    whoever sends it.
    """
    t = cfg.train
    params = dict(policy.named_trainable_parameters())
    for p in params.values():
        p.grad = None
    stats, sizes, sums = TrainStats(), [], []
    for idx in forward_chunks(rows, tsp, t.rows_per_forward):
        chunk = rows.take(idx)
        loss, terms, kl = chunk_loss(policy, chunk, embeds, cfg, sigma_max)
        loss.sum().backward()
        sizes.append(len(chunk))
        sums.append(TrainStats.chunk_sums(loss, terms, kl))
    stats.add_chunks(sizes, sums)
    # a float32 .grad is handed over as it is (the parameter lets go of it below): no second
    # copy of a gradient that may be gigabytes, and it stays on the device it was computed on
    grads = {
        name: at_least_float32(p.grad.detach() if p.grad is not None else torch.zeros_like(p.detach()))
        for name, p in params.items()
    }
    for p in params.values():
        p.grad = None
    return grads, stats


def sum_gradients(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Sum task gradients in the given order (the order fixes the float result)."""
    total = {k: v.clone() for k, v in parts[0].items()}
    for part in parts[1:]:
        for k, v in part.items():
            total[k] += v
    return total


def drawn_steps(spec: TrainSpec, cfg: Config) -> TrainSpec:
    """``spec`` with the denoising steps each of its samples trains (sorted): the algorithm's
    draw from the sample's own stream (:meth:`digen.algos.registry.Algorithm.trained_steps`
    of ``(iteration, sample id)``), so every trainer of every mode draws the same steps for
    the same sample. The trainer draws them, where the algorithm is: the controller, which
    builds the spec, imports no torch. A spec whose ``steps`` are set keeps them."""
    if spec.steps or not spec.samples:
        return spec
    algo = algorithm_for(cfg)
    return replace(spec, steps=[algo.trained_steps(cfg, spec.iteration, s) for s in spec.sample_ids])


def spec_rows(spec: TrainSpec, traj: dict[str, torch.Tensor], cfg: Config) -> Rows:
    """The rows a train task trains, from its group's trajectory dict (what
    :meth:`digen.rollout.Trajectories.tensors` gives; which tensors it holds is the
    algorithm's, :attr:`digen.algos.registry.Algorithm.trajectory`), its samples' steps drawn
    by :func:`drawn_steps`; ``rows.sample`` indexes ``spec.samples``."""
    return algorithm_for(cfg).rows(drawn_steps(spec, cfg), traj, cfg)


def train_group(
    policy: FlowPolicy,
    spec: TrainSpec,
    traj: dict[str, torch.Tensor],
    embeds: PromptEmbeds,
    cfg: Config,
    *,
    tsp: bool,
) -> tuple[dict[str, torch.Tensor], TrainStats]:
    """Gradient of one train task from its group's stored trajectories: the one entry point
    every trainer calls, whatever the algorithm (``train.algorithm``).

    traj: the group's trajectory dict as generated (Flow-GRPO: latents ``[G, T+1, *latent]``,
    log_probs ``[G, T]``, sigmas ``[T+1]``; other algorithms: their
    :attr:`~digen.algos.registry.Algorithm.trajectory`); embeds: the prompt's embeddings, one
    row (repeated to the trained samples here).
    """
    return train_groups(policy, [spec], [traj], [embeds], cfg, tsp=tsp)


def batch_rows(
    specs: list[TrainSpec], trajs: list[dict[str, torch.Tensor]], embeds: list[PromptEmbeds], cfg: Config
) -> tuple[Rows, PromptEmbeds, float]:
    """The rows of a train task of one or more groups (``specs``, ``trajs``, ``embeds``: one
    each per group, in group order; groups with no trained sample are left out), its
    embeddings (one row per trained sample, in row-sample order) and its ``sigma_max``."""
    if not specs or len(specs) != len(trajs) or len(specs) != len(embeds):
        raise ValueError(f"a train task needs one trajectory and embedding per group ({len(specs)} groups)")
    keep = [i for i, s in enumerate(specs) if s.samples] or [0]  # none: the first group's (empty) rows
    sigma_max = {float(trajs[i]["sigmas"][1]) for i in keep}
    if len(sigma_max) != 1:
        raise ValueError(
            f"the groups of one train task were sampled on different schedules: {sorted(sigma_max)}"
        )
    counts = [len(specs[i].samples) for i in keep]
    rows = concat_rows([spec_rows(specs[i], trajs[i], cfg) for i in keep], counts)
    parts = [embeds[i].repeat_rows(n) for i, n in zip(keep, counts, strict=True)]
    return rows, parts[0] if len(parts) == 1 else PromptEmbeds.cat(parts), sigma_max.pop()


def train_groups(
    policy: FlowPolicy,
    specs: list[TrainSpec],
    trajs: list[dict[str, torch.Tensor]],
    embeds: list[PromptEmbeds],
    cfg: Config,
    *,
    tsp: bool,
) -> tuple[dict[str, torch.Tensor], TrainStats]:
    """Gradient of a train task of one or more whole groups (``train.groups_per_task``): their
    rows trained together (:func:`batch_rows`, then :func:`task_gradient`). One group is
    :func:`train_group`'s task exactly."""
    rows, emb, sigma_max = batch_rows(specs, trajs, embeds, cfg)
    return task_gradient(policy, rows, emb, cfg, tsp=tsp, sigma_max=sigma_max)
