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
from digen.rewards import Reward, build_rewards

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
"""``model.dtype`` -> the torch dtype."""


def resolve_device(name: str) -> str:
    """``model.device`` (or a worker's ``--device``, ``$DIGEN_DEVICE``) as torch takes it, with
    an index on CUDA: ``auto`` is ``cuda:0`` where torch sees a GPU (a worker pinned to one by
    ``CUDA_VISIBLE_DEVICES`` sees it as ``cuda:0``), else ``cpu``; a plain ``cuda`` is
    ``cuda:0``; any other name is returned as given. Never a plain ``cuda``:
    ``torch.cuda.set_device`` refuses one (a process group could not form) and a tensor's
    device never equals it. Does not initialise CUDA."""
    if name == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    return "cuda:0" if name == "cuda" else name


CUBLAS_WORKSPACE = ":4096:8"
"""``CUBLAS_WORKSPACE_CONFIG`` for deterministic cuBLAS: eight 4 MiB workspaces per stream
(32 MiB of GPU memory); torch refuses a deterministic matmul on CUDA without it."""


def deterministic_kernels(cfg: Config, device: str) -> bool:
    """Make this process compute deterministically on CUDA when ``model.deterministic`` is on
    and ``device`` is a CUDA device; returns whether it did. Sets ``CUBLAS_WORKSPACE_CONFIG``
    (kept when the operator set one; cuBLAS reads it when this process creates its first
    handle, so call this before the first CUDA computation: :func:`build_policy` and
    :func:`build_reward` do) and ``torch.use_deterministic_algorithms(True, warn_only=True)``:
    every operation that has a deterministic CUDA kernel uses it (cuDNN, scatter and index
    backward passes, cuBLAS), and one that has none still runs, torch warning once where it
    does (a run is not stopped by a kernel torch has not made deterministic yet). Memory torch
    allocates uninitialised stays uninitialised (``fill_uninitialized_memory`` off): filling it
    costs a pass over every new tensor and changes no result digen computes."""
    if not cfg.model.deterministic or not str(device).startswith("cuda"):
        return False
    import os

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]
    torch.backends.cudnn.benchmark = False
    return True


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
    where = resolve_device(device or m.device)
    deterministic_kernels(cfg, where)
    torch.manual_seed(cfg.seed)
    policy = load_policy(
        cfg.resolve_path(m.path),
        height=m.resolution,
        width=m.resolution,
        dtype=DTYPES[m.dtype],
        device=where,
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
    if cfg.train.activation_checkpointing and not cfg.train.fsdp:  # FSDP checkpoints as it shards
        from digen.parallel.fsdp import checkpoint_blocks

        checkpoint_blocks(policy.transformer)
    return policy


def build_reward(cfg: Config, device: str | None = None) -> Reward:
    """The configured reward; model-based rewards load on ``device`` (default ``model.device``)."""
    where = resolve_device(device or cfg.model.device)
    deterministic_kernels(cfg, where)
    return build_rewards([spec.model_dump() for spec in cfg.reward], device=where)


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
