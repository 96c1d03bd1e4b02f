"""One registry of training algorithms: each is one module of ``digen/algos/`` with an
``ALGORITHM`` object, found here by name.

An algorithm declares what its rollout needs (which steps sample with SDE noise, which run a
deterministic solver, which transitions the trajectory keeps), what a trajectory holds, which
timesteps each sample trains, its loss, and any state it keeps beside the trained weights.
The library reads it from here and nowhere else: :func:`digen.rollout.generate_group` runs its
:class:`RolloutPlan`, :func:`digen.training.train_group` builds its rows and calls its loss,
:func:`digen.training.drawn_steps` asks for its trained steps (on the trainer), and
:class:`digen.optim.ParameterStore` keeps its state; so every worker that calls those
functions runs it. ``digen algorithms`` lists them.

Adding an algorithm is one new module in ``digen/algos/`` that defines a subclass of
:class:`Algorithm` and ``ALGORITHM = TheClass()`` (plus a section of ``train`` in
:mod:`digen.config.schema` if it has options of its own). Modules are discovered, not listed.

What an algorithm reads of the config. Its own options live in its own section of ``train``
(``train.flow_dppo``, ``train.nft``, ``train.mix_grpo``), which no module outside the algorithm
reads, and its own checks of them are :meth:`Algorithm.check`, gathered by
:func:`config_problems`. The methods are still handed the whole :class:`~digen.config.Config`,
by decision: an algorithm owns its rollout plan as well as its loss, so it reads
``rollout.num_steps``, ``rollout.sde``, ``rollout.guidance_scale``, the seed and the shared
``train`` keys (clipping, timesteps, KL) as much as its own section; passing the sections one
by one would spread that list over every call site, and a narrowed view would be a second
config type to keep in step with the first.

The shapes in the docstrings: ``B`` samples of a group, ``T`` denoising steps of the rollout
schedule (``rollout.num_steps``), ``S`` stored steps, ``R`` rows of a train task,
``*latent`` one sample's step-space latent.
"""

from __future__ import annotations

import importlib
import pkgutil
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from digen.errors import ConfigError

if TYPE_CHECKING:
    from digen.algos.loss import LossTerms
    from digen.config.schema import Config, TrainConfig
    from digen.models.base import FlowPolicy, PromptEmbeds

StepKind = Literal["sde", "ode", "dpm2"]
"""How a rollout step moves: ``sde`` a stochastic step of ``rollout.sde.kind`` with the
log-prob of its result; ``ode`` the Euler step; ``dpm2`` DPM-Solver++(2M) (:mod:`digen.algos.dpm`)."""

Rows = Any
"""A train task's rows: :class:`~digen.algos.rows.TrainRows` or
:class:`~digen.algos.rows.NoisedRows` (anything with ``sample``, ``step``, ``take()``, ``len()``)."""


@dataclass(frozen=True)
class RolloutPlan:
    """How one iteration's rollouts sample and what their trajectories keep.

    kinds: ``[N]`` the step kind of each of the N steps taken.
    schedule: ``[N+1]`` indices into the rollout schedule ``policy.sigmas(rollout.num_steps)``
        the steps run between (None: all ``T+1``, N = T). MixGRPO's Flash variant skips some
        after its window.
    keep: ``(first, count)``: the trajectory stores ``latents [B, count+1, *latent]`` =
        ``x_first .. x_{first+count}`` and ``log_probs [B, count]`` of steps ``first ..
        first+count-1`` (positions in ``schedule``; they must lie where it is the full schedule).
        ``(0, T)``: everything; ``(T, 0)``: the final latent only.
    means: also store each kept step's transition mean ``means [B, count, *latent]``.
    """

    kinds: tuple[StepKind, ...]
    keep: tuple[int, int]
    schedule: tuple[int, ...] | None = None
    means: bool = False

    def __post_init__(self) -> None:
        n = len(self.kinds)
        first, count = self.keep
        if not (0 <= first and count >= 0 and first + count <= n):
            raise ConfigError(f"rollout plan keeps steps {first}..{first + count - 1} of {n}")
        if self.schedule is not None and len(self.schedule) != n + 1:
            raise ConfigError(f"rollout plan has {n} steps but a schedule of {len(self.schedule)} sigmas")


class Algorithm:
    """What every algorithm module declares (class attributes) and implements.

    The defaults are the GRPO family's shared parts; see :mod:`digen.algos.flow_grpo`.
    """

    name: ClassVar[str]
    """Registry key, the value of ``train.algorithm`` (``flow-grpo``)."""
    title: ClassVar[str]
    """Display name (``Flow-GRPO``)."""
    peer: ClassVar[str]
    """The peer implementation restated: repository, file, function, commit read."""
    summary: ClassVar[str]
    """One line: what it trains and how."""
    rollout_needs: ClassVar[str]
    """Which steps are SDE, which deterministic, which keep log-probs (for ``digen algorithms``)."""
    trajectory: ClassVar[dict[str, str]]
    """What a generated group's trajectory holds: tensor name -> shape and meaning."""
    order: ClassVar[int] = 100
    """Position in listings."""
    keeps_state: ClassVar[bool] = False
    """Keeps tensors beside the trained weights (:meth:`initial_state`, :meth:`next_state`)."""

    # --- config ---------------------------------------------------------------------------
    def check(self, cfg: Config) -> list[str]:
        """Problems of ``cfg`` for this algorithm, in :mod:`digen.config`'s one-error-list style."""
        return []

    # --- rollout --------------------------------------------------------------------------
    def rollout_plan(self, cfg: Config, iteration: int) -> RolloutPlan:
        """The plan every group of ``iteration`` samples with (the same for all its groups)."""
        raise NotImplementedError

    def sampling(self, policy: FlowPolicy):  # -> context manager
        """Context in which the rollout samples (DiffusionNFT: with its ``old`` weights)."""
        return nullcontext()

    # --- training -------------------------------------------------------------------------
    def trained_steps(self, cfg: Config, iteration: int, sample_id: int) -> list[int]:
        """Sorted step indices (into the rollout schedule) one sample trains."""
        raise NotImplementedError

    def rows(self, spec: Any, traj: dict[str, torch.Tensor], cfg: Config) -> Rows:
        """The rows of a train task (:class:`digen.task_records.TrainSpec` ``spec``) from its
        group's trajectory dict (:meth:`digen.rollout.Trajectories.tensors`)."""
        raise NotImplementedError

    def loss(
        self, policy: FlowPolicy, rows: Rows, embeds: PromptEmbeds, cfg: Config, sigma_max: float
    ) -> tuple[torch.Tensor, LossTerms, torch.Tensor]:
        """One forward over ``rows`` (``R`` of them; ``embeds`` one row per sample of the
        task, ``rows.sample`` indexes it): ``(loss [R], ppo terms, kl [R])``, the loss
        differentiable. The task's gradient is the sum of ``loss`` over its rows; the optimizer
        step divides by the mini-batch's rows, so ``loss`` is the peer's per-row term."""
        raise NotImplementedError

    # --- state beside the weights (digen.algos.state) -------------------------------------
    def initial_state(self, weights: dict[str, torch.Tensor], train: TrainConfig) -> dict[str, torch.Tensor]:
        """``algo/`` tensors of version 0 from its trained tensors (``{}``: none)."""
        return {}

    def next_state(
        self, state: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], train: TrainConfig, steps: int
    ) -> dict[str, torch.Tensor]:
        """The state after an iteration's last optimizer step (``steps`` taken so far)."""
        return state


_ALGORITHMS: dict[str, Algorithm] = {}


def _discover() -> dict[str, Algorithm]:
    """Every ``digen/algos/*.py`` module's ``ALGORITHM``, by name (imported once)."""
    if not _ALGORITHMS:
        import digen.algos as package

        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"digen.algos.{info.name}")
            algo = getattr(module, "ALGORITHM", None)
            if isinstance(algo, Algorithm):
                if algo.name in _ALGORITHMS:
                    raise RuntimeError(f"two algorithm modules register the name {algo.name!r}")
                _ALGORITHMS[algo.name] = algo
    return _ALGORITHMS


def available() -> list[str]:
    """Registered names, in listing order."""
    return [a.name for a in algorithms()]


def algorithms() -> list[Algorithm]:
    return sorted(_discover().values(), key=lambda a: (a.order, a.name))


def get(name: str) -> Algorithm:
    found = _discover().get(name)
    if found is None:
        raise ConfigError(
            f"train.algorithm ({name!r}) is not a registered algorithm; use one of {', '.join(available())}"
        )
    return found


def resolved_name(cfg: Config) -> str:
    """``train.algorithm``, or when unset the Flow-GRPO family member the rollout settings
    name: ``cps`` for ``rollout.sde.kind: cps``, ``dance-grpo`` for ``dance``,
    ``flow-grpo-fast`` for ``train.timesteps.strategy: window``, else ``flow-grpo`` (configs
    written before the registry keep their meaning)."""
    if cfg.train.algorithm is not None:
        return cfg.train.algorithm
    if cfg.rollout.sde.kind == "cps":
        return "cps"
    if cfg.rollout.sde.kind == "dance":
        return "dance-grpo"
    if cfg.train.timesteps.strategy == "window":
        return "flow-grpo-fast"
    return "flow-grpo"


def algorithm_for(cfg: Config) -> Algorithm:
    """The algorithm ``cfg`` trains with."""
    return get(resolved_name(cfg))


def stateful_algorithm(train: TrainConfig) -> Algorithm:
    """The algorithm whose state an optimizer store keeps (``train.algorithm``; unset is a
    Flow-GRPO family member, which keeps none)."""
    return get(train.algorithm or "flow-grpo")


def config_problems(cfg: Config) -> list[str]:
    """``train.algorithm`` is registered and fits the config: the algorithm's own checks
    (:meth:`Algorithm.check`, each on its own config section) and, for an algorithm with state
    beside the weights, no sharded trainer group (``train.fsdp``). The config's checks call it
    when they may import torch (:func:`digen.config.build_config`'s ``algorithms``); a process
    that must not asks :func:`digen.checks.registries_apart`, whose child calls it."""
    name = resolved_name(cfg)
    if name not in available():
        return [
            f"train.algorithm ({name!r}) is not a registered algorithm; use one of "
            f"{', '.join(available())} (digen algorithms lists them)"
        ]
    algo = get(name)
    problems = algo.check(cfg)
    if cfg.train.fsdp and algo.keeps_state:
        problems.append(
            f"train.algorithm ({name}) keeps state beside the weights, which the FSDP trainer group's "
            f"sharded store does not hold; set train.fsdp=false (a replicated trainer group) for {name}"
        )
    return problems
