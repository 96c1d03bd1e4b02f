"""Load a worker's policy ahead of its loop: while the controller still loads its own copy.

The local cluster (:class:`digen.cluster.cluster.LocalClusterStart`) submits
:func:`preload_policy` to each worker as soon as the worker is up; the job's loop
(:mod:`digen.workers.loop`) then takes that policy (:func:`take_policy`) instead of building a
second one. A worker that was never preloaded (an external cluster, a restarted process)
builds its policy in the loop as before. Either way a worker holds one copy of the model.

A local cluster's controller loads no model: it takes version 0 of the trained tensors from a
worker (:func:`initial_weights`), built there as the reference builds them, so it needs neither diffusers nor transformers in its process.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING

from digen.config import Config

if TYPE_CHECKING:
    from digen.models.base import FlowPolicy

LOAD_LOCK = threading.Lock()
"""The libraries' lazy imports and meta-device loading are not thread-safe: one load at a time."""

_PRELOADED: dict[str, FlowPolicy] = {}
"""Model config (JSON) + device -> the policy :func:`preload_policy` built, until taken."""

_INITIAL: dict[str, dict] = {}
"""Model config (JSON) + device -> the trained tensors of a seeded build, as first built."""

LOAD_TIMES: dict[str, float] = {}
"""Wall-clock ``load_start`` / ``load_end`` of this process's last policy load (start-up profile)."""


def worker_device(cfg: Config, device: str | None = None) -> str:
    """The device a worker loads onto: ``device``, else ``$DIGEN_DEVICE``, else ``model.device``
    (``auto`` resolved: :func:`digen.assembly.resolve_device`)."""
    from digen.assembly import resolve_device

    return resolve_device(device or os.environ.get("DIGEN_DEVICE") or cfg.model.device)


def _key(cfg: Config, device: str) -> str:
    return f"{device}|{cfg.model.model_dump_json()}"


def _build(cfg: Config, device: str) -> FlowPolicy:
    """The policy, built as every mode builds it (:func:`digen.assembly.build_policy`); its
    trained tensors as built are kept for :func:`initial_weights`."""
    from digen.assembly import build_policy

    start = time.time()
    policy = build_policy(cfg, device=device)
    _INITIAL[_key(cfg, device)] = _cpu_copy(policy.trainable_state_dict())
    LOAD_TIMES.update({"load_start": start, "load_end": time.time()})
    return policy


def _cpu_copy(weights: dict) -> dict:
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in weights.items()}


def preload_policy(cfg_json: dict, threads: int = 1) -> None:
    """Build the policy of ``cfg_json``'s model on this worker and keep it for the loop."""
    import torch

    torch.set_num_threads(threads)
    cfg = Config.model_validate(cfg_json)
    device = worker_device(cfg)
    with LOAD_LOCK:
        key = _key(cfg, device)
        if key not in _PRELOADED:
            _PRELOADED[key] = _build(cfg, device)


def take_policy(cfg: Config, device: str) -> FlowPolicy:
    """The preloaded policy of ``cfg``'s model on ``device`` (handed over once), else a new one."""
    with LOAD_LOCK:
        policy = _PRELOADED.pop(_key(cfg, device), None)
        return policy if policy is not None else _build(cfg, device)


def initial_weights(cfg_json: dict, threads: int = 1) -> bytes:
    """Version 0 of the trained tensors (safetensors bytes), as the controller and the
    reference build them: seeded, on CPU. A worker on CPU hands over its own build's
    (preloaded, or built now and kept for its loop); one on another device builds a CPU copy
    once for this (the init must not draw from another device's generator)."""
    import torch
    from safetensors.torch import save

    torch.set_num_threads(threads)
    cfg = Config.model_validate(cfg_json)
    device = worker_device(cfg)
    with LOAD_LOCK:
        key = _key(cfg, "cpu")
        if key not in _INITIAL:
            policy = _build(cfg, "cpu")
            if device == "cpu":
                _PRELOADED.setdefault(key, policy)  # the loop takes this build
        return save(_INITIAL[key])
