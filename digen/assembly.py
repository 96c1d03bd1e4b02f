"""Assembling a run's parts from its config: the policy, the reward and the compute threads
(the prompt-embedding cache beside the policy is :mod:`digen.prompt_cache`). Every mode builds
them here (the reference loop, the worker loops, the local cluster's preload, the bench), so a
policy is built one way and seeded one way.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from digen.config import Config, trained_dtype_name
from digen.models import load_policy
from digen.models.base import FlowPolicy
from digen.rewards import build_rewards

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
"""``model.dtype`` -> the torch dtype."""


def resolve_device(name: str) -> str:
    """``model.device`` (or a worker's ``--device``) as torch takes it: ``auto`` is ``cuda``
    where torch sees a GPU (a worker pinned to one by ``CUDA_VISIBLE_DEVICES`` sees it as
    ``cuda:0``), else ``cpu``; any other name is returned as given."""
    if name != "auto":
        return name
    return "cuda" if torch.cuda.is_available() else "cpu"


def trained_dtype(cfg: Config) -> torch.dtype:
    """The dtype of the trained tensors inside a policy (what a trainer computes with, so what
    it publishes to the rollout workers): ``model.lora.dtype`` for an adapter, the
    transformer's ``model.dtype`` for a full fine-tune, float64 for a float64 model."""
    m = cfg.model
    return DTYPES[trained_dtype_name(m.dtype, m.lora.enabled, m.lora.dtype)]


def build_policy(cfg: Config, device: str | None = None) -> FlowPolicy:
    """Load ``model.path`` with diffusers and wrap LoRA as configured, on ``device`` (default
    ``model.device``).

    The one seeded build: the LoRA initialisation draws from its own fixed seed in a forked
    generator (:func:`digen.models.lora.add_lora`), and the global generator is seeded with
    ``cfg.seed`` first for any third-party code that draws while loading, so two builds on the
    same kind of device give the same version 0 of the trained tensors."""
    m = cfg.model
    torch.manual_seed(cfg.seed)
    policy = load_policy(
        cfg.resolve_path(m.path),
        height=m.resolution,
        width=m.resolution,
        dtype=DTYPES[m.dtype],
        device=resolve_device(device or m.device),
        num_frames=m.num_frames,
        max_sequence_length=m.max_sequence_length,
        text_encoder_dtype=DTYPES[m.text_encoder_dtype or m.dtype],
        vae_dtype=DTYPES[m.vae_dtype],
        autocast=DTYPES[m.autocast] if m.autocast else None,
    )
    if m.lora.enabled:
        policy.enable_lora(m.lora.rank, m.lora.alpha, m.lora.target_modules, dtype=trained_dtype(cfg))
    else:
        policy.transformer.requires_grad_(True)
    return policy


def build_reward(cfg: Config, device: str | None = None):
    """The configured reward; model-based rewards load on ``device`` (default ``model.device``)."""
    return build_rewards(
        [spec.model_dump() for spec in cfg.reward], device=resolve_device(device or cfg.model.device)
    )


@contextmanager
def compute_threads(cfg: Config) -> Iterator[None]:
    """Run the block with ``cluster.local.threads_per_worker`` intra-op CPU threads (the
    count before is restored after).

    A CPU matmul, convolution or norm splits its sums across threads, so its float result
    depends on the thread count (measured on the digits model: a reward 1.8e-7 apart at 1 and
    2 threads). Every process that computes a float of a run uses this one count: the
    reference loop, each worker loop (:func:`digen.workers.loop.worker_loop`) and the trainers'
    optimizer step. With the same count, the same batches and the same summation order, the
    synchronous modes compute the reference's bits (docs/guarantees.md).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(cfg.cluster.local.threads_per_worker)
    try:
        yield
    finally:
        torch.set_num_threads(before)
