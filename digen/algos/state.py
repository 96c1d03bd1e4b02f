"""State an algorithm keeps beside the trained weights, and how it travels with a version.

A policy *version* is one flat ``{name: tensor}`` dict: what :meth:`digen.optim.ParameterStore.weights`
returns, what a checkpoint holds and what any process that moves versions carries unchanged.
Most algorithms keep nothing beside the trained tensors. One that does (DiffusionNFT's "old"
adapter) keeps it in the optimizer store's ``state`` and it rides in the version dict as
extra tensors named

    ``algo/<role>/<parameter name>``     e.g. ``algo/old/transformer_blocks.0.attn.to_q.lora_A.weight``

``<role>`` names what the copy is for (``old``); ``<parameter name>`` is the trained tensor's
key in :meth:`FlowPolicy.trainable_state_dict`. A checkpoint keeps them in
``optimizer.safetensors`` under the same names (``weights.safetensors`` holds only the trained
tensors, so exports are unaffected).

The policy side loads a version with :func:`load_version`: the trained tensors into the
policy, the ``algo/`` tensors into a side table keyed by the policy object, where
:func:`policy_state` finds them (the rollout of DiffusionNFT samples with ``algo/old/*``, its
loss reads them too). A process that loads versions with ``policy.load_trainable_state_dict``
alone cannot run such an algorithm (it gets a clear error naming :func:`load_version`).

In the distributed modes the trainer group's members hold it in their replicated stores
(``digen.workers.trainer``: it moves after an iteration's last optimizer step, and a member that
joins copies it with the optimizer state), serve it with every version, and every worker
loads versions with :func:`load_version`. The FSDP trainer group's sharded store keeps no
state, so ``train.fsdp`` is refused for such an algorithm (:mod:`digen.config`).

A version that is evaluated with the EMA weights (``train.ema.eval``) also carries them, as
``ema/<parameter name>`` (:data:`EMA_PREFIX`); :func:`load_version` keeps them aside too, where
:func:`loaded_ema` finds them. Nothing but the evaluation reads them.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from digen.errors import AlgorithmError

STATE_PREFIX = "algo/"
EMA_PREFIX = "ema/"
"""The EMA of the trained tensors in a version dict (and in a checkpoint's ``optimizer.safetensors``)."""

_LOADED: weakref.WeakKeyDictionary[Any, dict[str, torch.Tensor]] = weakref.WeakKeyDictionary()
_EMA: weakref.WeakKeyDictionary[Any, dict[str, torch.Tensor]] = weakref.WeakKeyDictionary()


def state_name(role: str, param: str) -> str:
    """The version-dict name of ``param``'s copy for ``role``: ``algo/<role>/<param>``."""
    return f"{STATE_PREFIX}{role}/{param}"


def is_state(name: str) -> bool:
    return name.startswith(STATE_PREFIX)


def is_ema(name: str) -> bool:
    return name.startswith(EMA_PREFIX)


def with_ema(weights: dict[str, torch.Tensor], ema: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A version dict ``weights`` carrying the EMA ``ema`` (``{parameter name: tensor}``) as
    ``ema/<name>`` (the tensors themselves, not copies)."""
    return {**weights, **{f"{EMA_PREFIX}{k}": v for k, v in ema.items()}}


def split_version(
    weights: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(trained tensors, algo/ state tensors)`` of a version dict (its ``ema/`` tensors in
    neither: :func:`load_version` keeps them aside)."""
    trained = {k: v for k, v in weights.items() if not is_state(k) and not is_ema(k)}
    state = {k: v for k, v in weights.items() if is_state(k)}
    return trained, state


def role_weights(state: dict[str, torch.Tensor], role: str) -> dict[str, torch.Tensor]:
    """``{parameter name: tensor}`` of one role's copy (``algo/<role>/`` stripped)."""
    prefix = f"{STATE_PREFIX}{role}/"
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def with_role(weights: dict[str, torch.Tensor], role: str) -> dict[str, torch.Tensor]:
    """``weights`` renamed to ``algo/<role>/<name>`` (detached copies)."""
    return {state_name(role, k): v.detach().clone() for k, v in weights.items()}


def moved_toward(
    state: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], role: str, decay: float
) -> dict[str, torch.Tensor]:
    """One role's copy moved toward ``weights``: ``old * decay + w * (1 - decay)`` per tensor,
    renamed back into the role (the EMA ``old`` weights of DiffusionNFT, DGPO and AWM, each
    with its own decay schedule). The float ops are written in this order on purpose: it is the
    order the peers compute them in, and their oracle tests compare bit for bit."""
    old = role_weights(state, role)
    return with_role({k: old[k] * decay + weights[k].detach() * (1.0 - decay) for k in weights}, role)


def load_version(policy: Any, weights: dict[str, torch.Tensor]) -> None:
    """Load a version dict: the trained tensors into ``policy``, the ``algo/`` ones where
    :func:`policy_state` finds them (replacing what an earlier version left)."""
    trained, state = split_version(weights)
    policy.load_trainable_state_dict(trained)
    _LOADED[policy] = state
    _EMA[policy] = {k[len(EMA_PREFIX) :]: v for k, v in weights.items() if is_ema(k)}


def loaded_ema(policy: Any) -> dict[str, torch.Tensor]:
    """The EMA (``{parameter name: tensor}``) the version last loaded with :func:`load_version`
    carried (``{}`` when it carried none)."""
    return _EMA.get(policy, {})


def policy_state(policy: Any) -> dict[str, torch.Tensor]:
    """The ``algo/`` tensors of the version last loaded with :func:`load_version` (``{}``
    when none, or when the version was loaded some other way)."""
    return _LOADED.get(policy, {})


def require_role(policy: Any, role: str, algorithm: str) -> dict[str, torch.Tensor]:
    """One role's copy from the loaded version, or an :class:`AlgorithmError` saying how to
    load it."""
    found = role_weights(policy_state(policy), role)
    if not found:
        raise AlgorithmError(
            f"{algorithm} needs the version's '{STATE_PREFIX}{role}/' tensors, and the policy has none: "
            f"load each version with digen.algos.state.load_version(policy, weights), not "
            f"policy.load_trainable_state_dict (the optimizer store's weights() carries them)"
        )
    return found


@contextmanager
def swapped_weights(policy: Any, weights: dict[str, torch.Tensor]) -> Iterator[None]:
    """Inside the block the trained parameters hold ``weights`` (keys as
    :meth:`FlowPolicy.trainable_state_dict`); after it, exactly what they held before (copied
    in the parameters' own dtype, so a float64 policy round-trips bit for bit). Use it around
    no-grad forwards only: the parameters are written in place."""
    params = dict(policy.named_trainable_parameters())
    missing = sorted(set(params) - set(weights))
    if missing:
        raise AlgorithmError(f"swapped weights lack {len(missing)} trained tensors, e.g. {missing[0]}")
    saved = {k: p.detach().clone() for k, p in params.items()}
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(weights[k])
    try:
        yield
    finally:
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(saved[k])
